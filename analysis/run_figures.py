"""Figures of real runs (``python -m oobleck.run``), for comparing strategies under one failure schedule.

- ``throughput_timeline``: per-step throughput over wall time, one panel per run on a shared time
  axis (from each run's first step, so that one failure schedule lines up across runs that
  took different times to start): each step a short horizontal bar at its rate over the interval it took (``step_time_s``
  up to its commit), every injected failure and join marked, every recovery (reconfiguration,
  failover, re-route, restart: from the failure to the end of the first step after it) shaded, every
  checkpoint a dotted line. Nothing is clipped: a step whose measured time is short shows as the
  spike it is.
- ``recovery_breakdown_plot``: each recovery as a horizontal bar split into its phases.
- ``time_lost_plot``: each run's training span split into useful steps, recovery, checkpoint
  stalls and other lost time (``analysis.comparison.time_lost``).

Like ``analysis.figures``, each writes PNG and PDF (``analysis.plotting.save``) and returns both
paths; the ``*_figure`` function beside it builds the figure.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd
import seaborn as sns
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from analysis.comparison import OTHER, PHASES, recovery_breakdown
from analysis.load import RunSet
from analysis.plotting import PALETTE, plt, save

# Marker styles per event kind: (colour, line style) for instants, colour for spans.
INSTANTS: dict[str, tuple[str, Any, str]] = {  # line style: any of matplotlib's
    "fault_injected": ("#c0392b", "-", "failure injected"),
    "join_started": ("#2471a3", "--", "join started"),
    "stop": ("black", ":", "stopped"),
}
SPANS = {
    "reconfiguration": ("#58d68d", "reconfiguration"),
    "failover": ("#af7ac5", "failover"),
    "reroute": ("#48c9b0", "re-route"),
    "restart": ("#f5b041", "restart"),
}
CHECKPOINT = ("0.45", "checkpoint")
PHASE_COLOURS = dict(zip([p.removesuffix("_s") for p in PHASES] + [OTHER], sns.color_palette("tab10", len(PHASES) + 1)))


def _panel_height(count: int) -> float:
    return 2.3 if count > 1 else 3.0


def step_path(rows: pd.DataFrame) -> tuple[list[float], list[float]]:
    """Each step as what it measured: its rate held over the interval it took (``step_time_s``,
    ending at its commit ``time_s``). Consecutive steps join with a vertical line; where the
    idle time before a step is longer than the step itself (a recovery, a restart) the line
    breaks, so the gap reads as the time without progress that it was."""
    xs: list[float] = []
    ys: list[float] = []
    end = None
    durations = rows["step_time_s"] if "step_time_s" in rows else pd.Series(0.0, index=rows.index)
    for t, rate, seconds in zip(rows["time_s"], rows["samples_per_s"], durations.fillna(0.0)):
        start = float(t) - float(seconds)
        if end is not None and start - end > float(seconds):
            xs.append(math.nan)
            ys.append(math.nan)
        xs += [start, float(t)]
        ys += [float(rate), float(rate)]
        end = float(t)
    return xs, ys


def training_start(rows: pd.DataFrame) -> float:
    """When a run's first step began (its commit time minus its step time): runs start up at
    different speeds, so the same schedule lines up only on this clock."""
    if rows.empty:
        return 0.0
    first = rows.sort_values("time_s", kind="stable").iloc[0]
    seconds = float(first["step_time_s"]) if "step_time_s" in rows and pd.notna(first["step_time_s"]) else 0.0
    return float(first["time_s"]) - seconds


def throughput_timeline(runs: RunSet, path: Path, *, align: bool = True) -> list[Path]:
    return save(throughput_timeline_figure(runs, align=align), path)


def throughput_timeline_figure(runs: RunSet, *, align: bool = True) -> plt.Figure:
    """``align``: time from each run's first step (``training_start``), else from its launch."""
    metrics, events = runs.metrics, runs.events
    labels = list(runs.runs["label"])
    names = list(runs.runs["run"])
    with sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(
            len(names), 1, figsize=(9, _panel_height(len(names)) * len(names)), sharex=True, squeeze=False
        )
        seen: dict[str, object] = {}
        for ax, name, label in zip(axes[:, 0], names, labels):
            rows = metrics[metrics["run"] == name].sort_values("time_s", kind="stable")
            offset = training_start(rows) if align else 0.0
            rows = rows.assign(time_s=rows["time_s"] - offset)
            strategy = str(rows["strategy"].iloc[0]) if not rows.empty else ""
            colour = PALETTE.get(strategy, "k")
            xs, ys = step_path(rows)
            ax.plot(xs, ys, color=colour, linewidth=1.3)
            ax.plot(rows["time_s"], rows["samples_per_s"], color=colour, linestyle="none", marker=".", markersize=4)
            ax.set_ylim(bottom=0)
            ax.set_title(label, loc="left", fontsize=10)
            ax.set_ylabel("samples/s")
            own = events[events["run"] == name] if not events.empty else events
            for event in own.to_dict(orient="records") if not own.empty else []:
                kind, at = event.get("kind"), float(event.get("time_s")) - offset
                if kind in INSTANTS:
                    col, style, text = INSTANTS[kind]
                    seen[text] = ax.axvline(at, color=col, linestyle=style, linewidth=1.3)
                elif kind in SPANS:
                    col, text = SPANS[kind]
                    total = float(event.get("total_s") or 0.0)
                    seen[text] = ax.axvspan(at - total, at, color=col, alpha=0.45, linewidth=0)
                elif kind == "checkpoint":
                    seen[CHECKPOINT[1]] = ax.axvline(at, color=CHECKPOINT[0], linestyle=(0, (1, 2)), linewidth=0.9)
        axes[-1, 0].set_xlabel("time since the first step started (s)" if align else "time since launch (s)")
        handles: list[Any] = []  # legend entries: lines and patches
        for text in dict.fromkeys([*(v[2] for v in INSTANTS.values()), *(v[1] for v in SPANS.values()), CHECKPOINT[1]]):
            if text not in seen:
                continue
            spec = next((v for v in INSTANTS.values() if v[2] == text), None)
            if spec is not None:
                handles.append(Line2D([], [], color=spec[0], linestyle=spec[1], label=text))
            elif text == CHECKPOINT[1]:
                handles.append(Line2D([], [], color=CHECKPOINT[0], linestyle=(0, (1, 2)), label=text))
            else:
                handles.append(Patch(color=next(v[0] for v in SPANS.values() if v[1] == text), alpha=0.45, label=text))
        fig.tight_layout()
        if handles:
            fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(handles), frameon=False)
    return fig


def recovery_breakdown_plot(runs: RunSet, path: Path) -> list[Path]:
    return save(recovery_breakdown_figure(runs), path)


def recovery_breakdown_figure(runs: RunSet) -> plt.Figure:
    long = recovery_breakdown(runs)
    with sns.axes_style("whitegrid"):
        if long.empty:
            fig, ax = plt.subplots(figsize=(6, 1.5))
            ax.text(0.5, 0.5, "no reconfiguration, failover or restart in these runs", ha="center", va="center")
            ax.set_axis_off()
            return fig
        long = long.assign(bar=long["label"] + "\n" + long["kind"] + " #" + long["recovery"].astype(str))
        bars = list(dict.fromkeys(long["bar"]))
        phases = [p for p in PHASE_COLOURS if p in set(long["phase"])]
        fig, ax = plt.subplots(figsize=(9, 0.75 * len(bars) + 1.2))
        left = pd.Series(0.0, index=bars)
        for phase in phases:
            seconds = (
                long[long["phase"] == phase].groupby("bar", sort=False)["seconds"].sum().reindex(bars, fill_value=0.0)
            )
            ax.barh(bars, seconds, left=left, color=PHASE_COLOURS[phase], label=phase.replace("_", " "))
            left += seconds
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=8)
        ax.set_xlabel("seconds (failure to the end of the first step after it)")
        fig.tight_layout()
        fig.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=min(len(phases), 5), frameon=False)
    return fig


TIME_PARTS = (
    ("useful_s", "useful steps", "#1b9e77"),
    ("recovery_s", "recovery", "#58d68d"),
    ("checkpoint_s", "checkpoint stalls", "0.6"),
    ("other_lost_s", "other lost", "#e74c3c"),
)


def time_lost_plot(table: pd.DataFrame, path: Path) -> list[Path]:
    return save(time_lost_figure(table), path)


def time_lost_figure(table: pd.DataFrame) -> plt.Figure:
    with sns.axes_style("whitegrid"):
        fig, ax = plt.subplots(figsize=(9, 0.6 * len(table) + 1.4))
        left = pd.Series(0.0, index=table.index)
        for column, text, colour in TIME_PARTS:
            # A negative remainder (steps faster than the median) is drawn as zero, not subtracted.
            width = table[column].fillna(0.0).clip(lower=0.0)
            ax.barh(table["label"], width, left=left, color=colour, label=text)
            left += width
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=8)
        ax.set_xlabel("seconds of the training span (first step to last commit)")
        fig.tight_layout()
        fig.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(TIME_PARTS), frameon=False)
    return fig

"""The paper's simulator figures drawn with seaborn from the simulator's tidy tables.

- ``throughput_vs_frequency``: bars of throughput per failure interval, one panel per model, one
  colour per strategy (the paper's failure-frequency figure); a run out of memory reads "OOM";
  with the experiment's ``band`` rows, each bar's range over the uncertain constants drawn as a
  pale band behind it, and "!" over a baseline whose ratio band crosses the cliff.
- ``throughput_over_time``: binned durable throughput over the trace as step lines, work that was
  later rolled back (or abandoned in flight) hatched above it, a grid of panels (one row per
  trace, one column per model) with the live node count shaded behind and one shared legend (the
  paper's spot-instance figures); a strategy out of memory is named in its panel.
- ``effective_time_breakdown``: stacked shares of node time (useful, redundant, checkpoint,
  restart, reconfiguration, lost, idle) per strategy and trace; a strategy that does not fit in
  memory is drawn as a hatched "out of memory" bar, not as idle time.
- ``ratio_bands`` (``analysis.ratio_bands``): Oobleck's speedup over each baseline per trace and
  model: the median over the shifted starts, their range, and the band over the uncertain
  constants, on a log scale, cells whose band crosses the cliff marked and the threshold printed.

Every figure says on the figure what its bars, whiskers, bands and shading are and which start
and constants it shows (a caption under the axes), and is written as PNG and PDF (vector, for the
paper) side by side; facet titles use readable names ("GPT-3 2.7B", "EC2 p3 spot"). Each
``<name>(..., path)`` writes the figure that ``<name>_figure(...)`` builds; ``write_figures`` draws
all that apply to a result set into a directory and returns the paths. The colours, caption, legend
and PNG-and-PDF writing every figure shares: ``analysis.plotting``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import seaborn as sns
from matplotlib.patches import Patch

from analysis.labels import model_label, strategy_label, trace_label
from analysis.load import BREAKDOWN, FREQUENCY_ORDER, breakdown, cliff_mark, first_start, frequency_label, timeline
from analysis.plotting import PALETTE, caption, plt, save, strategies_in, strategy_legend
from analysis.ratio_bands import ratio_bands

OOM_COLOUR = "0.55"


def _starts(frame: pd.DataFrame) -> int:
    return int(frame["start"].nunique()) if "start" in frame else 1


def throughput_vs_frequency(
    summary: pd.DataFrame, path: Path, band: pd.DataFrame | None = None, ratios: pd.DataFrame | None = None
) -> list[Path]:
    return save(throughput_vs_frequency_figure(summary, band, ratios), path)


def throughput_vs_frequency_figure(
    summary: pd.DataFrame, band: pd.DataFrame | None = None, ratios: pd.DataFrame | None = None
) -> plt.Figure:
    """Bars at the median over the shifted starts, whiskers from the lowest to the highest start;
    "OOM" where a strategy fits in no layout, "*" where it kept no durable progress in a start;
    with ``band``, each bar's range over the uncertain constants and the starts as a pale band,
    and with ``ratios``, "!" / "!!" over a baseline whose ratio band crosses / lies beyond the cliff."""
    data = summary.assign(interval=summary["trace"].map(frequency_label), oom=summary["oom"].astype(bool))
    if "no_durable_progress" not in data:
        data = data.assign(no_durable_progress=False)
    order = [f for f in FREQUENCY_ORDER if f in set(data["interval"])] + sorted(
        set(data["interval"]) - set(FREQUENCY_ORDER)
    )
    ranges: dict[tuple[str, str, str], dict[str, float]] = {}
    band_samples = 0
    if band is not None and not band.empty:
        ranges = band.groupby(["model", "trace", "strategy"])["throughput"].agg(["min", "max"]).to_dict("index")
        band_samples = int(band["sample"].nunique())
    marks = {}
    if ratios is not None and not ratios.empty:
        marks = {(r["model"], r["trace"], r["baseline"]): cliff_mark(r) for _, r in ratios.iterrows()}
    strategies = strategies_in(data)
    models = list(dict.fromkeys(data["model"]))
    columns = min(3, len(models))
    rows = -(-len(models) // columns)
    with sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
        width = 0.8 / len(strategies)
        for ax, model in zip(axes.flat, models):
            panel = data[data["model"] == model]
            for index, strategy in enumerate(strategies):
                rows_s = (
                    panel[panel["strategy"] == strategy]
                    .groupby("interval", sort=False)
                    .agg(
                        median=("throughput", "median"),
                        low=("throughput", "min"),
                        high=("throughput", "max"),
                        oom=("oom", "any"),
                        lost=("no_durable_progress", "any"),
                        trace=("trace", "first"),
                    )
                )
                xs = [order.index(i) + (index - (len(strategies) - 1) / 2) * width for i in rows_s.index]
                colour = PALETTE.get(strategy, "k")
                for x, trace in zip(xs, rows_s["trace"]):
                    spread = ranges.get((model, trace, strategy))
                    if spread is not None and not rows_s.loc[rows_s["trace"] == trace, "oom"].any():
                        ax.bar(
                            x,
                            spread["max"] - spread["min"],
                            bottom=spread["min"],
                            width=width * 0.95,
                            color=colour,
                            alpha=0.22,
                            linewidth=0,
                            zorder=1,
                        )
                errors = [rows_s["median"] - rows_s["low"], rows_s["high"] - rows_s["median"]]
                ax.bar(
                    xs,
                    rows_s["median"],
                    width=width * 0.55 if ranges else width,
                    color=colour,
                    yerr=errors,
                    ecolor="0.15",
                    capsize=2,
                    error_kw={"linewidth": 0.8},
                    zorder=2,
                )
                for x, oom, lost, top, trace in zip(xs, rows_s["oom"], rows_s["lost"], rows_s["high"], rows_s["trace"]):
                    if oom:
                        ax.text(x, 0, "OOM", rotation=90, ha="center", va="bottom", fontsize=8, color=colour)
                        continue
                    spread = ranges.get((model, trace, strategy))
                    label = ("*" if lost else "") + marks.get((model, trace, strategy), "")
                    if label:
                        y = max(top, spread["max"] if spread is not None else top)
                        ax.text(x, y, label, ha="center", va="bottom", fontsize=8, color=colour, fontweight="bold")
            ax.set_xticks(range(len(order)), order)
            ax.set_title(model_label(model))
            ax.set_xlabel("one node lost every")
            ax.set_ylabel("throughput (samples/s)")
        for ax in list(axes.flat)[len(models) :]:
            ax.set_visible(False)
        fig.tight_layout()
        strategy_legend(fig, strategies)
        text = (
            f"Bars: median throughput over {_starts(summary)} shifted trace starts at the nominal constants; "
            "black whiskers: the lowest to the highest start."
        )
        if ranges:
            text += (
                f" Pale bands: the lowest to the highest throughput over {band_samples} samples of the uncertain constants "
                "(sim.uncertain) and the starts."
            )
        if marks:
            text += (
                " ! over a baseline: Oobleck's ratio over it crosses the cliff over the band (its restart plus a "
                "checkpoint interval fits between failures in some samples, not in others); !!: beyond it in all."
            )
        text += " OOM: fits in no layout's memory; *: kept no durable progress in some start."
        caption(fig, text)
    return fig


def throughput_over_time(
    segments: pd.DataFrame, path: Path, bin_s: float, summary: pd.DataFrame | None = None
) -> list[Path]:
    return save(throughput_over_time_figure(segments, bin_s, summary), path)


def throughput_over_time_figure(
    segments: pd.DataFrame, bin_s: float, summary: pd.DataFrame | None = None
) -> plt.Figure:
    """``summary`` (optional) names the runs that did not fit in memory: their panels say so. Of a
    simulation with shifted starts, the first start's timeline."""
    data = timeline(segments, bin_s)
    oom = set()
    if summary is not None and "oom" in summary:
        oom = {tuple(k) for k in summary[summary["oom"].astype(bool)][["model", "trace", "strategy"]].to_numpy()}
    traces = list(dict.fromkeys(data["trace"]))
    models = list(dict.fromkeys(data["model"]))
    strategies = strategies_in(data)
    with sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(
            len(traces), len(models), figsize=(4.2 * len(models), 2.9 * len(traces)), squeeze=False, sharex="row"
        )
        for row, trace in enumerate(traces):
            for column, model in enumerate(models):
                ax = axes[row][column]
                panel = data[(data["model"] == model) & (data["trace"] == trace)]
                # Nodes alive, shaded behind the throughput lines on their own (right) axis.
                nodes = panel[panel["strategy"] == strategies[0]] if not panel.empty else panel
                twin = ax.twinx()
                twin.fill_between(
                    nodes["time_h"], nodes["nodes_alive"], step="post", color="0.85", zorder=0, linewidth=0
                )
                twin.set_ylim(0, max(1.0, float(data["nodes_alive"].max())) * 1.05)
                twin.grid(False)
                twin.tick_params(axis="y", labelsize=7, colors="0.45")
                if column == len(models) - 1:
                    twin.set_ylabel("nodes alive", color="0.45", fontsize=8)
                ax.set_zorder(twin.get_zorder() + 1)
                ax.patch.set_visible(False)
                for strategy in strategies:
                    line = panel[panel["strategy"] == strategy]
                    colour = PALETTE.get(strategy, "k")
                    ax.step(line["time_h"], line["samples_per_s"], where="post", color=colour, linewidth=1.4)
                    if (line["rolled_back_per_s"] > 0).any():
                        ax.fill_between(
                            line["time_h"],
                            line["samples_per_s"],
                            line["samples_per_s"] + line["rolled_back_per_s"],
                            step="post",
                            facecolor="none",
                            edgecolor=colour,
                            hatch="////",
                            linewidth=0,
                            alpha=0.7,
                        )
                ax.set_ylim(bottom=0)
                missing = [strategy_label(s) for s in strategies if (model, trace, s) in oom]
                if missing:
                    ax.text(
                        0.98,
                        0.04,
                        f"{', '.join(missing)}: out of memory",
                        transform=ax.transAxes,
                        ha="right",
                        va="bottom",
                        fontsize=8,
                        color="0.2",
                        bbox={"facecolor": "white", "edgecolor": "0.7", "pad": 2},
                    )
                ax.set_title(f"{model_label(model)}, {trace_label(trace)}", fontsize=10)
                ax.set_xlabel("time (h)" if row == len(traces) - 1 else "")
                ax.set_ylabel("samples/s" if column == 0 else "")
        fig.tight_layout()
        rolled = Patch(facecolor="none", edgecolor="0.3", hatch="////", label="work later rolled back")
        strategy_legend(fig, strategies, [Patch(color="0.85", label="nodes alive"), rolled])
        caption(
            fig,
            f"Lines: durable throughput (samples of iterations never rolled back), binned per {bin_s / 60:g} min, of "
            "the unshifted trace (start 0) at the nominal constants. Hatched above a line: work done there that a "
            "later restart rolled back or a change abandoned in flight. Grey: nodes alive (right axis).",
        )
    return fig


def effective_time_breakdown(summary: pd.DataFrame, path: Path) -> list[Path]:
    return save(effective_time_breakdown_figure(summary), path)


def effective_time_breakdown_figure(summary: pd.DataFrame) -> plt.Figure:
    summary = first_start(summary)
    long = breakdown(summary)
    oom = summary.set_index(["model", "trace", "strategy"])["oom"].astype(bool).to_dict()
    long = long.assign(
        run=long["strategy"].map(strategy_label) + "\n" + long["trace"].map(lambda t: trace_label(t, short=True)),
        oom=[oom.get(k, False) for k in zip(long["model"], long["trace"], long["strategy"])],
    )
    models = list(dict.fromkeys(long["model"]))
    colours = dict(zip(BREAKDOWN, sns.color_palette("Set2", len(BREAKDOWN))))
    with sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(
            len(models), 1, figsize=(max(6, 0.6 * long["run"].nunique() + 2), 3.2 * len(models)), squeeze=False
        )
        for ax, model in zip(axes[:, 0], models):
            panel = long[long["model"] == model]
            wide = panel.pivot_table(index="run", columns="category", values="fraction", sort=False)
            wide = wide[[c for c in BREAKDOWN if c in wide]]
            out_of_memory = panel.groupby("run", sort=False)["oom"].any()
            # A run that never started has all its node time idle: that is not what happened.
            wide.loc[out_of_memory[out_of_memory].index] = 0.0
            wide.plot(
                kind="bar", stacked=True, ax=ax, color=[colours[c] for c in wide.columns], width=0.8, legend=False
            )
            for x, run in enumerate(wide.index):
                if out_of_memory[run]:
                    ax.bar(x, 1.0, width=0.8, color="white", edgecolor=OOM_COLOUR, hatch="///", linewidth=0.8)
                    ax.text(
                        x,
                        0.5,
                        "out of\nmemory",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="0.25",
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 1},
                    )
            ax.set_title(model_label(model), loc="left")
            ax.set_ylabel("share of node time")
            ax.set_xlabel("")
            ax.set_ylim(0, 1)
            ax.tick_params(axis="x", labelsize=7, rotation=0)
        handles = [Patch(color=colours[c], label=c) for c in BREAKDOWN]
        handles.append(Patch(facecolor="white", edgecolor=OOM_COLOUR, hatch="///", label="out of memory"))
        fig.tight_layout()
        fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4, frameon=False)
        caption(
            fig,
            "Shares of the node time of alive nodes in one simulation per bar: the unshifted trace (start 0) at the "
            "nominal constants. 'lost': work rolled back or abandoned in flight; 'idle': alive nodes no layout uses.",
        )
    return fig


def write_figures(
    segments: pd.DataFrame,
    summary: pd.DataFrame,
    run_dir: Path,
    *,
    bin_s: float = 300.0,
    band: pd.DataFrame | None = None,
    ratios: pd.DataFrame | None = None,
) -> list[Path]:
    """All figures for this result set into ``run_dir`` (PNG and PDF each); returns the paths."""
    run_dir = Path(run_dir)
    written: list[Path] = []
    if summary.empty:
        return written
    synthetic = summary[summary["trace"].astype(str).str.startswith("synthetic/")]
    if not synthetic.empty:
        written += throughput_vs_frequency(synthetic, run_dir / "throughput_vs_frequency.png", band, ratios)
    written += throughput_over_time(segments, run_dir / "throughput_over_time.png", bin_s, summary)
    written += effective_time_breakdown(summary, run_dir / "effective_time_breakdown.png")
    if ratios is not None and not ratios.empty and ratios["ratio_median"].notna().any():
        written += ratio_bands(ratios, run_dir / "ratio_bands.png")
    return written

"""The paper's simulator figures drawn with seaborn from the simulator's tidy tables.

- ``throughput_vs_frequency``: bars of throughput per failure interval, one panel per model, one
  colour per strategy (the paper's failure-frequency figure); OOM runs are marked.
- ``throughput_over_time``: step lines of binned throughput over the trace, one panel per (model,
  trace) (the paper's spot-instance figures), with the live node count underneath.
- ``effective_time_breakdown``: stacked shares of node time (useful, redundant, checkpoint,
  restart, reconfiguration, lost, idle) per strategy and trace.

``write_figures`` draws all that apply to a result set into a run dir and returns the paths.
"""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
# Categorical axes log an INFO line per bar group; keep run logs to what matters.
logging.getLogger("matplotlib").setLevel(logging.WARNING)

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from analysis.load import BREAKDOWN, FREQUENCY_ORDER, breakdown, frequency_label, timeline  # noqa: E402

STRATEGY_ORDER = ("oobleck", "varuna", "bamboo")
PALETTE = {"oobleck": "#1b9e77", "varuna": "#d95f02", "bamboo": "#7570b3"}


def _strategies(frame: pd.DataFrame) -> list[str]:
    present = list(dict.fromkeys(frame["strategy"]))
    return [s for s in STRATEGY_ORDER if s in present] + [s for s in present if s not in STRATEGY_ORDER]


def throughput_vs_frequency(summary: pd.DataFrame, path: Path) -> Path:
    data = summary.assign(interval=summary["trace"].map(frequency_label))
    order = [f for f in FREQUENCY_ORDER if f in set(data["interval"])] + sorted(
        set(data["interval"]) - set(FREQUENCY_ORDER)
    )
    strategies = _strategies(data)
    with sns.axes_style("whitegrid"):
        grid = sns.catplot(
            data=data,
            kind="bar",
            x="interval",
            y="throughput",
            hue="strategy",
            col="model",
            col_wrap=min(3, data["model"].nunique()),
            order=order,
            hue_order=strategies,
            palette=PALETTE,
            sharey=False,
            height=3.2,
            aspect=1.2,
        )
        grid.set_axis_labels("one node lost every", "throughput (samples/s)")
        for model, ax in grid.axes_dict.items():
            oom = data[(data["model"] == model) & data["oom"].astype(bool)]
            for _, row in oom.iterrows():
                x = order.index(row["interval"]) + (strategies.index(row["strategy"]) - (len(strategies) - 1) / 2) * 0.8 / len(strategies)
                ax.text(x, 0, "OOM", rotation=90, ha="center", va="bottom", fontsize=8, color=PALETTE.get(row["strategy"], "k"))
        grid.figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(grid.figure)
    return path


def throughput_over_time(segments: pd.DataFrame, path: Path, bin_s: float) -> Path:
    data = timeline(segments, bin_s)
    panels = data.groupby(["model", "trace"], sort=False).size().index.tolist()
    strategies = _strategies(data)
    with sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(
            2 * len(panels), 1, figsize=(8, 3.6 * len(panels)), sharex=False, squeeze=False,
            gridspec_kw={"height_ratios": [3, 1] * len(panels)},
        )
        for index, (model, trace) in enumerate(panels):
            top, bottom = axes[2 * index][0], axes[2 * index + 1][0]
            panel = data[(data["model"] == model) & (data["trace"] == trace)]
            sns.lineplot(
                data=panel, x="time_h", y="samples_per_s", hue="strategy", hue_order=strategies,
                palette=PALETTE, drawstyle="steps-post", ax=top,
            )
            top.set_title(f"{model} on {trace}", loc="left")
            top.set_xlabel("")
            top.set_ylabel("samples/s")
            nodes = panel[panel["strategy"] == strategies[0]]
            sns.lineplot(data=nodes, x="time_h", y="nodes_alive", color="0.3", drawstyle="steps-post", ax=bottom)
            bottom.set_xlabel("time (h)")
            bottom.set_ylabel("nodes")
        fig.tight_layout()
        fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def effective_time_breakdown(summary: pd.DataFrame, path: Path) -> Path:
    long = breakdown(summary)
    long = long.assign(run=long["strategy"] + "\n" + long["trace"].map(frequency_label))
    models = list(dict.fromkeys(long["model"]))
    colours = dict(zip(BREAKDOWN, sns.color_palette("Set2", len(BREAKDOWN))))
    with sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(len(models), 1, figsize=(max(6, 0.55 * long["run"].nunique() + 2), 3.4 * len(models)), squeeze=False)
        for ax, model in zip(axes[:, 0], models):
            wide = long[long["model"] == model].pivot_table(index="run", columns="category", values="fraction", sort=False)
            wide = wide[[c for c in BREAKDOWN if c in wide]]
            wide.plot(kind="bar", stacked=True, ax=ax, color=[colours[c] for c in wide.columns], width=0.8, legend=False)
            ax.set_title(model, loc="left")
            ax.set_ylabel("share of node time")
            ax.set_xlabel("")
            ax.set_ylim(0, 1)
            ax.tick_params(axis="x", labelsize=7, rotation=0)
        handles, labels = axes[0, 0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False)
        fig.tight_layout(rect=(0, 0, 1, 0.95))
        fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def write_figures(segments: pd.DataFrame, summary: pd.DataFrame, run_dir: Path, *, bin_s: float = 300.0) -> list[Path]:
    """All figures for this result set into ``run_dir``; returns the written paths."""
    run_dir = Path(run_dir)
    written: list[Path] = []
    if summary.empty:
        return written
    if summary["trace"].str.startswith("synthetic/").any():
        synthetic = summary[summary["trace"].str.startswith("synthetic/")]
        written.append(throughput_vs_frequency(synthetic, run_dir / "throughput_vs_frequency.png"))
    written.append(throughput_over_time(segments, run_dir / "throughput_over_time.png", bin_s))
    written.append(effective_time_breakdown(summary, run_dir / "effective_time_breakdown.png"))
    return written

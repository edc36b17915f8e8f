"""The ratio figure: Oobleck's speedup over each baseline per trace and model (``ratio_bands``),
from the simulator's ratio table (``sim_ratios.csv``): the median over the shifted starts, their
range and the band over the uncertain constants on a log axis (``ratio_ticks`` labels it), cells
whose band crosses the cliff marked, and cells that no strategy could lay out said so
(``no_layout_cells``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns

from analysis.labels import model_label, strategy_label, trace_label
from analysis.load import cliff_mark
from analysis.plotting import PALETTE, caption, plt, save

# A (model, trace) cell no strategy could lay out (Oobleck out of memory too, and no baseline ran).
NO_LAYOUT = "no layout fits"
# The fewest labelled ticks a ratio panel shows, however narrow its range.
MIN_RATIO_TICKS = 3


def no_layout_cells(ratios: pd.DataFrame) -> set[tuple[str, str]]:
    """(model, trace) cells where Oobleck did not fit and no baseline has a ratio either."""
    if "oobleck_oom" not in ratios:
        return set()
    cells = set()
    for cell, rows in ratios.groupby(["model", "trace"], sort=False):
        no_ratio = rows["ratio_median"].isna() & (rows["ratio_low"].isna() if "ratio_low" in rows else True)
        if rows["oobleck_oom"].astype(bool).all() and no_ratio.all():
            cells.add(cell)
    return cells


def ratio_ticks(low: float, high: float) -> list[float]:
    """Labelled ticks of a log ratio axis from ``low`` to ``high``: decades over a span of more
    than 100x, 1-2-5 steps over a middling one, finer log steps over a narrow one, and where those
    leave fewer than ``MIN_RATIO_TICKS`` inside (Bamboo's ratios of 1-1.07x) evenly spaced round
    values, which a span that narrow draws evenly on a log axis too."""
    from matplotlib.ticker import LogLocator, MaxNLocator

    span = high / low
    subs = (1.0,) if span > 100 else (1.0, 2.0, 5.0) if span > 4 else (1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 7.5)
    ticks = [float(t) for t in LogLocator(subs=subs).tick_values(low, high) if low <= t <= high]
    if len(ticks) >= MIN_RATIO_TICKS:
        return ticks
    even = MaxNLocator(nbins=4, steps=[1, 2, 2.5, 5, 10]).tick_values(low, high)
    return [float(round(t, 10)) for t in even if low <= t <= high and t > 0]


def ratio_bands(ratios: pd.DataFrame, path: Path) -> list[Path]:
    return save(ratio_bands_figure(ratios), path)


def ratio_bands_figure(ratios: pd.DataFrame) -> plt.Figure:
    """Oobleck's speedup over each baseline, one panel per baseline, one row of points per model
    and trace: the median over the starts (dot), their range (thick bar) and the band over the
    uncertain constants (thin line, an arrow where unbounded), cells crossing the cliff marked; a
    baseline that made no progress at the nominal constants shows its band only, one without a
    ratio says why (OOM, does not run), and a cell no strategy could lay out reads "no layout
    fits". Every panel has at least ``MIN_RATIO_TICKS`` labelled ticks (``ratio_ticks``)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    shown = ratios["ratio_median"].notna()
    if "ratio_low" in ratios:
        shown |= ratios["ratio_low"].notna()  # a baseline that stalled at the nominal constants: its band only
    data = ratios[shown]
    baselines = list(dict.fromkeys(ratios["baseline"]))
    # Every cell gets its row: one no strategy could lay out says so rather than going missing.
    cells = list(dict.fromkeys(zip(ratios["model"], ratios["trace"])))
    unlaid = no_layout_cells(ratios)
    with sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(
            1, len(baselines), figsize=(4.6 * len(baselines), 0.28 * len(cells) + 1.6), squeeze=False, sharey=True
        )
        for ax, baseline in zip(axes[0], baselines):
            rows = data[data["baseline"] == baseline].set_index(["model", "trace"])
            colour = PALETTE.get(baseline, "k")
            top = (
                float(np.nanmax(rows[["ratio_max", "ratio_high", "ratio_low"]].to_numpy()))
                if "ratio_high" in rows and len(rows)
                else 2.0
            )
            top = max(top if np.isfinite(top) else 2.0, 2.0) * 1.6
            unshown = ratios[(ratios["baseline"] == baseline) & ~shown].set_index(["model", "trace"])
            for y, cell in enumerate(cells):
                if cell not in rows.index:
                    if cell in unlaid:
                        ax.text(1.0, y, f" {NO_LAYOUT}", fontsize=7, ha="left", va="center", color="0.1")
                    elif cell in unshown.index:  # out of memory, does not run: said, not left blank
                        note = unshown.loc[cell].get("note")
                        label = str(note) if isinstance(note, str) and note else "no ratio"
                        ax.text(1.0, y, f" {label}", fontsize=7, ha="left", va="center", color="0.3")
                    continue
                row = rows.loc[cell]
                if "ratio_low" in row and pd.notna(row["ratio_low"]):
                    high = top if int(row.get("band_unbounded", 0) or 0) else float(row["ratio_high"])
                    ax.plot([max(row["ratio_low"], 1e-2), high], [y, y], color=colour, linewidth=1.0, alpha=0.7)
                    if int(row.get("band_unbounded", 0) or 0):
                        ax.annotate(
                            "", xy=(top, y), xytext=(top / 1.3, y), arrowprops={"arrowstyle": "->", "color": colour}
                        )
                    mark = cliff_mark(row)
                    if mark:
                        ax.text(high, y + 0.15, f" {mark}", color="0.1", fontsize=8, va="bottom", fontweight="bold")
                if pd.isna(row["ratio_median"]):
                    ax.text(
                        max(row["ratio_low"], 1e-2),
                        y - 0.15,
                        "no progress at the nominal constants ",
                        fontsize=7,
                        ha="right",
                        va="bottom",
                        color="0.2",
                    )
                    continue
                ax.plot([row["ratio_min"], row["ratio_max"]], [y, y], color=colour, linewidth=4, alpha=0.6)
                ax.plot(row["ratio_median"], y, "o", color=colour, markersize=4)
            ax.axvline(1.0, color="0.4", linewidth=0.8)
            ax.set_xscale("log")
            low, high = ax.get_xlim()
            ax.xaxis.set_major_locator(FixedLocator(ratio_ticks(low, high)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}x"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_title(f"Oobleck / {strategy_label(baseline)}", fontsize=10)
            ax.set_yticks(range(len(cells)), [f"{model_label(m)}, {trace_label(t, short=True)}" for m, t in cells])
        axes[0][0].invert_yaxis()  # the axes share y: once puts the first cell on top
        fig.tight_layout()
        caption(
            fig,
            "Dot: Oobleck's throughput over the baseline's, median over the shifted starts at the nominal constants; "
            "thick bar: the lowest to the highest start; thin line: the band over the samples of the uncertain "
            "constants (sim.uncertain) and the starts (an arrow: unbounded, the baseline made no progress in some). "
            "!: the band crosses the cliff (the baseline's restart plus a checkpoint interval fits between failures "
            "in some samples and not in others); !!: beyond it in all. The thresholds are in sim_ratios.csv "
            "(cycle_low_s, cycle_high_s against failure_interval_s).",
        )
    return fig

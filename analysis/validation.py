"""Out-of-sample validation table of the simulator against real runs (issue 6).

``validation_table(calibration, runs)`` measures the runtime overhead on calibration runs
(``oobleck.sim.validate.calibrate_runs``; one of them with a failure) and predicts each other run with it (the ``predicted``
model of ``oobleck.sim.validate.compare``): one tidy row per run and metric.

``across_repeats(table)`` summarises repeated runs of the same case (``benchmarks/bench_validation.py
--repeats``): one row per case and metric with the median ratio and its range, so that one run
slowed by other jobs on the shared cores does not decide a row.

CLI: ``python -m analysis.validation --calibration CAL_RUN_DIR [--calibration ...] RUN_DIR [RUN_DIR ...]
[--out FILE.csv]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from oobleck.errors import RunError, report_errors


def validation_table(calibration: list[str | Path], runs: list[str | Path]) -> pd.DataFrame:
    """The ``predicted`` rows for every run, calibrated on ``calibration`` (never one of ``runs``)."""
    from oobleck.sim.validate import calibrate_runs, validate_run

    calibrated = {Path(c).resolve() for c in calibration}
    for run in runs:
        if Path(run).resolve() in calibrated:
            raise RunError(f"run {run} is also a calibration run: predict only other runs")
    runtime = calibrate_runs(list(calibration))
    frames = []
    for run in runs:
        table = validate_run(run, runtime=runtime).table
        table = table[table["model"] == "predicted"].drop(columns=["model", "fitted"])
        frames.append(table.assign(run=str(run), calibration=runtime.source))
    out = pd.concat(frames, ignore_index=True)
    out.attrs["runtime"] = runtime
    return out


def across_repeats(table: pd.DataFrame, case: str = "case") -> pd.DataFrame:
    """One row per ``case`` and metric of a ``validation_table`` over repeated runs of each case:
    the medians of measured, simulated and their ratio, the ratio's range, ``within_target`` by
    the median ratio (the rule of ``oobleck.sim.validate.compare``: ``|ratio - 1| <= target``)
    and how many of the repeats were within target on their own."""
    missing = {case, "metric", "measured", "simulated", "ratio", "target", "within_target"} - set(table.columns)
    if missing:
        raise RunError(
            f"across_repeats: the table has no column {sorted(missing)} (a validation_table with a {case!r} column)"
        )
    groups = table.groupby([case, "metric"], sort=False)
    out = groups.agg(
        repeats=("ratio", "size"),
        measured=("measured", "median"),
        simulated=("simulated", "median"),
        target=("target", "first"),
        ratio=("ratio", "median"),
        ratio_min=("ratio", "min"),
        ratio_max=("ratio", "max"),
        repeats_within=("within_target", "sum"),
    ).reset_index()
    out["within_target"] = (out["ratio"] - 1.0).abs() <= out["target"]
    out["repeats_within"] = out["repeats_within"].astype(int)
    return out


MODEL_ORDER = ("planner", "calibrated", "predicted")
MODEL_COLOURS = {"planner": "#7f8c8d", "calibrated": "#2980b9", "predicted": "#c0392b"}
METRIC_TITLES = {
    "steady_iteration_s": "step time, first layout",
    "later_iteration_s": "step time, after the change",
    "throughput": "throughput over the run",
    "recovery_s": "recovery time",
}


def ratio_plot(table: pd.DataFrame, path: Path) -> list[Path]:
    """``ratio_figure`` as PNG and PDF."""
    from analysis.plotting import save

    return save(ratio_figure(table), path)


def ratio_figure(table: pd.DataFrame) -> Any:
    """Simulated over measured per metric (log scale), one dot per run and model, the target
    band shaded around 1."""
    import seaborn as sns
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from analysis.plotting import plt

    metrics = [m for m in METRIC_TITLES if m in set(table["metric"])] + sorted(
        set(table["metric"]) - set(METRIC_TITLES)
    )
    models = [m for m in MODEL_ORDER if m in set(table["model"])]
    ratio = FuncFormatter(lambda value, _: f"{value:g}x")
    with sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(1, len(metrics), figsize=(3.3 * len(metrics), 3.3), squeeze=False)
        for ax, metric in zip(axes[0], metrics):
            rows = table[table["metric"] == metric]
            target = float(rows["target"].iloc[0])
            ax.axhspan(1 - target, 1 + target, color="0.88", zorder=0, label="target")
            ax.axhline(1.0, color="0.4", linewidth=0.8)
            sns.stripplot(
                data=rows,
                x="model",
                y="ratio",
                hue="model",
                order=models,
                hue_order=models,
                palette=MODEL_COLOURS,
                ax=ax,
                size=7,
                legend=False,
                jitter=0.15,
            )
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ratio)
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_title(METRIC_TITLES.get(metric, metric), fontsize=10)
            ax.set_xlabel("")
            ax.set_ylabel("simulated / measured" if ax is axes[0][0] else "")
        fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.validation", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--calibration",
        action="append",
        required=True,
        help="run dir the runtime overhead is measured on (repeatable; one with a failure)",
    )
    parser.add_argument("runs", nargs="+", help="run dirs to predict")
    parser.add_argument("--out", default=None, help="write the table as CSV here")
    args = parser.parse_args(argv)
    with report_errors("analysis.validation"):
        table = validation_table(args.calibration, args.runs)
        print(f"runtime overhead: {table.attrs['runtime']}")
        print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        if args.out:
            table.to_csv(args.out, index=False)
        return 0 if bool(table["within_target"].all()) else 1
    return 2  # unreachable: report_errors exits


if __name__ == "__main__":
    sys.exit(main())

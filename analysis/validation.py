"""Out-of-sample validation table of the simulator against real runs (issue 6).

``validation_table(calibration, runs)`` measures the runtime overhead on calibration runs
(``oobleck.sim.validate.calibrate_runs``; one of them with a failure) and predicts each other run with it (the ``predicted``
model of ``oobleck.sim.validate.compare``): one tidy row per run and metric.

CLI: ``python -m analysis.validation --calibration CAL_RUN_DIR [--calibration ...] RUN_DIR [RUN_DIR ...]
[--out FILE.csv]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.validation", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--calibration", action="append", required=True, help="run dir the runtime overhead is measured on (repeatable; one with a failure)"
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

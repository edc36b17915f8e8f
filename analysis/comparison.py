"""Real-run comparison tables: where each run's time went and what each recovery cost.

Both read a ``RunSet`` (``analysis.load``), whose runs should share a failure schedule:

- ``recovery_breakdown``: one row per phase of every reconfiguration, failover and restart in
  events.csv (detect, plan, stop, spawn, groups, load, state copy, first step), plus ``other``,
  the part of ``total_s`` no phase accounts for (so the bar is as long as the recovery was);
- ``time_lost``: per run, the training span (start of the first step to the last commit), what
  the committed steps would have taken at the run's own steady step time (``useful_s``), and the
  rest split into recovery (each recovery's ``total_s`` beyond one steady step: its first step
  is useful work), blocking checkpoint time (``snapshot_s``; writes are asynchronous) and other
  lost time (redone steps after a rollback, steps slower than the steady one).
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from analysis.load import RunSet

RECOVERY_KINDS = ("reconfiguration", "failover", "restart")
# The phases the runtime reports for each recovery kind (events.csv), in the order they happen.
PHASES = ("detect_s", "plan_s", "stop_s", "spawn_s", "groups_s", "load_s", "state_copy_s", "first_step_s")
OTHER = "other"
# Tolerance for "the phases add up to the total": events.csv rounds each field to 0.1 ms.
ROUNDING_S = 1e-3


def _number(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return math.nan
    return number


def recovery_breakdown(runs: RunSet) -> pd.DataFrame:
    """Columns: run, label, strategy, kind, recovery (1, 2, ... per run), time_s (when it ended),
    phase (``PHASES`` without ``_s``, or ``other``), seconds."""
    events = runs.events
    columns = ["run", "label", "strategy", "kind", "recovery", "time_s", "phase", "seconds"]
    if events.empty or "kind" not in events:
        return pd.DataFrame(columns=columns)
    rows = []
    recoveries = events[events["kind"].isin(RECOVERY_KINDS)].sort_values(["run", "time_s"], kind="stable")
    for _run, group in recoveries.groupby("run", sort=False):
        for number, event in enumerate(group.to_dict(orient="records"), start=1):
            base = {k: event[k] for k in ("run", "label", "strategy", "kind", "time_s")} | {"recovery": number}
            accounted = 0.0
            for phase in PHASES:
                seconds = _number(event.get(phase))
                if math.isfinite(seconds):
                    rows.append({**base, "phase": phase.removesuffix("_s"), "seconds": seconds})
                    accounted += seconds
            total = _number(event.get("total_s"))
            if math.isfinite(total) and total - accounted > ROUNDING_S:
                rows.append({**base, "phase": OTHER, "seconds": total - accounted})
    return pd.DataFrame(rows, columns=columns)


def _steady_step_s(metrics: pd.DataFrame) -> float:
    """Median step time without each generation's first step (it absorbs a recovery) and
    without retried steps."""
    if "step_time_s" not in metrics or metrics.empty:
        return math.nan
    steady = metrics
    if "generation" in metrics:
        steady = steady[steady["generation"].duplicated()]
    if "attempts" in steady:
        steady = steady[steady["attempts"] <= 1]
    return float(steady["step_time_s"].median()) if not steady.empty else float(metrics["step_time_s"].median())


def time_lost(runs: RunSet) -> pd.DataFrame:
    """One row per run: span_s, committed_steps, redone_steps, steady_step_s, useful_s,
    recovery_s, checkpoint_s, other_lost_s, lost_s (= span_s - useful_s), goodput (samples/s of
    distinct committed steps over the span), recoveries, restarts."""
    rows = []
    for run in runs.runs.to_dict(orient="records"):
        metrics = runs.metrics[runs.metrics["run"] == run["run"]].sort_values("time_s", kind="stable")
        events = runs.events[runs.events["run"] == run["run"]] if not runs.events.empty else runs.events
        if metrics.empty:
            continue
        first_step = _number(metrics["step_time_s"].iloc[0]) if "step_time_s" in metrics else 0.0
        start = float(metrics["time_s"].iloc[0]) - (first_step if math.isfinite(first_step) else 0.0)
        span = float(metrics["time_s"].iloc[-1]) - start
        committed = int(metrics["step"].nunique())
        steady = _steady_step_s(metrics)
        useful = committed * steady if math.isfinite(steady) else math.nan
        kinds = events["kind"] if not events.empty else pd.Series(dtype=object)
        recovering = events[kinds.isin(RECOVERY_KINDS)] if not events.empty else events
        # A recovery's total runs to the end of its first step, which useful_s already counts at
        # the steady step time: only the excess is lost to the recovery.
        totals = (
            pd.to_numeric(recovering["total_s"], errors="coerce") if "total_s" in recovering else pd.Series(dtype=float)
        )
        recovery = float((totals - (steady if math.isfinite(steady) else 0.0)).clip(lower=0.0).sum())
        checkpoints = events[kinds == "checkpoint"] if not events.empty else events
        snapshots = (
            pd.to_numeric(checkpoints["snapshot_s"], errors="coerce")
            if "snapshot_s" in checkpoints
            else pd.Series(dtype=float)
        )
        checkpoint = float(snapshots.sum())
        samples = metrics.drop_duplicates("step", keep="last")["samples"].sum() if "samples" in metrics else math.nan
        rows.append(
            {
                "run": run["run"],
                "label": run["label"],
                "strategy": run["strategy"],
                "span_s": span,
                "committed_steps": committed,
                "redone_steps": int(len(metrics) - committed),
                "steady_step_s": steady,
                "useful_s": useful,
                "recovery_s": recovery,
                "checkpoint_s": checkpoint,
                "other_lost_s": span - useful - recovery - checkpoint,
                "lost_s": span - useful,
                "goodput": float(samples) / span if span > 0 else math.nan,
                "recoveries": int(kinds.isin(("reconfiguration", "failover")).sum()),
                "restarts": int((kinds == "restart").sum()),
            }
        )
    return pd.DataFrame(rows)


def strategy_table(runs: RunSet, reference: str = "oobleck") -> pd.DataFrame:
    """One row per run of a strategy comparison (the runs share a failure schedule): goodput
    (samples/s of distinct committed steps over the training span), time lost, the median time of
    each kind of recovery and how many there were, steps rolled back by restarts, and Oobleck's
    goodput over each run's (``<reference>/<strategy>``, the paper's ratio)."""
    lost = time_lost(runs)
    if lost.empty:
        return lost
    rows = []
    for row in lost.to_dict(orient="records"):
        events = runs.events[runs.events["run"] == row["run"]] if not runs.events.empty else runs.events
        out = {
            k: row[k]
            for k in ("run", "strategy", "goodput", "span_s", "lost_s", "recovery_s", "checkpoint_s", "redone_steps")
        }
        for kind in RECOVERY_KINDS:
            chosen = events[events["kind"] == kind] if not events.empty else events
            totals = (
                pd.to_numeric(chosen["total_s"], errors="coerce") if "total_s" in chosen else pd.Series(dtype=float)
            )
            out[f"{kind}s"] = int(len(chosen))
            out[f"{kind}_median_s"] = float(totals.median()) if not totals.empty else math.nan
        rows.append(out)
    table = pd.DataFrame(rows)
    ours = table.loc[table["strategy"] == reference, "goodput"]
    table[f"{reference}_over_this"] = float(ours.iloc[0]) / table["goodput"] if not ours.empty else math.nan
    return table


def main(argv: list[str] | None = None) -> int:
    """``python -m analysis.comparison DIR...``: the strategy table of run dirs or Hydra sweeps."""
    import argparse

    from analysis.load import load_run_set
    from oobleck.errors import report_errors

    parser = argparse.ArgumentParser(
        prog="python -m analysis.comparison", description=strategy_table.__doc__.split("\n\n")[0]
    )
    parser.add_argument("dirs", nargs="+", help="run dirs of python -m oobleck.run, or multirun/<date> sweep dirs")
    parser.add_argument("--csv", default=None, help="also write the table here")
    args = parser.parse_args(argv)
    from pathlib import Path

    with report_errors("analysis.comparison"):
        paths = [Path(d) for d in args.dirs]
        sweeps = [p for p in paths if (p / "multirun.yaml").is_file() or not (p / "metrics.csv").is_file()]
        runs = load_run_set([p for p in paths if p not in sweeps], sweeps)
        table = strategy_table(runs)
        print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        if args.csv:
            table.to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

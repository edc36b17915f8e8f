"""Real-run comparison tables: where each run's time went and what each recovery cost.

Both read a ``RunSet`` (``analysis.load``), whose runs should share a failure schedule:

- ``recovery_breakdown``: one row per phase of every reconfiguration, failover and restart in
  events.csv (detect, plan, stop, spawn, groups, load, state copy, first step), plus ``other``,
  the part of ``total_s`` no phase accounts for (so the bar is as long as the recovery was);
- ``time_lost``: per run, the training span (start of the first step to the last commit), what
  the committed steps would have taken at the run's own steady step time (``useful_s``), and the
  rest split into recovery (each recovery's ``total_s`` beyond one steady step: its first step
  is useful work), blocking checkpoint time (``snapshot_s``; writes are asynchronous) and other
  lost time (redone steps after a rollback, steps slower than the steady one);
- ``protocol_table`` / ``protocol_summary``: the runs of a measurement protocol
  (``benchmarks/protocol.py``: interleaved repeats, seeded failure steps, crash and hang apart)
  read through its ``protocol.json``; each run's goodput and recovery time paired with the
  reference strategy's run of the same round, fault type and notice, then medians with min-max
  over the rounds, the host's load and the warnings a reader must see (``host_warnings``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.load import RunSet

# In-place recoveries (the job keeps its committed state), then restarts from a checkpoint.
IN_PLACE_KINDS = ("reconfiguration", "failover", "reroute")
RECOVERY_KINDS = (*IN_PLACE_KINDS, "restart")
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
                "recoveries": int(kinds.isin(IN_PLACE_KINDS).sum()),
                "restarts": int((kinds == "restart").sum()),
            }
        )
    return pd.DataFrame(rows)


# The injected fault (events.csv ``fault`` of fault_injected rows) and the fault type it reports as.
FAULT_TYPES = {"remove": "crash", "freeze": "hang"}


def fault_type(events: pd.DataFrame) -> str:
    """A run's fault type from its injected faults: crash (SIGKILL), hang (SIGSTOP), none, or both
    joined by '+' (a schedule that mixes them: its recovery figures mix two detections)."""
    if events.empty or "kind" not in events or "fault" not in events:
        return "none"
    injected = events.loc[events["kind"] == "fault_injected", "fault"].dropna().astype(str)
    kinds = sorted({FAULT_TYPES.get(f, f) for f in injected if f in FAULT_TYPES})
    return "+".join(kinds) if kinds else "none"


def strategy_table(runs: RunSet, reference: str = "oobleck") -> pd.DataFrame:
    """One row per run of a strategy comparison (the runs share a failure schedule): its fault
    type (``fault_type``: crash and hang recoveries differ by their detection), goodput
    (samples/s of distinct committed steps over the training span), time lost, the median time of
    each kind of recovery and how many there were, steps rolled back by restarts, and Oobleck's
    goodput over each run's (``<reference>/<strategy>``, the paper's ratio)."""
    lost = time_lost(runs)
    if lost.empty:
        return lost
    rows = []
    for row in lost.to_dict(orient="records"):
        events = runs.events[runs.events["run"] == row["run"]] if not runs.events.empty else runs.events
        out = {"fault": fault_type(events)} | {
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
    # Paired within a fault type: a crash run's goodput is not a hang run's reference.
    ours = table[table["strategy"] == reference].drop_duplicates("fault").set_index("fault")["goodput"]
    table[f"{reference}_over_this"] = table["fault"].map(ours) / table["goodput"]
    return table


# summary.json's host object (oobleck.metrics.host), flattened into a table's columns.
HOST_COLUMNS = ("cpus", "load_start", "load_end", "training_processes", "overloaded", "oversubscribed")


def host_columns(run_dir: Path) -> dict[str, Any]:
    """The run's host record as ``HOST_COLUMNS`` (NaN where its summary.json has none)."""
    path = Path(run_dir) / "summary.json"
    host = (json.loads(path.read_text()).get("host") or {}) if path.is_file() else {}
    if not host:
        return {c: math.nan for c in HOST_COLUMNS}
    return {
        "cpus": host.get("usable_cpus", host.get("cpu_count")),
        "load_start": (host.get("load_avg_start") or [math.nan])[0],
        "load_end": (host.get("load_avg_end") or [math.nan])[0],
        "training_processes": host.get("training_processes", math.nan),
        "overloaded": bool(host.get("overloaded", False)),
        "oversubscribed": bool(host.get("oversubscribed", False)),
    }


def with_hosts(table: pd.DataFrame, runs: RunSet) -> pd.DataFrame:
    """``table`` (a ``run`` column) with each run's ``HOST_COLUMNS``."""
    hosts = pd.DataFrame(
        [{"run": run, **host_columns(Path(path))} for run, path in zip(runs.runs["run"], runs.runs["path"])]
    )
    return table.merge(hosts, on="run", how="left") if not table.empty else table


def host_warnings(table: pd.DataFrame) -> list[str]:
    """What a reader must know about the host before reading the ratios of ``table`` (rows with
    ``HOST_COLUMNS``): runs whose 1-minute load exceeded the cores, and runs with more training
    processes than cores (their times are the scheduler's as much as the strategies')."""
    if table.empty or "overloaded" not in table:
        return []
    warnings = []
    loaded = table[table["overloaded"].fillna(False).astype(bool)]
    if not loaded.empty:
        peak = float(loaded[["load_start", "load_end"]].max().max())
        warnings.append(
            f"WARNING: {len(loaded)} of {len(table)} runs ran with a load average above the cores "
            f"(peak {peak:.1f} on {int(loaded['cpus'].max())} cores): other processes shared the CPUs; "
            "their times, and the ratios built on them, are partly the scheduler's"
        )
    crowded = table[table["oversubscribed"].fillna(False).astype(bool)]
    if not crowded.empty:
        warnings.append(
            f"WARNING: {len(crowded)} of {len(table)} runs had more training processes than cores "
            f"(up to {int(crowded['training_processes'].max())} on {int(crowded['cpus'].max())}): "
            "ratios marked '*' were measured so"
        )
    return warnings


# A failure's recovery: the kinds above, and torchft's "continue" (the survivors go on without it).
FAILURE_RECOVERY_KINDS = (*RECOVERY_KINDS, "continue")


def _recovery_s(events: pd.DataFrame) -> float:
    """The median total of a run's failure recoveries (``FAILURE_RECOVERY_KINDS``, a notice's
    included, a join's not)."""
    if events.empty or "kind" not in events or "total_s" not in events:
        return math.nan
    chosen = events[events["kind"].isin(FAILURE_RECOVERY_KINDS)]
    if "removed" in chosen and "joined" in chosen:
        # A join's recovery is no failure's; a restart on a preemption notice (nodes still alive,
        # so none removed yet) is.
        join_only = chosen["removed"].astype(str).eq("[]") & chosen["joined"].astype(str).ne("[]")
        chosen = chosen[~join_only]
    totals = pd.to_numeric(chosen["total_s"], errors="coerce").dropna()
    return float(totals.median()) if not totals.empty else math.nan


def protocol_table(out: str | Path) -> pd.DataFrame:
    """One row per finished run of a protocol (``protocol.json`` under ``out``): variant, strategy,
    switch, fault, notice_s, repeat, goodput, recovery_s (median of its failure recoveries),
    redone_steps, ``HOST_COLUMNS``, and paired with the reference run of the same repeat, fault and
    notice (the reference's run without notice where none had one): ``goodput_ratio`` (reference
    goodput / this) and ``recovery_ratio`` (this recovery / the reference's: above 1 the reference
    recovers faster)."""
    from analysis.load import load_run_set

    out = Path(out)
    manifest = json.loads((out / "protocol.json").read_text())
    rows = []
    for entry in manifest["runs"]:
        run_dir = out / entry["path"]
        if entry.get("error") or not (run_dir / "metrics.csv").is_file():
            continue
        runs = load_run_set([run_dir])
        lost = time_lost(runs)
        if lost.empty:
            continue
        rows.append(
            {
                **{k: entry[k] for k in ("variant", "strategy", "switch", "fault", "notice_s", "repeat", "position")},
                "failure_steps": " ".join(str(s) for s in entry["failure_steps"]),
                "goodput": float(lost["goodput"].iloc[0]),
                "recovery_s": _recovery_s(runs.events),
                "redone_steps": int(lost["redone_steps"].iloc[0]),
                **host_columns(run_dir),
            }
        )
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    reference = manifest["reference"]
    ours = table[table["strategy"] == reference].set_index(["repeat", "fault", "notice_s"])
    goodput_ratio, recovery_ratio = [], []
    for row in table.to_dict(orient="records"):
        key = (row["repeat"], row["fault"], row["notice_s"])
        if key not in ours.index:
            key = (row["repeat"], row["fault"], 0.0)
        if key not in ours.index:
            goodput_ratio.append(math.nan)
            recovery_ratio.append(math.nan)
            continue
        theirs = ours.loc[[key]].iloc[0]
        goodput_ratio.append(float(theirs["goodput"]) / row["goodput"] if row["goodput"] > 0 else math.nan)
        recovery_ratio.append(row["recovery_s"] / float(theirs["recovery_s"]) if theirs["recovery_s"] > 0 else math.nan)
    return table.assign(goodput_ratio=goodput_ratio, recovery_ratio=recovery_ratio)


def _spread(values: pd.Series) -> str:
    """'median [min-max]' over the repeats."""
    values = pd.to_numeric(values, errors="coerce").dropna()
    if values.empty:
        return "-"
    return f"{values.median():.3g} [{values.min():.3g}-{values.max():.3g}]"


def protocol_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per fault type and variant (rows of ``protocol_table``): the repeats, goodput, recovery
    time and both ratios as 'median [min-max]' over the repeats, the 1-minute load's range and
    ``oversubscribed`` ('*' marks ratios measured with more training processes than cores)."""
    if table.empty:
        return table
    rows = []
    for (fault, variant), group in table.groupby(["fault", "variant"], sort=False):
        crowded = bool(group["oversubscribed"].fillna(False).astype(bool).any())
        mark = "*" if crowded else ""
        loads = pd.concat([group["load_start"], group["load_end"]]).dropna()
        rows.append(
            {
                "fault": fault,
                "variant": variant,
                "strategy": group["strategy"].iloc[0],
                "switch": group["switch"].iloc[0],
                "repeats": int(len(group)),
                "goodput": _spread(group["goodput"]),
                "recovery_s": _spread(group["recovery_s"]),
                "redone_steps": _spread(group["redone_steps"]),
                "goodput_ratio": _spread(group["goodput_ratio"]) + mark,
                "recovery_ratio": _spread(group["recovery_ratio"]) + mark,
                "load_1min": f"{loads.min():.1f}-{loads.max():.1f}" if not loads.empty else "-",
                "cpus": group["cpus"].max(),
                "oversubscribed": crowded,
            }
        )
    return pd.DataFrame(rows)


def print_protocol(out: str | Path, reference: str = "oobleck") -> pd.DataFrame:
    """Print a protocol's summary (``protocol_summary``) and its host warnings; returns the summary."""
    table = protocol_table(out)
    summary = protocol_summary(table)
    if summary.empty:
        print(f"{out}: no finished runs in protocol.json")
        return summary
    print(
        f"\n== per fault type: median [min-max] over the repeats; goodput_ratio = {reference} goodput / "
        f"this; recovery_ratio = this recovery / {reference}'s (both paired round by round)"
    )
    print(summary.to_string(index=False))
    for warning in host_warnings(table):
        print(warning)
    return summary


def main(argv: list[str] | None = None) -> int:
    """``python -m analysis.comparison DIR...``: the strategy table of run dirs or Hydra sweeps, or
    the repeat summary of a protocol's dir (one holding protocol.json)."""
    import argparse

    from analysis.load import load_run_set
    from oobleck.errors import report_errors

    parser = argparse.ArgumentParser(
        prog="python -m analysis.comparison", description=(strategy_table.__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("dirs", nargs="+", help="run dirs of python -m oobleck.run, or multirun/<date> sweep dirs")
    parser.add_argument("--csv", default=None, help="also write the table here")
    args = parser.parse_args(argv)
    from pathlib import Path

    with report_errors("analysis.comparison"):
        paths = [Path(d) for d in args.dirs]
        protocols = [p for p in paths if (p / "protocol.json").is_file()]
        for path in protocols:
            summary = print_protocol(path)
            if args.csv:
                summary.to_csv(args.csv, index=False)
        paths = [p for p in paths if p not in protocols]
        if not paths:
            return 0
        sweeps = [p for p in paths if (p / "multirun.yaml").is_file() or not (p / "metrics.csv").is_file()]
        runs = load_run_set([p for p in paths if p not in sweeps], sweeps)
        table = strategy_table(runs)
        table = with_hosts(table, runs)
        print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        for warning in host_warnings(table):
            print(warning)
        if args.csv:
            table.to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

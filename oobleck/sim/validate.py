"""Validate the simulator against a real run: simulate the run's own schedule and compare.

Input: a run dir of ``python -m oobleck.run`` with any strategy (``.hydra/config.yaml``,
``plan.json``, ``metrics.csv``, ``events.csv``, ``summary.json``; the profile is ``profile.json``
there if present, else ``get_profile`` of the run's config, i.e. the same cached measured profile
the run planned with).

The run's membership changes (``failure``/``join`` rows of events.csv, at their times) become a
trace that starts at the first completed step with the plan's nodes; the run's own strategy (its
``strategy`` config, with the run's checkpoint interval and write mode, on the run's cluster and
job) replays it over the same window, already running when it opens. Compared (``compare``
returns one row per metric, with the target and whether it is met):

- ``steady_iteration_s``: median step time of the first generation vs the plan's predicted time;
- ``later_iteration_s``: the same after the (last) recovery, vs the new layout's time;
- ``throughput``: samples/s over the window, measured vs simulated (target: within 15%);
- ``recovery_s``, ``failover_s``, ``reroute_s``, ``restart_s``: median time of the run's
  reconfigurations, failovers (Bamboo), re-routes (ReCycle) and restarts (Varuna, Bamboo, ReCycle's
  and Oobleck's fall-back) from the failure to the first step done (events' ``total_s``) vs the
  simulated downtime plus the redone step (50%);
- ``checkpoint_snapshot_s``, ``checkpoint_write_s``: median per checkpoint (50%);
- ``redundant_share``: the redundant forward's share of the workers' 1F1B time (Bamboo in its
  eager and inline modes; lazy runs none in steady state; the workers' ``phase_seconds`` in
  summary.json) vs the cost model's (50%).
Each for the planner's cost model as is, for a ``calibrated`` one (one per-microbatch overhead
fitted on the run's own first generation: in-sample for that generation) and, given a
``RuntimeOverhead`` measured on *different* calibration runs (``calibrate``), for a ``predicted``
one: the out-of-sample validation, the one a simulated figure can lean on. ``RuntimeOverhead``
(oobleck/sim/runtime_model.py) states the model; ``oobleck.sim.calibration`` measures its terms.

CLI: ``python -m oobleck.sim.validate RUN_DIR [--calibration CAL_RUN_DIR ...]`` prints the table and
writes ``validation.csv`` (and, with a calibration run, ``runtime_overhead.json``). The protocol over
many runs (``benchmarks/bench_validation.py``) scores the development set and the pre-registered
held-out set apart (``oobleck.sim.holdout``).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd

from oobleck.errors import RunError, report_errors
from oobleck.faults.trace import parse_trace
from oobleck.metrics.run_files import read_run_files
from oobleck.planning.inputs import ModelProfile
from oobleck.planning.outputs import ExecutionPlan
from oobleck.recovery_costs import checkpoint_cost
from oobleck.sim.calibration import (
    calibrate,
    event_rows,
    node_ids,
    redundant_seconds,
    step_shape,
    with_exposure,
    worker_count,
)
from oobleck.sim.engine import simulate
from oobleck.sim.results import SimResult
from oobleck.sim.runtime_model import RuntimeOverhead
from oobleck.strategy import Decision, Strategy

# The targets the simulator is held to (a figure built on it says how far it is from real runs).
THROUGHPUT_TOLERANCE = 0.15  # simulated throughput within 15% of the measured one
RECOVERY_TOLERANCE = 0.5  # recovery time within 50%


@dataclass
class Validation:
    table: pd.DataFrame
    sim: SimResult  # the planner-model simulation
    overhead_s: float = 0.0  # the calibrated model's seconds per microbatch (fitted on generation 0)
    runtime: RuntimeOverhead | None = None  # the predicted model's terms (from a calibration run)


def _plan(data: dict[str, Any], path: Path) -> ExecutionPlan:
    """plan.json holds an ExecutionPlan dict, or one under a ``plan`` (or ``initial_plan``) key."""
    for candidate in (data, data.get("plan"), data.get("initial_plan"), data.get("execution_plan")):
        if isinstance(candidate, dict) and "pipelines" in candidate:
            try:
                return ExecutionPlan.from_dict(candidate)
            except (KeyError, TypeError) as error:
                raise RunError(f"{path}: malformed execution plan ({error!r})") from None
    raise RunError(f"{path}: no execution plan (an object with 'pipelines') found")


def membership_trace_text(plan: ExecutionPlan, events: pd.DataFrame, t0: float, t1: float) -> str:
    """The run's membership changes as trace lines (ms from ``t0``; changes after ``t1`` dropped)."""
    lines = [f"0,add,node{n}" for n in plan.nodes]
    if events.empty or "kind" not in events:
        return "\n".join(lines) + "\n"
    changes = events[events["kind"].isin(["failure", "join"])].sort_values("time_s", kind="stable")
    for _, row in changes.iterrows():
        t = float(row["time_s"])
        if t > t1:
            continue
        ids = node_ids(row.get("nodes")) or node_ids(row.get("node"))
        action = "remove" if row["kind"] == "failure" else "add"
        for node in ids:
            lines.append(f"{max(0, round((t - t0) * 1000))},{action},node{node}")
    return "\n".join(lines) + "\n"


def _ratio(simulated: float, measured: float) -> float:
    return simulated / measured if measured else math.nan


def _busiest_microbatches(plan: ExecutionPlan | None) -> int:
    return max(p.microbatches for p in plan.pipelines) if plan is not None else 1


class _WithOverhead(Strategy):
    """A strategy whose layouts take ``overhead_s`` more per microbatch of their busiest pipeline,
    or (given ``runtime``) the measured runtime's step, with its restarts' fixed part dilated by
    the workers that restart.

    Per microbatch, because what a tiny model's step spends outside Eq. 1-4 (Python per op,
    point-to-point and launch latency) recurs with every microbatch a pipeline runs.
    """

    def __init__(self, inner: Strategy, overhead_s: float, runtime: RuntimeOverhead | None = None) -> None:
        super().__init__(inner.config, inner.context)
        self.inner, self.overhead_s, self.runtime = inner, overhead_s, runtime
        self.base_costs = inner.config.costs

    def _adjust(self, decision: Decision) -> Decision:
        if decision.layout is None:
            return decision
        layout = decision.layout
        if self.runtime is not None:
            # The engine charges the decision right after it is taken, with these costs.
            costs = self.runtime.costs(self.base_costs, worker_count(layout))
            self.config = replace(self.inner.config, costs=costs)
            step_s = self.runtime.step_s(step_shape(layout, self.inner.context.profile))
            return replace(decision, layout=replace(layout, iteration_s=step_s))
        extra = self.overhead_s * _busiest_microbatches(layout.plan)
        return replace(decision, layout=replace(layout, iteration_s=layout.iteration_s + extra))

    def start(self, nodes):  # type: ignore[no-untyped-def]
        return self._adjust(self.inner.start(nodes))

    def on_change(self, state):  # type: ignore[no-untyped-def]
        return self._adjust(self.inner.on_change(state))


def _with_measured(strategy: Strategy, runtime: RuntimeOverhead) -> Strategy:
    """The same strategy with what the calibration measured in its settings (Bamboo's exposure)."""
    config = strategy.config
    if runtime.redundant_exposed is not None and hasattr(config, "redundant_forward_exposed"):
        config = with_exposure(config, runtime.redundant_exposed)
    return type(strategy)(config, strategy.context) if config is not strategy.config else strategy


def _median_step_s(metrics: pd.DataFrame) -> float:
    times = metrics["time_s"].diff().dropna()
    return float(times.median()) if not times.empty else math.nan


def _median(frame: pd.DataFrame, column: str) -> float:
    return float(frame[column].median()) if not frame.empty and column in frame else math.nan


def redundant_share(plan: ExecutionPlan, profile: ModelProfile, step_s: float, dilation: float) -> float:
    """Simulated share of the workers' 1F1B time spent on the redundant forward (Bamboo)."""
    seconds = redundant_seconds(plan, profile)
    if not seconds or step_s <= 0:
        return math.nan
    return sum(seconds.values()) * dilation / (len(seconds) * step_s)


def measured_redundant_share(phase_seconds: Mapping[str, Mapping[str, float]] | None) -> float:
    """The workers' redundant forward seconds over their 1F1B seconds (summary.json's phase_seconds)."""
    if not phase_seconds:
        return math.nan
    redundant = sum(float(p.get("redundant_forward", 0.0)) for p in phase_seconds.values())
    pipeline = sum(float(p.get("pipeline_1f1b", 0.0)) for p in phase_seconds.values())
    return redundant / pipeline if pipeline > 0 and redundant > 0 else math.nan


def compare(
    plan: ExecutionPlan,
    metrics: pd.DataFrame,
    events: pd.DataFrame,
    strategy: Strategy,
    *,
    origin: str = "run",
    runtime: RuntimeOverhead | None = None,
    phase_seconds: Mapping[str, Mapping[str, float]] | None = None,
) -> Validation:
    """Simulate the run's schedule with ``strategy`` (the run's own) and compare with its measurements.

    Two models are compared (column ``model``): ``planner``, the cost model as is, and
    ``calibrated``, which adds an overhead per microbatch of the busiest pipeline (what Eq. 1-4
    does not model: Python per op, point-to-point and launch latency, the optimizer and commit
    barrier folded in) fitted on the first generation's median step only; its rows for later
    generations and for the whole window are therefore out-of-sample checks. With ``runtime``
    (measured on other runs) a third, ``predicted``. Recovery metrics are per kind (``recovery_s``
    for reconfigurations, ``failover_s``, ``restart_s``: detection to the first step done),
    checkpoint metrics per checkpoint (``checkpoint_snapshot_s``, ``checkpoint_write_s``), and
    ``redundant_share`` is the redundant forward's share of the workers' 1F1B time (Bamboo).
    """
    if metrics.empty or len(metrics) < 2:
        raise RunError(f"{origin}: metrics.csv needs at least two steps to measure throughput")
    metrics = metrics.sort_values("time_s", kind="stable")
    t0, t1 = float(metrics["time_s"].iloc[0]), float(metrics["time_s"].iloc[-1])
    if t1 <= t0:
        raise RunError(f"{origin}: metrics.csv step times do not advance")
    measured_throughput = float(metrics["samples"].iloc[1:].sum()) / (t1 - t0)
    trace = parse_trace(membership_trace_text(plan, events, t0, t1), origin=f"{origin} (events.csv)")
    generations = (
        metrics["generation"] if "generation" in metrics else pd.Series([0] * len(metrics), index=metrics.index)
    )
    first = generations.iloc[0]
    measured_first = _median_step_s(metrics[generations == first])
    later = metrics[generations != first]
    # Steps of later generations, without the first one after each change (it includes recovery).
    later_steady = later[later["generation"].duplicated()] if not later.empty else later
    measured_later = _median_step_s(later_steady) if len(later_steady) >= 2 else math.nan
    checkpoints = event_rows(events, "checkpoint")
    measured = {
        "recovery_s": _median(event_rows(events, "reconfiguration"), "total_s"),
        "failover_s": _median(event_rows(events, "failover"), "total_s"),
        "reroute_s": _median(event_rows(events, "reroute"), "total_s"),
        "restart_s": _median(event_rows(events, "restart"), "total_s"),
        "checkpoint_snapshot_s": _median(checkpoints, "snapshot_s"),
        "checkpoint_write_s": _median(checkpoints, "write_s"),
        "redundant_share": measured_redundant_share(phase_seconds),
    }

    gap = max(0.0, measured_first - plan.predicted_iteration_s) if math.isfinite(measured_first) else 0.0
    overhead = gap / _busiest_microbatches(plan)  # seconds per microbatch of the busiest pipeline
    rows: list[dict[str, Any]] = []
    result = None
    models: list[tuple[str, float, RuntimeOverhead | None]] = [("planner", 0.0, None), ("calibrated", overhead, None)]
    if runtime is not None:
        models.append(("predicted", 0.0, runtime))
    profile = strategy.context.profile
    for model, extra, terms in models:
        base = _with_measured(strategy, terms) if terms is not None else strategy
        adjusted = _WithOverhead(base, extra, terms)
        first_layout = adjusted.start(list(plan.nodes)).layout
        sim = simulate(
            adjusted, trace, duration_s=t1 - t0, labels={"strategy": strategy.name, "trace": origin}, charge_start=False
        )
        result = result or sim
        later_layouts = [r for r in sim.segments if r["phase"] == "running" and r["t_start_s"] > 0]
        simulated_later = float(later_layouts[-1]["iteration_s"]) if later_layouts else math.nan

        def recovery(kind: str) -> float:
            times = [e["downtime_s"] + _iteration_after(sim, e["time_s"]) for e in sim.events if e["kind"] == kind]  # noqa: B023
            return float(pd.Series(times).median()) if times else math.nan

        simulated_first = first_layout.iteration_s if first_layout is not None else math.nan
        ck = None
        if first_layout is not None:
            ck = checkpoint_cost(
                first_layout.plan, profile, adjusted.config.costs, adjusted.context.cluster.inter_node_bandwidth
            )
        dilation = terms.dilation(worker_count(first_layout)) if terms is not None and first_layout is not None else 1.0
        simulated = {
            "recovery_s": recovery("reconfiguration"),
            "failover_s": recovery("failover"),
            "reroute_s": recovery("reroute"),
            "restart_s": recovery("restart"),
            "checkpoint_snapshot_s": ck.snapshot_s if ck is not None else math.nan,
            "checkpoint_write_s": ck.write_s if ck is not None else math.nan,
            "redundant_share": redundant_share(first_layout.plan, profile, simulated_first, dilation)
            if first_layout is not None
            else math.nan,
        }
        candidates = [
            ("steady_iteration_s", measured_first, simulated_first, THROUGHPUT_TOLERANCE, model == "calibrated"),
            ("later_iteration_s", measured_later, simulated_later, THROUGHPUT_TOLERANCE, False),
            # Without a later generation the calibrated throughput is in-sample too.
            (
                "throughput",
                measured_throughput,
                _throughput_with_inflight(sim, t1 - t0),
                THROUGHPUT_TOLERANCE,
                model == "calibrated" and later.empty,
            ),
        ]
        candidates += [(metric, measured[metric], simulated[metric], RECOVERY_TOLERANCE, False) for metric in measured]
        for metric, value, predicted, target, fitted in candidates:
            if math.isfinite(value) and math.isfinite(predicted):
                rows.append(
                    {
                        "model": model,
                        "metric": metric,
                        "measured": value,
                        "simulated": predicted,
                        "target": target,
                        "fitted": fitted,
                    }
                )
    table = pd.DataFrame(rows, columns=["model", "metric", "measured", "simulated", "target", "fitted"])
    table["ratio"] = [_ratio(s, m) for s, m in zip(table["simulated"], table["measured"])]
    table["within_target"] = (table["ratio"] - 1.0).abs() <= table["target"]
    table.attrs["overhead_s"] = overhead
    assert result is not None
    return Validation(table=table, sim=result, overhead_s=overhead, runtime=runtime)


def _throughput_with_inflight(result: SimResult, duration_s: float) -> float:
    """Simulated samples/s over the window, counting the iteration in flight at its end pro rata.

    The engine counts completed iterations only; over a window of ~15 steps that quantizes the
    throughput by up to one step (~7%), as much as half the tolerance. The measured window ends
    exactly at a completed step, so the fraction of the one in flight is the fair comparison.
    """
    committed = float(result.summary["samples"])
    running = [r for r in result.segments if r["phase"] == "running"]
    if running and abs(running[-1]["t_end_s"] - duration_s) < 1e-9 and running[-1]["iteration_s"] > 0:
        last = running[-1]
        iterations = (last["t_end_s"] - last["t_start_s"]) / last["iteration_s"]
        committed += (iterations - math.floor(iterations)) * last["samples_per_s"] * last["iteration_s"]
    return committed / duration_s if duration_s > 0 else math.nan


def _iteration_after(result: SimResult, time_s: float) -> float:
    """The iteration time of the layout a recovery at ``time_s`` switched to (the redone step)."""
    for row in result.segments:
        if row["t_start_s"] >= time_s and row["phase"] == "running":
            return float(row["iteration_s"])
    return 0.0


def _load(run_dir: str | Path, profile_path: str | Path | None) -> tuple[ExecutionPlan, Any, Strategy, str]:
    """A run dir's plan, its data (metrics, events, summary) and its strategy as the run had it:
    its config on its cluster, with the run's checkpoint interval and write mode."""
    from oobleck.schema import from_container
    from oobleck.sim.experiment import build_context, simulated_strategy
    from oobleck.strategy import checkpoint_every_steps

    data = read_run_files(run_dir)
    if not data.config:
        raise RunError(f"{data.path}/.hydra/config.yaml is missing: cannot rebuild the run's cluster and job")
    if not data.plan:
        raise RunError(f"{data.path}/plan.json is missing or empty")
    cfg = from_container(data.config)
    plan = _plan(data.plan, data.path / "plan.json")
    candidates = [Path(profile_path)] if profile_path else [data.path / "profile.json"]
    existing = [p for p in candidates if p.is_file()]
    if existing:
        profile = ModelProfile.load(existing[0])
    elif profile_path:
        raise RunError(f"profile {profile_path} does not exist")
    else:
        from oobleck.profiling import get_profile

        profile = get_profile(cfg)
    nodes = max(len(plan.nodes), int(cfg.cluster.nodes))
    context = build_context(cfg, profile, nodes, named_gpu=False)
    async_write = bool(cfg.checkpoint.async_write) if "checkpoint" in cfg else True
    extra = {"checkpoint_every_steps": checkpoint_every_steps(cfg), "costs": {"checkpoint_async": async_write}}
    return plan, data, simulated_strategy(cfg, str(cfg.strategy.name), context, extra), str(data.path)


def _phase_seconds(data: Any) -> Mapping[str, Mapping[str, float]] | None:
    summary = getattr(data, "summary", None) or {}
    return summary.get("phase_seconds")


def calibrate_runs(run_dirs: list[str | Path]) -> RuntimeOverhead:
    """``calibrate`` on real run dirs (each with its own profile, as ``validate_run`` loads it)."""
    runs = []
    for run_dir in run_dirs:
        plan, data, strategy, origin = _load(run_dir, None)
        runs.append((plan, data.metrics, data.events, strategy, origin))
    return calibrate(runs)


def validate_run(
    run_dir: str | Path, profile_path: str | Path | None = None, *, runtime: RuntimeOverhead | None = None
) -> Validation:
    """Load a real run dir, rebuild its context (config, profile, strategy) and ``compare``."""
    plan, data, strategy, origin = _load(run_dir, profile_path)
    return compare(
        plan, data.metrics, data.events, strategy, origin=origin, runtime=runtime, phase_seconds=_phase_seconds(data)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oobleck.sim.validate", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="run dir of python -m oobleck.run")
    parser.add_argument(
        "--profile", default=None, help="profile JSON (default: RUN_DIR/profile.json, else the run's cached profile)"
    )
    parser.add_argument(
        "--calibration",
        action="append",
        default=None,
        help="run dir of a different run to measure the runtime overhead on (repeatable; one needs a failure): adds the 'predicted' model",
    )
    args = parser.parse_args(argv)
    with report_errors("oobleck.sim.validate"):
        calibration = args.calibration or []
        if any(Path(c).resolve() == Path(args.run_dir).resolve() for c in calibration):
            raise RunError(
                f"--calibration {args.run_dir} is RUN_DIR itself: calibrate on different runs, or the prediction is a fit"
            )
        runtime = calibrate_runs(calibration) if calibration else None
        validation = validate_run(args.run_dir, args.profile, runtime=runtime)
        print(validation.table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        print(
            f"calibrated overhead per microbatch of the busiest pipeline (fitted on generation 0): {validation.overhead_s:.4g} s"
        )
        out = Path(args.run_dir) / "validation.csv"
        validation.table.to_csv(out, index=False)
        print(f"written {out}")
        if runtime is not None:
            print(f"runtime overhead from {runtime.source}: {runtime}")
            runtime.save(Path(args.run_dir) / "runtime_overhead.json")
            judged = validation.table[validation.table["model"] == "predicted"]
        else:
            judged = validation.table[validation.table["model"] == "planner"]
        return 0 if bool(judged["within_target"].all()) else 1
    return 2  # unreachable: report_errors exits


if __name__ == "__main__":
    sys.exit(main())

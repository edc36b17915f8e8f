"""Validate the simulator against a real run: simulate the run's own schedule and compare.

Input: a run dir of ``python -m oobleck.run`` (``.hydra/config.yaml``, ``plan.json``,
``metrics.csv``, ``events.csv``; the profile is ``profile.json`` there if present, else
``get_profile`` of the run's config, i.e. the same cached measured profile the run planned with).

The run's membership changes (``failure``/``join`` rows of events.csv, at their times) become a
trace that starts at the first completed step with the plan's nodes; the Oobleck strategy (real
planner, the run's cluster, job and conf/strategy/oobleck.yaml constants) replays it over the same
window. Compared (``compare`` returns one row per metric, with the target and whether it is met):

- ``steady_iteration_s``: median step time of the first generation vs the plan's predicted time;
- ``later_iteration_s``: the same after the (last) reconfiguration, vs the new plan's time;
- ``throughput``: samples/s over the window, measured vs simulated (target: within 15%);
- ``recovery_s``: median reconfiguration time (events' ``total_s``: detect to first step done) vs
  the simulated downtime plus the redone step (target: within 50%).
Each for the planner's cost model as is, for a ``calibrated`` one (one per-microbatch overhead
fitted on the run's own first generation: in-sample for that generation) and, given a
``RuntimeOverhead`` measured on *different* calibration runs (``calibrate``), for a ``predicted``
one: the out-of-sample validation (issue 6). ``RuntimeOverhead`` (oobleck/sim/costs.py) states
the model; ``calibrate`` measures each of its terms on the calibration runs (pooled):

- per-microbatch and per-step overhead: fitted (``fit_step_overhead``) on each generation's
  median steady step (``step_time_s`` without a generation's first step), undilated by the
  worker/core ratio, minus the planner's predicted iteration of that generation's layout;
- ``reconfigure_fixed_s``: median ``detect_s + plan_s + groups_s`` of its reconfigurations;
- ``warmup_s``: median excess of the step redone after a reconfiguration (its ``first_step_s``)
  over the new generation's steady step;
- ``cores``: ``os.cpu_count()`` where the calibration runs (the runs are local).

CLI: ``python -m oobleck.sim.validate RUN_DIR [--calibration CAL_RUN_DIR ...]`` prints the table and
writes ``validation.csv`` (and, with a calibration run, ``runtime_overhead.json``).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd

from oobleck.errors import RunError, report_errors
from oobleck.faults.trace import parse_trace
from oobleck.planning.plan import ExecutionPlan
from oobleck.planning.profile import ModelProfile
from oobleck.sim.costs import RuntimeOverhead, fit_step_overhead
from oobleck.sim.engine import SimResult, simulate
from oobleck.strategy import Decision, Layout, RunState, Strategy

THROUGHPUT_TOLERANCE = 0.15  # issue 6: simulated throughput within 15% of the measured one
RECOVERY_TOLERANCE = 0.5  # issue 6: recovery time within 50%


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


def _nodes(value: Any) -> list[int]:
    """Node ids from an events.csv cell: a number (``node``) or a list written as text (``nodes``)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return []
    if isinstance(value, (int, float)):
        return [int(value)]  # pandas reads an integer column with gaps as floats (0.0)
    return [int(x) for x in re.findall(r"-?\d+", str(value))]


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
        ids = _nodes(row.get("nodes")) or _nodes(row.get("node"))
        action = "remove" if row["kind"] == "failure" else "add"
        for node in ids:
            lines.append(f"{max(0, round((t - t0) * 1000))},{action},node{node}")
    return "\n".join(lines) + "\n"


def _ratio(simulated: float, measured: float) -> float:
    return simulated / measured if measured else math.nan


def _busiest_microbatches(plan: ExecutionPlan | None) -> int:
    return max(p.microbatches for p in plan.pipelines) if plan is not None else 1


class _WithOverhead(Strategy):
    """A strategy whose layouts take ``overhead_s`` more per microbatch of their busiest pipeline.

    Per microbatch, because what a tiny model's step spends outside Eq. 1-4 (Python per op,
    point-to-point and launch latency) recurs with every microbatch a pipeline runs.
    """

    def __init__(self, inner: Strategy, overhead_s: float, runtime: RuntimeOverhead | None = None) -> None:
        super().__init__(inner.config, inner.context)
        self.inner, self.overhead_s, self.runtime = inner, overhead_s, runtime

    def _adjust(self, decision: Decision) -> Decision:
        if decision.layout is None:
            return decision
        layout = decision.layout
        if self.runtime is not None:
            return replace(decision, layout=replace(layout, iteration_s=_runtime_step_s(self.runtime, layout)))
        extra = self.overhead_s * _busiest_microbatches(layout.plan)
        return replace(decision, layout=replace(layout, iteration_s=layout.iteration_s + extra))

    def start(self, nodes):  # type: ignore[no-untyped-def]
        return self._adjust(self.inner.start(nodes))

    def on_change(self, state):  # type: ignore[no-untyped-def]
        return self._adjust(self.inner.on_change(state))


def _with_fixed_reconfiguration(strategy: Strategy, fixed_s: float) -> Strategy:
    """The same strategy with the simulator charging ``fixed_s`` for a reconfiguration's fixed part."""
    costs = replace(strategy.config.costs, reconfigure_fixed_s=fixed_s)
    return type(strategy)(replace(strategy.config, costs=costs), strategy.context)


def _workers(layout: Layout) -> int:
    return len(layout.plan.assignments()) if layout.plan is not None else len(layout.nodes)


def _runtime_step_s(runtime: RuntimeOverhead, layout: Layout) -> float:
    """The layout's step on the real runtime: the planner's iteration plus the measured overhead."""
    return runtime.step_s(layout.iteration_s, _busiest_microbatches(layout.plan), _workers(layout))


def _median_step_s(metrics: pd.DataFrame) -> float:
    times = metrics["time_s"].diff().dropna()
    return float(times.median()) if not times.empty else math.nan


def compare(
    plan: ExecutionPlan,
    metrics: pd.DataFrame,
    events: pd.DataFrame,
    strategy: Strategy,
    *,
    origin: str = "run",
    runtime: RuntimeOverhead | None = None,
) -> Validation:
    """Simulate the run's schedule with ``strategy`` (the run's own) and compare with its measurements.

    Two models are compared (column ``model``): ``planner``, the cost model as is, and
    ``calibrated``, which adds an overhead per microbatch of the busiest pipeline (what Eq. 1-4
    does not model: Python per op, point-to-point and launch latency, the optimizer and commit
    barrier folded in) fitted on the first generation's median step only; its rows for later
    generations and for the whole window are therefore out-of-sample checks.
    """
    if metrics.empty or len(metrics) < 2:
        raise RunError(f"{origin}: metrics.csv needs at least two steps to measure throughput")
    metrics = metrics.sort_values("time_s", kind="stable")
    t0, t1 = float(metrics["time_s"].iloc[0]), float(metrics["time_s"].iloc[-1])
    if t1 <= t0:
        raise RunError(f"{origin}: metrics.csv step times do not advance")
    measured_throughput = float(metrics["samples"].iloc[1:].sum()) / (t1 - t0)
    trace = parse_trace(membership_trace_text(plan, events, t0, t1), origin=f"{origin} (events.csv)")
    generations = metrics["generation"] if "generation" in metrics else pd.Series([0] * len(metrics), index=metrics.index)
    first = generations.iloc[0]
    measured_first = _median_step_s(metrics[generations == first])
    later = metrics[generations != first]
    # Steps of later generations, without the first one after each change (it includes recovery).
    later_steady = later[later["generation"].duplicated()] if not later.empty else later
    measured_later = _median_step_s(later_steady) if len(later_steady) >= 2 else math.nan
    recoveries = events[events["kind"] == "reconfiguration"] if not events.empty and "kind" in events else pd.DataFrame()
    measured_recovery = float(recoveries["total_s"].median()) if not recoveries.empty and "total_s" in recoveries else math.nan

    gap = max(0.0, measured_first - plan.predicted_iteration_s) if math.isfinite(measured_first) else 0.0
    overhead = gap / _busiest_microbatches(plan)  # seconds per microbatch of the busiest pipeline
    rows: list[dict[str, Any]] = []
    result = None
    models: list[tuple[str, float, RuntimeOverhead | None]] = [("planner", 0.0, None), ("calibrated", overhead, None)]
    if runtime is not None:
        models.append(("predicted", 0.0, runtime))
    for model, extra, terms in models:
        base = strategy
        if terms is not None:
            # The reconfiguration's fixed part and the new generation's warm-up, as measured.
            base = _with_fixed_reconfiguration(strategy, terms.reconfigure_fixed_s + terms.warmup_s)
        adjusted = _WithOverhead(base, extra, terms)
        sim = simulate(adjusted, trace, duration_s=t1 - t0, labels={"strategy": strategy.name, "trace": origin})
        result = result or sim
        later_layouts = [r for r in sim.segments if r["phase"] == "running" and r["t_start_s"] > 0]
        simulated_later = float(later_layouts[-1]["iteration_s"]) if later_layouts else math.nan
        recoveries_sim = [e["downtime_s"] + _iteration_after(sim, e["time_s"]) for e in sim.events if e["kind"] == "reconfiguration"]
        first_layout = adjusted.start(list(plan.nodes)).layout
        simulated_first = first_layout.iteration_s if first_layout is not None else math.nan
        candidates = [
            ("steady_iteration_s", measured_first, simulated_first, THROUGHPUT_TOLERANCE, model == "calibrated"),
            ("later_iteration_s", measured_later, simulated_later, THROUGHPUT_TOLERANCE, False),
            # Without a later generation the calibrated throughput is in-sample too.
            ("throughput", measured_throughput, _throughput_with_inflight(sim, t1 - t0), THROUGHPUT_TOLERANCE, model == "calibrated" and later.empty),
            ("recovery_s", measured_recovery, float(pd.Series(recoveries_sim).median()) if recoveries_sim else math.nan, RECOVERY_TOLERANCE, False),
        ]
        for metric, measured, simulated, target, fitted in candidates:
            if math.isfinite(measured) and math.isfinite(simulated):
                rows.append(
                    {"model": model, "metric": metric, "measured": measured, "simulated": simulated, "target": target, "fitted": fitted}
                )
    table = pd.DataFrame(rows)
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
    """The iteration time of the layout a reconfiguration at ``time_s`` switched to (the redone step)."""
    for row in result.segments:
        if row["t_start_s"] >= time_s and row["phase"] == "running":
            return float(row["iteration_s"])
    return 0.0


def _changes(events: pd.DataFrame) -> list[tuple[list[int], list[int]]]:
    """The run's membership changes in order, as ``(removed, joined)`` node ids."""
    if events.empty or "kind" not in events:
        return []
    rows = events[events["kind"].isin(["failure", "join"])].sort_values("time_s", kind="stable")
    changes = []
    for _, row in rows.iterrows():
        ids = _nodes(row.get("nodes")) or _nodes(row.get("node"))
        changes.append((ids, []) if row["kind"] == "failure" else ([], ids))
    return changes


@dataclass
class _Calibration:
    """What one calibration run measured (pooled over runs by ``calibrate``)."""

    samples: list[tuple[float, int, float]]  # (planner s, busiest microbatches, undilated steady step s)
    fixed: list[float]  # detect + plan + groups of each reconfiguration
    # The step redone after a reconfiguration beyond the new generation's steady step (not a run's
    # step 0: that one also pays the run's own start, lazy allocation, and is slower still).
    warmups: list[float]


def _measure(plan: ExecutionPlan, metrics: pd.DataFrame, events: pd.DataFrame, strategy: Strategy, origin: str, cores: int) -> _Calibration:
    if "step_time_s" not in metrics or "generation" not in metrics:
        raise RunError(f"{origin}: metrics.csv needs step_time_s and generation columns to calibrate on")
    layout = strategy.start(list(plan.nodes)).layout
    if layout is None:
        raise RunError(f"{origin}: the planner finds no layout for the run's nodes {list(plan.nodes)}")
    layouts = [layout]
    alive = set(plan.nodes)
    for removed, joined in _changes(events):
        alive = (alive - set(removed)) | set(joined)
        state = RunState(layouts[-1], tuple(sorted(alive)), tuple(removed), tuple(joined), step=1)
        decision = strategy.on_change(state)
        if decision.layout is None:
            raise RunError(f"{origin}: the planner finds no layout after the change (-{removed}, +{joined})")
        layouts.append(decision.layout)
    generations = sorted(metrics["generation"].unique())
    if len(generations) > len(layouts):
        raise RunError(f"{origin}: {len(generations)} generations in metrics.csv but {len(layouts) - 1} membership changes in events.csv")
    found = _Calibration([], [], [])
    steady: dict[int, float] = {}
    for index, generation in enumerate(generations):
        rows = metrics[metrics["generation"] == generation].sort_values("step", kind="stable")
        if len(rows) < 3:
            continue  # too few steps for a steady median beside the first step
        layout = layouts[index]
        median = float(rows["step_time_s"].iloc[1:].median())
        steady[int(generation)] = median
        found.samples.append((layout.iteration_s, _busiest_microbatches(layout.plan), median / max(1.0, _workers(layout) / cores)))
    recoveries = events[events["kind"] == "reconfiguration"] if not events.empty and "kind" in events else pd.DataFrame()
    for _, row in recoveries.iterrows():
        found.fixed.append(float(row["detect_s"]) + float(row["plan_s"]) + float(row["groups_s"]))
        if int(row["generation"]) in steady:
            found.warmups.append(float(row["first_step_s"]) - steady[int(row["generation"])])
    return found


def calibrate(runs: list[tuple[ExecutionPlan, pd.DataFrame, pd.DataFrame, Any, str]]) -> RuntimeOverhead:
    """Measure ``RuntimeOverhead``'s terms on calibration runs ``(plan, metrics, events, strategy, origin)``.

    Each generation's layout is the planner's (the run's plan, then the Oobleck strategy's
    reaction to each membership change, as in the simulation); its steady step is the median
    ``step_time_s`` of the generation without its first step. The step samples of all runs are
    pooled into one fit; at least one run must have a reconfiguration (for the fixed part).
    """
    cores = os.cpu_count() or 1
    parts = [_measure(plan, metrics, events, strategy, origin, cores) for plan, metrics, events, strategy, origin in runs]
    samples = [s for part in parts for s in part.samples]
    fixed = [f for part in parts for f in part.fixed]
    warmups = [w for part in parts for w in part.warmups]
    names = ", ".join(origin for *_, origin in runs)
    if not samples:
        raise RunError(f"{names}: no generation with at least 3 steps to calibrate the step overhead on")
    if not fixed:
        raise RunError(f"{names}: no reconfiguration in events.csv: a calibration needs a run with one failure to measure the fixed reconfiguration time")
    per_mb, per_step = fit_step_overhead(samples)
    return RuntimeOverhead(
        per_microbatch_s=per_mb,
        per_step_s=per_step,
        cores=cores,
        reconfigure_fixed_s=float(pd.Series(fixed).median()),
        warmup_s=max(0.0, float(pd.Series(warmups).median())) if warmups else 0.0,
        source=names,
    )


def _load(run_dir: str | Path, profile_path: str | Path | None) -> tuple[ExecutionPlan, Any, Strategy, str]:
    """A run dir's plan, its data (metrics, events) and its strategy (its config, on its cluster)."""
    from analysis.load import load_run
    from oobleck.config import from_container
    from oobleck.sim.experiment import build_context, simulated_strategy

    data = load_run(run_dir)
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
    return plan, data, simulated_strategy(cfg, str(cfg.strategy.name), context), str(data.path)


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
    """Load a real run dir, rebuild its context (config, profile) and ``compare``."""
    plan, data, strategy, origin = _load(run_dir, profile_path)
    return compare(plan, data.metrics, data.events, strategy, origin=origin, runtime=runtime)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oobleck.sim.validate", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="run dir of python -m oobleck.run")
    parser.add_argument("--profile", default=None, help="profile JSON (default: RUN_DIR/profile.json, else the run's cached profile)")
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
            raise RunError(f"--calibration {args.run_dir} is RUN_DIR itself: calibrate on different runs, or the prediction is a fit")
        runtime = calibrate_runs(calibration) if calibration else None
        validation = validate_run(args.run_dir, args.profile, runtime=runtime)
        print(validation.table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        print(f"calibrated overhead per microbatch of the busiest pipeline (fitted on generation 0): {validation.overhead_s:.4g} s")
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

"""Calibrating the runtime model on real runs: ``RuntimeOverhead`` (oobleck/sim/runtime_model.py)
states the model; ``calibrate`` measures each of its terms on calibration runs (pooled), which
``oobleck.sim.validate`` then uses to predict other runs:

- the step terms (per microbatch, per step, per worker, the compute scale of the CPU floor):
  fitted together (``fit_step_model``) on each generation's median steady step, commit to commit
  (``time_s`` intervals without a generation's first step: what the throughput pays, where
  ``step_time_s`` ends at the commit vote, before the optimizer), with the layout's
  ``step_shape``;
- ``reconfigure_fixed_s``: median time from the failure to the new generation established, less
  the state copy (``total_s - first_step_s - state_copy_s``), of its reconfigurations (of its
  failovers if it has none); ``failover_fixed_s``: the same of its failovers; ``warmup_s``:
  median excess of the step redone after a reconfiguration (its ``first_step_s``) over the new
  generation's steady step;
- restarts: ``restart_fixed_s`` (``total_s - load_s - first_step_s``, undilated by the restarted
  workers), ``restart_warmup_s``, and the read bandwidth (the model's restore bytes over
  ``load_s``); checkpoints: the snapshot and write bandwidths (the model's busiest writer's
  bytes over ``snapshot_s`` and ``write_s``);
- Bamboo: the exposed share of the redundant forward, the one whose predicted steps (with the
  fitted step terms) best match its generations' steady steps (``_fit_exposure``), on its inline
  generations only (the share is a setting of that mode alone: lazy runs no redundant forward in
  steady state and eager's is costed from its operation lists, so their generations are step
  samples like any other);
- ReCycle: a re-route is charged as a reconfiguration's fixed part (``oobleck.sim.charges``), so
  its rows pool with the reconfigurations'; a re-routed layout's step counts the peers' extra
  stage runs (``step_shape``);
- ``cores``: ``os.cpu_count()`` where the calibration runs (the runs are local).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, cast

import pandas as pd

from oobleck.errors import RunError
from oobleck.planning.inputs import ModelProfile
from oobleck.planning.outputs import ExecutionPlan, Worker
from oobleck.recovery_costs import checkpoint_cost, restore_s
from oobleck.sim.runtime_model import RuntimeOverhead, StepShape, fit_step_model, step_model
from oobleck.strategy import Layout, RunState, Strategy, StrategyConfig

EXPOSURE_STEPS = 20  # Bamboo's exposed share is fitted on a grid of 0, 1/20, ..., 1


def node_ids(value: Any) -> list[int]:
    """Node ids from an events.csv cell: a number (``node``) or a list written as text (``nodes``)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return []
    if isinstance(value, (int, float)):
        return [int(value)]  # pandas reads an integer column with gaps as floats (0.0)
    return [int(x) for x in re.findall(r"-?\d+", str(value))]


def with_exposure(config: StrategyConfig, exposed: float) -> StrategyConfig:
    """Bamboo's config with ``redundant_forward_exposed`` set: a field of its own config type,
    which ``oobleck`` does not import (``baselines`` plugs into it), hence untyped here."""
    changed: StrategyConfig = replace(cast(Any, config), redundant_forward_exposed=exposed)
    return changed


def worker_count(layout: Layout) -> int:
    return len(layout.plan.assignments()) if layout.plan is not None else len(layout.nodes)


def _detours(plan: ExecutionPlan) -> dict[int, int]:
    """Per pipeline, the microbatches of other pipelines that its stages run for a re-route (ReCycle)."""
    out: dict[int, int] = {}
    for reroute in plan.reroutes:
        for peer in reroute.via:
            out[peer] = out.get(peer, 0) + 1
    return out


def step_shape(layout: Layout, profile: ModelProfile) -> StepShape:
    """What ``RuntimeOverhead.step_s`` needs of a layout: its planner time, microbatches, workers
    and the profile's compute of all its workers in one step (Bamboo's redundant forward included
    where its mode runs one: the CPU runs it whether or not it is on the critical path; ReCycle's
    re-routed microbatches included on the peers that run them, each one more stage run, and the
    busiest stage's microbatches counting the detours through its pipeline)."""
    plan = layout.plan
    if plan is None:
        return StepShape(layout.iteration_s, 1, 1, len(layout.nodes), 0.0)
    pipelines = {p.index: p for p in plan.pipelines}
    compute = sum(redundant_seconds(plan, profile).values())
    for a in plan.assignments():
        own = sum(profile.layers[layer].forward_s + profile.layers[layer].backward_s for layer in a.layers) / a.shards
        compute += own * pipelines[a.pipeline].microbatches
    stage_runs = sum(p.microbatches * p.template.num_stages for p in plan.pipelines)
    for reroute in plan.reroutes:
        layers = profile.layers[reroute.start : reroute.end]
        compute += sum(layer.forward_s + layer.backward_s for layer in layers) * len(reroute.via)
        stage_runs += len(reroute.via)
    detours = _detours(plan)
    busiest = max((p.microbatches + detours.get(p.index, 0) for p in plan.pipelines), default=1)
    return StepShape(layout.iteration_s, busiest, stage_runs, worker_count(layout), compute)


def event_rows(events: pd.DataFrame, kind: str) -> pd.DataFrame:
    return events[events["kind"] == kind] if not events.empty and "kind" in events else pd.DataFrame()


def redundant_seconds(plan: ExecutionPlan, profile: ModelProfile) -> dict[Worker, float]:
    """Per worker, the forward seconds of its shadow layers per step (the cost model's); none in
    Bamboo's lazy mode, which keeps the copy in host memory and runs no redundant forward in
    steady state (``baselines.bamboo.memory``)."""
    pipelines = {p.index: p for p in plan.pipelines}
    out: dict[Worker, float] = {}
    for a in plan.assignments():
        if plan.redundancy == "lazy":
            out[a.worker] = 0.0
            continue
        forward = sum(profile.layers[layer].forward_s for layer in a.shadow_layers if layer not in a.layers) / a.shards
        out[a.worker] = forward * pipelines[a.pipeline].microbatches
    return out


RECOVERY_KINDS = ("reconfiguration", "failover", "reroute", "restart")


def _changes(events: pd.DataFrame) -> list[tuple[int, list[int], list[int]]]:
    """The run's generation changes in order, as ``(new generation, removed, joined)`` of each recovery row."""
    rows = events[events["kind"].isin(RECOVERY_KINDS)] if not events.empty and "kind" in events else pd.DataFrame()
    if rows.empty:
        return []
    return [
        (int(row["generation"]), node_ids(row.get("removed")), node_ids(row.get("joined")))
        for _, row in rows.sort_values("time_s", kind="stable").iterrows()
    ]


@dataclass
class _Calibration:
    """What one calibration run measured (pooled over runs by ``calibrate``)."""

    samples: list[tuple[StepShape, float]]  # each generation's layout and its steady step (commit to commit)
    fixed: list[float]  # each reconfiguration from the failure to established, less the copy (_fixed_part)
    # The step redone after a reconfiguration beyond the new generation's steady step (not a run's
    # step 0: that one also pays the run's own start, lazy allocation, and is slower still).
    warmups: list[float]
    failover_fixed: list[float] = field(default_factory=list)  # the same of each failover
    restart_fixed: list[float] = field(default_factory=list)  # before reading state, undilated
    restart_warmups: list[float] = field(default_factory=list)
    read_gbps: list[float] = field(default_factory=list)
    snapshot_gbps: list[float] = field(default_factory=list)
    write_gbps: list[float] = field(default_factory=list)
    exposed: list[tuple[Strategy, Layout, float]] = field(default_factory=list)  # Bamboo generations, as samples


def _measure(
    plan: ExecutionPlan,
    metrics: pd.DataFrame,
    events: pd.DataFrame,
    strategy: Strategy,
    origin: str,
    cores: int,
) -> _Calibration:
    if "time_s" not in metrics or "generation" not in metrics:
        raise RunError(f"{origin}: metrics.csv needs time_s and generation columns to calibrate on")
    layout = strategy.start(list(plan.nodes)).layout
    if layout is None:
        raise RunError(f"{origin}: the planner finds no layout for the run's nodes {list(plan.nodes)}")
    generations = sorted(metrics["generation"].unique())
    by_generation = {int(generations[0]): layout}
    alive = set(plan.nodes)
    for generation, removed, joined in _changes(events):
        alive = (alive - set(removed)) | set(joined)
        state = RunState(layout, tuple(sorted(alive)), tuple(removed), tuple(joined), step=1, checkpoint_step=1)
        decision = strategy.on_change(state)
        if decision.layout is None:
            raise RunError(f"{origin}: the strategy finds no layout after the change (-{removed}, +{joined})")
        layout = by_generation[generation] = decision.layout
    found = _Calibration([], [], [])
    steady: dict[int, float] = {}
    costs = strategy.config.costs
    link = strategy.context.cluster.inter_node_bandwidth
    profile = strategy.context.profile
    for generation in generations:
        rows = metrics[metrics["generation"] == generation].sort_values("step", kind="stable")
        layout = by_generation.get(int(generation))
        if len(rows) < 3 or layout is None:
            continue  # too few steps for a steady median beside the first step, or no recovery row
        # The cadence (commit to commit), not ``step_time_s``: that one ends at the commit vote and
        # leaves out the optimizer step and the wait for the decision, which the throughput pays.
        median = float(rows["time_s"].diff().iloc[1:].median())
        steady[int(generation)] = median
        inline = layout.plan.shadows and layout.plan.redundancy == "inline"
        if inline and hasattr(strategy, "iteration_s") and layout.state is not None:
            # Bamboo inline: how much of its redundant forward is on the critical path is fitted on
            # these steps once the step terms are known (``_fit_exposure``), not with them.
            found.exposed.append((strategy, layout, median))
            continue
        found.samples.append((step_shape(layout, profile), median))
    # A re-route is charged as a reconfiguration's fixed part (oobleck.sim.charges): pooled with them.
    recoveries = events[events["kind"].isin(["reconfiguration", "reroute"])] if "kind" in events else events
    for _, row in recoveries.iterrows():
        found.fixed.append(_fixed_part(row))
        if int(row["generation"]) in steady:
            found.warmups.append(float(row["first_step_s"]) - steady[int(row["generation"])])
    for _, row in event_rows(events, "failover").iterrows():
        # Apart from reconfigurations: a failover plans nothing (Bamboo's predecessor already
        # holds the stage), and pooling the two would charge a failover a loaded planner's seconds.
        found.failover_fixed.append(_fixed_part(row))
    for _, row in event_rows(events, "restart").iterrows():
        restarted = len(node_ids(row.get("restarted_nodes"))) * strategy.context.cluster.gpus_per_node
        load, first_step = float(row.get("load_s", 0.0) or 0.0), float(row["first_step_s"])
        found.restart_fixed.append((float(row["total_s"]) - load - first_step) / max(1.0, restarted / cores))
        generation = int(row["generation"])
        if generation in steady:
            found.restart_warmups.append(first_step - steady[generation])
        layout = by_generation.get(generation)
        if layout is not None and load > 0 and int(row.get("resume_step", 0) or 0) > 0:
            # The model's read at 1 GB/s, over what the run took: the bandwidth in GB/s.
            found.read_gbps.append(restore_s(layout.plan, profile, replace(costs, storage_read_gbps=1.0), link) / load)
    for _, row in event_rows(events, "checkpoint").iterrows():
        layout = by_generation.get(int(row["generation"]))
        if layout is None:
            continue
        # The model's busiest writer at 1 GB/s, over what the run took: the bandwidth in GB/s.
        ck = checkpoint_cost(layout.plan, profile, replace(costs, host_copy_gbps=1.0, storage_write_gbps=1.0), link)
        if float(row["snapshot_s"]) > 0:
            found.snapshot_gbps.append(ck.snapshot_s / float(row["snapshot_s"]))
        if float(row["write_s"]) > 0:
            found.write_gbps.append(ck.write_s / float(row["write_s"]))
    return found


def _fixed_part(row: pd.Series) -> float:
    """A reconfiguration's (or failover's) seconds from the failure to its new generation
    established, less the state copy: detection, planning, the abort reaching every worker, the
    generation's publication and rendezvous, the process groups. ``detect_s + plan_s + groups_s``
    alone left out the abort and rendezvous between them (a quarter of a recovery here)."""
    established = float(row["total_s"]) - float(row["first_step_s"])
    return max(0.0, established - float(row.get("state_copy_s", 0.0) or 0.0))


def _fit_exposure(samples: list[tuple[Strategy, Layout, float]], terms: dict[str, float], cores: int) -> float:
    """Bamboo's exposed share of the redundant forward: the one in [0, 1] (in steps of
    ``1 / EXPOSURE_STEPS``) whose predicted steps best match the Bamboo generations' measured ones
    (squared log ratio). From 1 down, a smaller share only where it fits strictly better: where
    the CPU floor sets the step, the share changes nothing and the runtime's own schedule (the
    redundant forward right after the stage's own) stands."""
    best: tuple[float, float] | None = None
    for k in range(EXPOSURE_STEPS, -1, -1):
        exposed = k / EXPOSURE_STEPS
        error = 0.0
        variants: dict[int, Strategy] = {}  # one per run's strategy: its generations share it
        for strategy, layout, measured in samples:
            if id(strategy) not in variants:
                config = with_exposure(strategy.config, exposed)
                variants[id(strategy)] = type(strategy)(config, strategy.context)
            planner_s = variants[id(strategy)].iteration_s(layout.state)  # type: ignore[attr-defined]
            shape = replace(step_shape(layout, strategy.context.profile), planner_s=planner_s)
            error += math.log(step_model(shape, cores, **terms) / measured) ** 2
        if best is None or error < best[0] - 1e-12:
            best = (error, exposed)
    assert best is not None
    return best[1]


def calibrate(runs: list[tuple[Any, ...]]) -> RuntimeOverhead:
    """Measure ``RuntimeOverhead``'s terms on calibration runs ``(plan, metrics, events, strategy,
    origin)``.

    Each generation's layout is the run's strategy's (its first plan, then its decision at each
    recovery, as in the simulation); its steady step is the median commit-to-commit interval of the
    generation without its first step. The step samples of all runs are pooled into one fit
    (``fit_step_model``; Bamboo generations apart: the share of their redundant forward on the
    critical path is fitted after, on them, ``_fit_exposure``); at least one run must have a reconfiguration or
    failover (for the fixed part). Restart, checkpoint and Bamboo terms come from the runs of
    strategies that have them (``None`` otherwise).
    """
    cores = os.cpu_count() or 1
    parts = [_measure(run[0], run[1], run[2], run[3], run[4], cores) for run in runs]

    def pooled(name: str) -> list[Any]:
        return [value for part in parts for value in getattr(part, name)]

    def median(name: str) -> float | None:
        values = pooled(name)
        return float(pd.Series(values).median()) if values else None

    samples, fixed = pooled("samples"), pooled("fixed") or pooled("failover_fixed")
    names = ", ".join(str(run[4]) for run in runs)
    if not samples:
        raise RunError(f"{names}: no generation with at least 3 steps to calibrate the step overhead on")
    if not fixed:
        raise RunError(
            f"{names}: no reconfiguration in events.csv: a calibration needs a run with one failure to measure the fixed reconfiguration time"
        )
    terms = fit_step_model(samples, cores)
    exposed = _fit_exposure(pooled("exposed"), terms, cores) if pooled("exposed") else None
    warmups = pooled("warmups")
    restart_warmup = median("restart_warmups")
    return RuntimeOverhead(
        **terms,
        cores=cores,
        reconfigure_fixed_s=float(pd.Series(fixed).median()),
        warmup_s=max(0.0, float(pd.Series(warmups).median())) if warmups else 0.0,
        source=names,
        failover_fixed_s=median("failover_fixed"),
        restart_fixed_s=median("restart_fixed"),
        restart_warmup_s=max(0.0, restart_warmup) if restart_warmup is not None else None,
        host_copy_gbps=median("snapshot_gbps"),
        storage_write_gbps=median("write_gbps"),
        storage_read_gbps=median("read_gbps"),
        redundant_exposed=exposed,
    )

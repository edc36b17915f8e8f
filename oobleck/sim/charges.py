"""What carrying out a decision costs: the seconds no node makes progress, by decision kind.

``decision_downtime(decision, strategy, ...)`` dispatches on ``decision.kind`` through
``CHARGES`` (one function per kind; a new kind of decision adds one entry here and nothing in the
engine's time advance):

- ``reconfigure`` / ``failover``: detection (when a failure caused it), the fixed part
  (``reconfigure_fixed_s`` or ``failover_s``), the layer copies over the node links
  (``layer_transfer_s``) and the first step's warm-up;
- ``restart`` / ``start``: a checkpoint of the running layout first when it is planned
  (``checkpoint_first``), detection (a restart caused by a failure), then the restart's components
  on the new plan (``oobleck.recovery_costs.restart_cost``: process start, process groups growing
  with the nodes, building the model state, reading the checkpoint when there is one to read) and
  the warm-up;
- ``continue``: nothing when only idle nodes came or went; when a strategy's own workers absorb a
  change (torchft's replicas), what they do by themselves, read from the layouts before and
  after: a working node lost is detected first (the survivors' quorum waits out the detection
  timeout), nodes that start working heal from a live peer (the layout's largest per-node state
  over one link: the peer sends it while its step waits for the quorum), and the new quorum's
  process groups take the first step's warm-up;
- ``stop`` costs nothing here (a stop's loss is the engine's rollback).

``CostCache`` keeps the per-plan parts (checkpoint, restart, copies) of one strategy's cost
constants: plans are frozen, so a plan object always costs the same under the same constants;
its ``PlanBytes`` (what each plan writes, holds and builds) is shared by every set of constants.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from oobleck.recovery_costs import (
    CheckpointCost,
    RestartCost,
    checkpoint_cost,
    held_bytes_per_node,
    layer_transfer_s,
    restart_cost,
    written_bytes,
)
from oobleck.strategy import Decision, Kind, Layout, Strategy


class PlanBytes:
    """The bytes a plan moves to and from storage and builds (``oobleck.recovery_costs``), which
    do not depend on any bandwidth: shared by every sample of the cost constants (keyed by plan
    and the bytes per parameter), so that a band costs each plan's geometry once."""

    def __init__(self) -> None:
        self._plans: dict[tuple, tuple[Any, Any]] = {}

    def get(self, plan: Any, kind: str, bytes_per_param: float, compute: Callable[[], Any]) -> Any:
        key = (id(plan), kind, bytes_per_param)
        hit = self._plans.get(key)
        if hit is None:
            hit = self._plans[key] = (plan, compute())  # keeps the plan alive: its id stays unique
        return hit[1]


class CostCache:
    """Per-plan costs (checkpoint, restart) of one strategy's layouts under one set of cost
    constants, shared by the simulations that use those constants; ``geometry`` (bytes per plan)
    may be shared more widely, by every set of constants."""

    def __init__(self, geometry: PlanBytes | None = None) -> None:
        self.geometry = geometry or PlanBytes()
        self._checkpoints: dict[int, tuple[Any, CheckpointCost]] = {}
        self._restarts: dict[int, tuple[Any, RestartCost]] = {}
        self._copies: dict[int, tuple[Any, float]] = {}

    def checkpoint(self, strategy: Strategy, layout: Layout) -> CheckpointCost:
        hit = self._checkpoints.get(id(layout.plan))
        if hit is None:
            ctx, costs = strategy.context, strategy.config.costs
            written = self.geometry.get(
                layout.plan,
                "written",
                costs.checkpoint_bytes_per_param,
                lambda: written_bytes(layout.plan, ctx.profile, costs),
            )
            cost = checkpoint_cost(layout.plan, ctx.profile, costs, ctx.cluster.inter_node_bandwidth, written=written)
            hit = self._checkpoints[id(layout.plan)] = (layout.plan, cost)  # keeps the plan alive: its id stays unique
        return hit[1]

    def restart(self, strategy: Strategy, layout: Layout) -> RestartCost:
        hit = self._restarts.get(id(layout.plan))
        if hit is None:
            ctx, costs = strategy.context, strategy.config.costs
            held = {
                per_param: self.geometry.get(
                    layout.plan, "held", per_param, partial(held_bytes_per_node, layout.plan, ctx.profile, per_param)
                )
                for per_param in (costs.checkpoint_bytes_per_param, costs.state_bytes_per_param)
            }
            cost = restart_cost(layout.plan, ctx.profile, costs, ctx.cluster.inter_node_bandwidth, held=held)
            hit = self._restarts[id(layout.plan)] = (layout.plan, cost)
        return hit[1]

    def restore(self, strategy: Strategy, layout: Layout) -> float:
        """Seconds to read the checkpoint back onto ``layout``."""
        return self.restart(strategy, layout).load_s

    def heal(self, strategy: Strategy, layout: Layout) -> float:
        """Seconds for a node that starts working in place to receive its layers' state from a live
        holder: the plan's largest per-node state (``moved_bytes_per_param``) over one link (every
        group of a torchft layout is the same template, so a new group's nodes hold no more)."""
        ctx, costs = strategy.context, strategy.config.costs
        per_param = costs.moved_bytes_per_param
        held = self.geometry.get(
            layout.plan, "held", per_param, partial(held_bytes_per_node, layout.plan, ctx.profile, per_param)
        )
        return max(held, default=0.0) / ctx.cluster.inter_node_bandwidth

    def copy(self, strategy: Strategy, decision: Decision) -> float:
        """Seconds of a reconfiguration's layer copies (``layer_transfer_s``)."""
        hit = self._copies.get(id(decision.transfers))
        if hit is None:
            costs = strategy.config.costs
            seconds = layer_transfer_s(
                decision.transfers, strategy.context.cluster.inter_node_bandwidth, costs.moved_bytes_per_param / 4.0
            )
            hit = self._copies[id(decision.transfers)] = (decision.transfers, seconds)
        return hit[1]


@dataclass(frozen=True)
class Charge:
    """What the engine knows about a decision beyond the decision itself."""

    strategy: Strategy
    cache: CostCache
    previous: Layout | None = None  # the layout running before (a planned restart checkpoints it)
    restarting: bool = False  # a start after the job had stopped: it pays a restart
    failure: bool = False  # a failure caused it: detection comes first


Parts = tuple[tuple[str, float], ...]


def _in_place(decision: Decision, charge: Charge) -> Parts:
    costs = charge.strategy.config.costs
    fixed = costs.reconfigure_fixed_s if decision.kind is Kind.RECONFIGURE else costs.failover_s
    copy = charge.cache.copy(charge.strategy, decision)
    detect = (("detect", costs.detect_s),) if charge.failure else ()
    return (*detect, ("fixed", fixed), ("state_copy", copy), ("warmup", costs.warmup_s))


def _fresh_workers(decision: Decision, charge: Charge) -> Parts:
    assert decision.layout is not None
    costs, cache, strategy = charge.strategy.config.costs, charge.cache, charge.strategy
    parts: list[tuple[str, float]] = []
    if decision.checkpoint_first and charge.previous is not None:
        # Training stops at the step boundary and waits for the checkpoint to be complete.
        ck = cache.checkpoint(strategy, charge.previous)
        parts.append(("checkpoint", ck.snapshot_s + ck.write_s))
    if charge.failure:
        parts.append(("detect", costs.detect_s))
    fresh = cache.restart(strategy, decision.layout)
    parts += [
        ("process_start", fresh.process_start_s),
        ("group_init", fresh.group_init_s),
        ("model_build", fresh.model_build_s),
    ]
    loads = decision.kind is Kind.RESTART or charge.restarting
    if loads and (decision.rollback_to_step or 0) > 0:
        parts.append(("load", fresh.load_s))
    parts.append(("warmup", costs.restart_warmup_s))
    return tuple(parts)


def _reroute(decision: Decision, charge: Charge) -> Parts:
    # ReCycle: no state moves (peers already hold the stage): detection, planning and the new
    # plan's publication, as for a reconfiguration. The re-routed schedule's slower steps are the
    # layout's iteration_s (the strategy costs it at operation level, oobleck.schedules.cost).
    costs = charge.strategy.config.costs
    detect = (("detect", costs.detect_s),) if charge.failure else ()
    return (*detect, ("fixed", costs.reconfigure_fixed_s), ("state_copy", 0.0), ("warmup", costs.warmup_s))


def _nothing(decision: Decision, charge: Charge) -> Parts:
    return ()


def _continue(decision: Decision, charge: Charge) -> Parts:
    previous = charge.previous
    layout = decision.layout if decision.layout is not None else previous
    if previous is None or layout is None:
        return ()
    before, after = set(previous.nodes), set(layout.nodes)
    if before == after:
        return ()  # the same nodes work: idle nodes came or went
    costs = charge.strategy.config.costs
    detect = (("detect", costs.detect_s),) if charge.failure and before - after else ()
    heal = charge.cache.heal(charge.strategy, layout) if after - before else 0.0
    return (*detect, ("state_copy", heal), ("warmup", costs.warmup_s))


CHARGES: dict[Kind, Callable[[Decision, Charge], Parts]] = {
    Kind.RECONFIGURE: _in_place,
    Kind.FAILOVER: _in_place,
    Kind.REROUTE: _reroute,
    Kind.RESTART: _fresh_workers,
    Kind.START: _fresh_workers,
    Kind.CONTINUE: _continue,
    Kind.STOP: _nothing,
}


def decision_downtime(
    decision: Decision,
    strategy: Strategy,
    *,
    previous: Layout | None = None,
    restarting: bool = False,
    failure: bool = False,
    cache: CostCache | None = None,
) -> tuple[float, Parts]:
    """Seconds no node makes progress for carrying out ``decision``, and their named parts (module
    docstring). ``previous``: the layout running before; ``restarting``: a ``start`` after the job
    had stopped (it reads the checkpoint when ``decision.rollback_to_step`` is positive);
    ``failure``: a failure caused the decision (detection is charged first)."""
    charge = Charge(strategy, cache or CostCache(), previous, restarting, failure)
    parts = CHARGES[decision.kind](decision, charge)
    return sum(seconds for _, seconds in parts), parts

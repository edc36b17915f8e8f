"""Oobleck's own resilience policy: instantiate from templates, reconfigure in place.

Every layout comes from the real planner: ``instantiate`` for a start and ``reconfigure`` for a
membership change (the templates are generated once per context). A reconfiguration costs a fixed
overhead (detect, plan, new process groups) plus moving the layers the new plan needs
(``ReconfigurationPlan.transfers``, parameters and Adam moments) over the inter-node links.
When the planner cannot reconfigure (more than f simultaneous failures, a layer without a live
replica, too few nodes), Oobleck falls back to a restart from its last checkpoint, or stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from oobleck.errors import PlanningError
from oobleck.planning.plan import ExecutionPlan
from oobleck.sim.costs import layer_transfer_s, model_state_bytes, per_model_or_formula
from oobleck.sim.params import OobleckParams, parse_params
from oobleck.strategy import Layout, Reaction, Strategy, StrategyContext


def plan_layout(plan: ExecutionPlan) -> Layout:
    sizes = "+".join(str(len(p.nodes)) for p in plan.pipelines)
    return Layout(
        nodes=plan.nodes,
        iteration_s=plan.predicted_iteration_s,
        samples_per_iteration=plan.global_batch_size,
        description=f"{len(plan.pipelines)} pipelines of {sizes} nodes",
        plan=plan,
    )


class SimulatedStrategy(Strategy):
    """A strategy whose costs come from its ``conf/strategy/<name>.yaml`` constants (``CommonParams``):
    periodic checkpoints and restarts, from per-model measurements or the state-size formula."""

    def __init__(self, context: StrategyContext) -> None:
        super().__init__(context)
        self.params: Any = parse_params(self.name, context.params)

    @property
    def checkpoint_interval(self) -> int:
        return self.params.checkpoint_interval

    def _state_bytes(self) -> float:
        return model_state_bytes(self.context.profile, self.params.state_bytes_per_param)

    def checkpoint_s(self, layout: Layout | None = None) -> float:
        p = self.params
        return per_model_or_formula(
            p.checkpoint_s_by_model, self.context.profile.model, p.checkpoint_fixed_s, self._state_bytes(), p.storage_bandwidth_gbps
        )

    def restart_s(self) -> float:
        p = self.params
        return per_model_or_formula(
            p.restart_s_by_model, self.context.profile.model, p.restart_fixed_s, self._state_bytes(), p.restart_bandwidth_gbps
        )

    def global_restart(self, alive: Sequence[int], reason: str) -> Reaction:
        """Roll back to the last checkpoint and restart on ``alive`` (``reason`` says why)."""
        restart = self.start(alive, restart=True)
        return Reaction(
            restart.action,
            restart.layout,
            downtime_s=restart.downtime_s,
            rollback=True,
            breakdown=restart.breakdown,
            reason=reason if restart.layout else restart.reason,
        )


class OobleckStrategy(SimulatedStrategy):
    name = "oobleck"
    params: OobleckParams

    def _instantiate(self, nodes: Sequence[int]) -> ExecutionPlan:
        from oobleck.planning.instantiate import instantiate

        ctx = self.context
        return instantiate(ctx.templates(), sorted(nodes), ctx.global_batch_size, ctx.microbatch_size, ctx.fault_tolerance)

    def start(self, nodes: Sequence[int], *, restart: bool = False) -> Reaction:
        try:
            plan = self._instantiate(nodes)
        except PlanningError as error:
            return Reaction("stop", None, reason=str(error))
        if not restart:
            return Reaction("start", plan_layout(plan))
        downtime = self.restart_s()
        return Reaction("restart", plan_layout(plan), downtime_s=downtime, rollback=True, breakdown=(("restart", downtime),))

    def react(self, layout: Layout, alive: Sequence[int], removed: Sequence[int], joined: Sequence[int]) -> Reaction:
        from oobleck.planning.reconfigure import reconfigure

        assert layout.plan is not None, "an Oobleck layout always carries its plan"
        ctx = self.context
        try:
            result = reconfigure(
                layout.plan,
                ctx.templates(),
                removed=tuple(sorted(removed)),
                joined=tuple(sorted(joined)),
                layer_param_bytes=[layer.param_bytes for layer in ctx.profile.layers],
            )
        except PlanningError as error:
            # Beyond what in-place recovery covers: restart from the last checkpoint (if any).
            fallback = self.start(alive, restart=True)
            reason = f"in-place reconfiguration impossible ({error}); restarting"
            return Reaction(
                fallback.action if fallback.layout is not None else "stop",
                fallback.layout,
                downtime_s=fallback.downtime_s,
                rollback=True,
                breakdown=fallback.breakdown,
                reason=reason if fallback.layout is not None else f"{reason} failed: {fallback.reason}",
            )
        moved_per_param_byte = self.params.moved_bytes_per_param / 4.0
        copy_s = layer_transfer_s(result.transfers, ctx.cluster.inter_node_bandwidth, moved_per_param_byte)
        fixed = self.params.reconfigure_fixed_s
        return Reaction(
            "reconfiguration",
            plan_layout(result.new),
            downtime_s=fixed + copy_s,
            bytes_moved=int(result.bytes_moved * moved_per_param_byte),
            breakdown=(("fixed", fixed), ("state_copy", copy_s)),
        )


__all__ = ["OobleckStrategy", "plan_layout"]

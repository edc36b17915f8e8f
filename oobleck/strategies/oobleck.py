"""Oobleck's resilience policy: instantiate pipeline templates, reconfigure in place.

- Start: ``instantiate`` covers the nodes with at least f+1 template pipelines.
- A membership change: ``reconfigure`` re-instantiates from the same templates on the survivors
  (and joined nodes), copying only the layers each node now needs from live replicas; the
  interrupted step is redone; nothing is lost (``RECONFIGURE``). Nodes the planner cannot use
  stand by.
- Beyond what in-place recovery covers (more than f failures, a layer without a live replica,
  too few nodes): before the first commit every layer is still its seeded state, so the
  survivors simply start over on a fresh plan (with as many of the f+1 pipelines as they can
  host; the runtime reports a plan that tolerates fewer than f failures); after it, restart from the latest checkpoint on
  the survivors with a fresh plan (``RESTART``), or stop when there is no checkpoint.
- A preemption notice: not used (``Strategy.on_notice``'s default: continue), by either Oobleck.
  The paper's Oobleck has no notice; and the in-place reconfiguration after the kill costs what a
  reconfiguration on the notice would (the same plan change and copies) plus at most the step in
  flight, while reconfiguring on the notice would give up the leaving nodes' work for the rest of
  the notice. The kill is recovered like a crash.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from oobleck.errors import PlanningError
from oobleck.planning.outputs import ExecutionPlan
from oobleck.strategy import Decision, Kind, Layout, RunState, Strategy, StrategyConfig


@dataclass
class OobleckConfig(StrategyConfig):
    _target_: str = "oobleck.strategies.oobleck.Oobleck"
    name: str = "oobleck"


def plan_layout(plan: ExecutionPlan, standby: Sequence[int] = ()) -> Layout:
    sizes = "+".join(str(len(p.nodes)) for p in plan.pipelines)
    return Layout(
        plan=plan,
        iteration_s=plan.predicted_iteration_s,
        description=f"{len(plan.pipelines)} pipelines of {sizes} nodes",
        standby=tuple(sorted(standby)),
    )


class Oobleck(Strategy):
    Config = OobleckConfig
    tolerates_in_place = True

    def _instantiate(self, nodes: Sequence[int], fault_tolerance: int | None = None) -> ExecutionPlan:
        from oobleck.planning.instantiate import instantiate

        ctx = self.context
        f = ctx.fault_tolerance if fault_tolerance is None else fault_tolerance
        return instantiate(ctx.templates(), sorted(nodes), ctx.global_batch_size, ctx.microbatch_size, f)

    def start(self, nodes: Sequence[int]) -> Decision:
        from oobleck.planning.reconfigure import preload_solver

        try:
            plan = self._instantiate(nodes)
        except PlanningError as error:
            return Decision(Kind.STOP, reason=str(error))
        preload_solver()  # the first reconfiguration needs it: pay its import now, not in a recovery
        return Decision(Kind.START, plan_layout(plan, [n for n in nodes if n not in plan.nodes]))

    def on_change(self, state: RunState) -> Decision:
        from oobleck.planning.reconfigure import reconfigure

        layout = state.layout
        working = set(layout.nodes)
        alive = set(state.alive)
        removed = tuple(sorted(n for n in state.removed if n in working or n in layout.standby))
        arrived = tuple(sorted(n for n in state.joined if n in alive))
        if not (set(removed) & working) and not arrived:
            # Only a standby left: the running plan goes on.
            return Decision(Kind.CONTINUE, plan_layout(layout.plan, [n for n in layout.standby if n in alive]))
        ctx = self.context
        try:
            result = reconfigure(
                layout.plan,
                ctx.templates(),
                removed=removed,
                joined=arrived,
                layer_param_bytes=ctx.layer_param_bytes,
                max_sources=ctx.transfer_sources,
                piece_bytes=ctx.copy_piece_bytes,
                replan_horizon_steps=ctx.replan_horizon_steps,
                standby=layout.standby,
                fault_tolerance=ctx.fault_tolerance,
            )
        except PlanningError as error:
            return self._beyond_in_place(state, str(error))
        if result.new == layout.plan and not result.transfers:
            return Decision(Kind.CONTINUE, plan_layout(layout.plan, result.standby), reason=result.reason)
        return Decision(
            Kind.RECONFIGURE, plan_layout(result.new, result.standby), transfers=result.transfers, reason=result.reason
        )

    def _beyond_in_place(self, state: RunState, why: str) -> Decision:
        if state.step == 0:
            return self._start_over(state.alive, why)
        if state.checkpoint_step is None:
            return Decision(
                Kind.STOP,
                reason=f"in-place recovery is impossible after step {state.step - 1} ({why}) and there is no "
                "checkpoint to fall back on; set checkpoint.every_steps=<k> to make runs restartable",
            )
        why = f"in-place recovery impossible ({why}): restart from the checkpoint of step {state.checkpoint_step}"
        plan = self._plan_on_survivors(state.alive, why, "restart from its checkpoint")
        if isinstance(plan, Decision):
            return plan
        standby = [n for n in state.alive if n not in plan.nodes]
        return Decision(Kind.RESTART, plan_layout(plan, standby), rollback_to_step=state.checkpoint_step, reason=why)

    def _start_over(self, alive: Sequence[int], why: str) -> Decision:
        """Nothing has committed: every layer is still its seeded initial state, which each worker
        builds itself, so a fresh plan on the survivors loses nothing."""
        plan = self._plan_on_survivors(alive, why, "start over before the first commit")
        if isinstance(plan, Decision):
            return plan
        standby = [n for n in alive if n not in plan.nodes]
        return Decision(
            Kind.RECONFIGURE, plan_layout(plan, standby), reason=f"starting over before the first commit: {why}"
        )

    def _plan_on_survivors(self, alive: Sequence[int], why: str, what: str) -> ExecutionPlan | Decision:
        """A fresh plan on the survivors that, like an in-place reconfiguration, keeps as many of the
        f+1 pipelines as they can host (f is lowered, never insisted on); ``STOP`` when they cannot
        hold one pipeline."""
        n0 = self.context.templates().min_nodes
        most = len(alive) // n0 - 1  # the largest f the survivors allow
        if most < 0:
            return Decision(
                Kind.STOP,
                reason=f"{why}; nor can the run {what}: the {len(alive)} surviving node(s) "
                f"{list(alive)} cannot hold one pipeline (n0={n0} nodes)",
            )
        try:
            return self._instantiate(alive, min(self.context.fault_tolerance, most))
        except PlanningError as error:
            return Decision(
                Kind.STOP, reason=f"{why}; nor can the run {what} on the surviving nodes {list(alive)}: {error}"
            )

"""The paper's Oobleck (SOSP'23): the same start, the paper's reconfiguration (``strategy=oobleck_sosp23``).

- Start: as ``oobleck`` (``instantiate`` covers the nodes with at least f+1 template pipelines; the
  paper's planner chooses by the same cost model, with a MINLP solver where ours is exact).
- A node loss: ``oobleck.planning.sosp23`` regroups the survivors as the released code does
  (shrink a pipeline to a smaller template, borrow nodes from the biggest pipeline, merge short
  pipelines), redistributes the batch, and copies each changed layer whole from one holder
  (``RECONFIGURE``); nothing is lost.
- A join: the joined node stands by (``CONTINUE``); the paper's reconfiguration has no join path.
- Beyond the paper's answer (a layer without a live replica, too few nodes for an n0 pipeline, a
  size without a template): as ``oobleck``, start over before the first commit, else restart from
  the latest checkpoint, else stop.

Where ``oobleck`` is a superset of this: it chooses between regrouping around the untouched
pipelines and a fresh re-plan by the cost model, places nodes by a min-cost assignment of the
bytes to copy, splits each copy over up to ``planner.transfer_sources`` holders, and takes joined
nodes into pipelines.
"""

from __future__ import annotations

from dataclasses import dataclass

from oobleck.errors import PlanningError
from oobleck.strategies.oobleck import Oobleck, OobleckConfig, plan_layout
from oobleck.strategy import Decision, Kind, RunState


@dataclass
class OobleckSosp23Config(OobleckConfig):
    _target_: str = "oobleck.strategies.oobleck_sosp23.OobleckSosp23"
    name: str = "oobleck_sosp23"


class OobleckSosp23(Oobleck):
    Config = OobleckSosp23Config

    def on_change(self, state: RunState) -> Decision:
        from oobleck.planning.sosp23 import reconfigure_sosp23

        layout = state.layout
        working = set(layout.nodes)
        lost = tuple(sorted(n for n in state.removed if n in working))
        standby = [n for n in state.alive if n not in working]
        if not lost:
            joined = [n for n in state.joined if n in state.alive]
            reason = (
                f"nodes {joined} stand by: the paper's reconfiguration takes no joined nodes (strategy=oobleck does)"
                if joined
                else ""
            )
            return Decision(Kind.CONTINUE, plan_layout(layout.plan, standby), reason=reason)
        ctx = self.context
        try:
            result = reconfigure_sosp23(layout.plan, ctx.templates(), lost, ctx.layer_param_bytes, ctx.fault_tolerance)
        except PlanningError as error:
            return self._beyond_in_place(state, str(error))
        return Decision(
            Kind.RECONFIGURE, plan_layout(result.new, standby), transfers=result.transfers, reason=result.reason
        )

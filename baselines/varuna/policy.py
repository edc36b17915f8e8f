"""Varuna-style resilience (Athlur et al., EuroSys'22) as a strategy: checkpoint, restart, morph.

- Layout ("job morphing"): the best homogeneous D x P on the live nodes: D identical pipelines of
  the planner's P-node template (templates generated with f=0, so any P from n0 to N), the batch
  split evenly, ranked by the same cost model as Oobleck; leftover nodes idle.
- Every ``checkpoint_interval`` iterations a checkpoint stops training for ``checkpoint_s``.
- A removal of a working node kills the job: everything since the last completed checkpoint is
  lost, and the job restarts (``restart_s``) on the best D x P of the survivors. Removing an idle
  node costs nothing.
- A join: if the best layout on the larger node set is faster, Varuna checkpoints, restarts and
  morphs (no work lost); otherwise it keeps running.
"""

from __future__ import annotations

from collections.abc import Sequence

from oobleck.errors import PlanningError
from oobleck.sim.costs import homogeneous_iteration_s
from oobleck.sim.params import VarunaParams
from oobleck.sim.policies import SimulatedStrategy
from oobleck.strategy import Layout, Reaction, StrategyContext


def best_homogeneous(context: StrategyContext, nodes: Sequence[int]) -> Layout | None:
    """The fastest D x P layout of identical template pipelines on ``nodes`` (None if none fits)."""
    templates = context.templates(0)
    ordered = sorted(nodes)
    best: tuple[float, int, int] | None = None
    for size, template in sorted(templates.templates.items()):
        pipelines = len(ordered) // size
        if pipelines < 1 or pipelines > context.num_microbatches:
            continue
        seconds = homogeneous_iteration_s(templates, [template] * pipelines, context.num_microbatches)
        # Fastest first; on a tie, fewer nodes (the rest stay free for nothing, but so does the cost).
        key = (seconds, pipelines * size, size)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    seconds, used, size = best
    return Layout(
        nodes=tuple(ordered[:used]),
        iteration_s=seconds,
        samples_per_iteration=context.global_batch_size,
        description=f"D={used // size} x P={size}",
        state=(used // size, size),
    )


class VarunaStrategy(SimulatedStrategy):
    name = "varuna"

    params: VarunaParams

    def start(self, nodes: Sequence[int], *, restart: bool = False) -> Reaction:
        try:
            layout = best_homogeneous(self.context, nodes)
        except PlanningError as error:  # the model fits on no number of nodes at all
            return Reaction("stop", None, reason=str(error))
        if layout is None:
            return Reaction("stop", None, reason=f"no D x P layout fits on {len(nodes)} nodes")
        if not restart:
            return Reaction("start", layout)
        downtime = self.restart_s()
        return Reaction("restart", layout, downtime_s=downtime, rollback=True, breakdown=(("restart", downtime),))

    def react(self, layout: Layout, alive: Sequence[int], removed: Sequence[int], joined: Sequence[int]) -> Reaction:
        working = set(layout.nodes)
        if any(node in working for node in removed):
            return self.global_restart(alive, "a working node was lost: roll back to the last checkpoint")
        if joined and self.params.morph_on_join:
            candidate = best_homogeneous(self.context, alive)
            if candidate is not None and candidate.iteration_s < layout.iteration_s:
                checkpoint = self.checkpoint_s()
                restart = self.restart_s()
                return Reaction(
                    "restart",
                    candidate,
                    downtime_s=checkpoint + restart,
                    checkpoint_first=True,
                    checkpoint_s=checkpoint,
                    breakdown=(("checkpoint", checkpoint), ("restart", restart)),
                    reason="morph onto the joined nodes",
                )
        # Idle nodes came or went: the running job is unaffected; keep the same working nodes.
        return Reaction("none", layout)

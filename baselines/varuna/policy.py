"""Varuna-style resilience (Athlur et al., EuroSys'22): checkpoint, restart, morph.

- Layout ("job morphing"): the best homogeneous D x P on the live nodes: D identical pipelines of
  the planner's P-node template (templates generated with f=0, so any P from n0 to N), the batch
  split evenly, ranked by the same cost model as Oobleck; leftover nodes stand by.
- Every ``checkpoint_every_steps`` steps a checkpoint (``checkpoint.every_steps`` overrides it).
- Losing a working node kills the job: every worker process stops, fresh ones start on the best
  D x P of the survivors, load the last checkpoint and redo every step since (``RESTART``);
  losing a standby costs nothing.
- A join: if the best layout on the larger node set is faster, checkpoint the current step,
  restart and morph onto it (nothing lost); otherwise keep running, the new node standing by.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from oobleck.errors import PlanningError
from oobleck.planning.instantiate import build_plan
from oobleck.strategy import Decision, Kind, Layout, RunState, Strategy, StrategyConfig


@dataclass
class VarunaConfig(StrategyConfig):
    _target_: str = "baselines.varuna.policy.Varuna"
    name: str = "varuna"
    # Source: the Oobleck artifact's Varuna simulator (SymbioticLab/Oobleck, sosp23-artifact,
    # tools/simulator/varuna_simulator.py): checkpoint_per_iter=10.
    checkpoint_every_steps: int = 10
    morph_on_join: bool = True  # restart onto joined nodes when the larger layout is faster


# The best pipeline size per node count, per template set: a layout's speed depends on how many
# nodes it has, not on which, so every restart of every simulation of a model shares the search.
_BEST_SIZE: dict[int, dict[tuple[int, int, int], int | None]] = {}


def _sizes_for(templates) -> dict[tuple[int, int, int], int | None]:  # type: ignore[no-untyped-def]
    key = id(templates)
    if key not in _BEST_SIZE:
        _BEST_SIZE[key] = {}
        weakref.finalize(templates, _BEST_SIZE.pop, key, None)
    return _BEST_SIZE[key]


class Varuna(Strategy):
    Config = VarunaConfig
    requires_checkpoints = True
    config: VarunaConfig

    def _plan(self, ordered: Sequence[int], size: int):  # type: ignore[no-untyped-def]
        ctx = self.context
        pipelines = min(len(ordered) // size, ctx.num_microbatches)
        groups = [tuple(ordered[i * size : (i + 1) * size]) for i in range(pipelines)]
        return pipelines, build_plan(
            ctx.templates(0), [size] * pipelines, groups, ctx.global_batch_size, ctx.microbatch_size, 0
        )

    def _best_size(self, count: int) -> int | None:
        ctx = self.context
        templates = ctx.templates(0)
        cache = _sizes_for(templates)
        key = (count, ctx.global_batch_size, ctx.microbatch_size)
        if key not in cache:
            best: tuple[float, int, int] | None = None
            for size in templates.sizes:
                if count // size < 1:
                    continue
                pipelines, plan = self._plan(range(count), size)
                # Fastest first; on a tie, fewer nodes, then shallower pipelines.
                candidate = (plan.predicted_iteration_s, pipelines * size, size)
                if best is None or candidate < best:
                    best = candidate
            cache[key] = best[2] if best is not None else None
        return cache[key]

    def best_layout(self, nodes: Sequence[int]) -> Layout | None:
        """The fastest D x P layout of identical template pipelines on ``nodes`` (None if none fits)."""
        ordered = sorted(nodes)
        size = self._best_size(len(ordered))
        if size is None:
            return None
        pipelines, plan = self._plan(ordered, size)
        return Layout(
            plan=plan,
            iteration_s=plan.predicted_iteration_s,
            description=f"D={pipelines} x P={size}",
            standby=tuple(ordered[pipelines * size :]),
            state=(pipelines, size),
        )

    def start(self, nodes: Sequence[int]) -> Decision:
        try:
            layout = self.best_layout(nodes)
        except PlanningError as error:  # the model fits on no number of nodes at all
            return Decision(Kind.STOP, reason=str(error), out_of_memory=True)
        if layout is None:
            return Decision(Kind.STOP, reason=f"no D x P layout fits on {len(nodes)} nodes")
        return Decision(Kind.START, layout)

    def on_change(self, state: RunState) -> Decision:
        layout = state.layout
        working = set(layout.nodes)
        if any(node in working for node in state.removed):
            return self.restart(state, "a working node was lost: roll back to the last checkpoint")
        idle = tuple(sorted(n for n in state.alive if n not in working))
        standing = Layout(layout.plan, layout.iteration_s, layout.description, standby=idle, state=layout.state)
        if state.joined and self.config.morph_on_join:
            candidate = self.best_layout(state.alive)
            if candidate is not None and candidate.iteration_s < layout.iteration_s:
                return Decision(
                    Kind.RESTART,
                    candidate,
                    rollback_to_step=state.step,
                    checkpoint_first=True,
                    reason=f"morph onto the joined nodes: {candidate.description}",
                )
        return Decision(Kind.CONTINUE, standing)

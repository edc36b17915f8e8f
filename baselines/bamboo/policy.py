"""Bamboo-style resilience (Thorpe et al., NSDI'23) as a strategy: redundant computation + failover.

Model (every time from the planner's cost model on the P-node template, f=0 template set):

- Fixed depth: P is chosen once (the fastest depth of at least ``min_pipeline_depth`` whose
  redundant copy fits, or ``pipeline_depth``) and never changes; D = floor(nodes / P) identical pipelines share the batch
  evenly; leftover nodes are standbys (idle).
- Redundancy: the node of stage i also holds stage (i+1) mod P (its successor; the ring closes so
  every stage has a copy), i.e. the successor's parameters and optimizer state on top of its own
  (``OOM`` when a device cannot hold both), and runs the successor's forward pass in the pipeline
  bubbles: stage i's time grows by ``max(0, m F_{i+1} - (P-1) w_i) / m`` per microbatch (the part
  of the redundant forward work the 1F1B bubble of ``(P-1) w_i`` cannot absorb). That extra time
  is reported as redundant work.
- Failure of a working node whose neighbours are alive: failover (``failover_s``): its
  predecessor runs both stages from then on (the pipeline loses one stage; its merged stage time
  is the sum), slowing every pipeline's iteration; or, with ``failover_slowdown`` set, the
  iteration time is multiplied by that constant while any pipeline is failed over.
- Two adjacent failed stages in one pipeline (a stage and its only copy lost): global restart from
  the last checkpoint (``restart_s``) with D = floor(nodes / P).
- Rebalancing: standbys replace failed-over stages first; when P standbys are available they
  form a new pipeline; when a failure leaves no standby, the most degraded pipeline is dissolved
  to repair the others if that is faster under the cost model. These moves cost
  ``reconfigure_fixed_s`` plus the state copied to the new holders.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from oobleck.errors import PlanningError
from oobleck.planning.plan import PipelineTemplate
from oobleck.sim.costs import (
    homogeneous_iteration_s,
    layer_params,
    transfer_s,
)
from oobleck.sim.params import BambooParams
from oobleck.sim.policies import SimulatedStrategy
from oobleck.strategy import Layout, Reaction, StrategyContext

FAILED = -1  # a stage slot whose node failed; its predecessor runs it


@dataclass(frozen=True)
class BambooState:
    depth: int
    pipelines: tuple[tuple[int, ...], ...]  # node per stage slot, FAILED when failed over
    spares: tuple[int, ...]


class BambooStrategy(SimulatedStrategy):
    name = "bamboo"

    params: BambooParams

    def __init__(self, context: StrategyContext) -> None:
        super().__init__(context)
        self.depth: int | None = None  # fixed at the first start

    def _template(self, depth: int) -> PipelineTemplate:
        return self.context.templates(0).templates[depth]

    def _stage_forward_s(self, template: PipelineTemplate, stage: int, on_gpus: int) -> float:
        spec = template.stages[stage]
        return sum(layer.forward_s for layer in self.context.profile.layers[spec.start : spec.end]) / on_gpus

    def fits(self, template: PipelineTemplate) -> bool:
        """Each device holds its stage plus the successor stage's parameters and optimizer state."""
        profile, size = self.context.profile, template.num_stages
        for i, spec in enumerate(template.stages):
            successor = template.stages[(i + 1) % size]
            extra = layer_params(profile, successor.start, successor.end) * self.params.state_bytes_per_param
            if size > 1 and template.stage_memory_bytes[i] + extra > self.context.cluster.device_memory_bytes:
                return False
        return True

    def _redundant_stage_seconds(self, template: PipelineTemplate, microbatches: int) -> list[float]:
        size, base = template.num_stages, list(template.stage_seconds)
        if size == 1:
            return base  # a single stage has no successor to shadow
        result = []
        for i, w in enumerate(base):
            extra_total = microbatches * self._stage_forward_s(template, (i + 1) % size, template.stages[i].gpus)
            bubble = (size - 1) * w
            result.append(w + max(0.0, extra_total - bubble) / microbatches)
        return result

    def iteration_s(self, state: BambooState, redundancy: bool = True) -> float:
        """The planner's plan time of the D pipelines, each with its redundant and failed-over stages."""
        template = self._template(state.depth)
        pipelines = len(state.pipelines)
        m = math.ceil(self.context.num_microbatches / pipelines)
        base = list(template.stage_seconds)
        own = self._redundant_stage_seconds(template, m) if redundancy else base
        timed = []
        for slots in state.pipelines:
            stages = list(own)
            failed = [s for s, node in enumerate(slots) if node == FAILED]
            if failed and self.params.failover_slowdown is not None:
                stages = [w * self.params.failover_slowdown for w in stages]
            elif failed:
                for s in failed:  # the predecessor runs the failed stage too (no redundancy for it)
                    stages[(s - 1) % state.depth] += base[s]
                stages = [w for s, w in enumerate(stages) if s not in failed]
            timed.append(replace(template, stage_seconds=tuple(stages)))
        return homogeneous_iteration_s(self.context.templates(0), timed, self.context.num_microbatches)

    def _layout(self, state: BambooState) -> Layout:
        seconds = self.iteration_s(state)
        plain = self.iteration_s(state, redundancy=False)
        failed = sum(slot == FAILED for slots in state.pipelines for slot in slots)
        nodes = tuple(sorted(n for slots in state.pipelines for n in slots if n != FAILED))
        return Layout(
            nodes=nodes,
            iteration_s=seconds,
            samples_per_iteration=self.context.global_batch_size,
            description=f"D={len(state.pipelines)} x P={state.depth}, {failed} failed over, {len(state.spares)} standby",
            redundant_fraction=max(0.0, 1.0 - plain / seconds),
            state=state,
        )

    # ----- layouts -------------------------------------------------------------------------------
    def _fresh_state(self, depth: int, nodes: Sequence[int]) -> BambooState | None:
        ordered = sorted(nodes)
        count = min(len(ordered) // depth, self.context.num_microbatches)
        if count < 1:
            return None
        pipelines = tuple(tuple(ordered[i * depth : (i + 1) * depth]) for i in range(count))
        return BambooState(depth, pipelines, tuple(ordered[count * depth :]))

    def choose_depth(self, nodes: Sequence[int]) -> tuple[int | None, str]:
        templates = self.context.templates(0).templates
        if self.params.pipeline_depth is not None:
            depth = int(self.params.pipeline_depth)
            if depth not in templates:
                return None, f"pipeline_depth={depth} has no template (feasible depths {min(templates)}..{max(templates)})"
            if not self.fits(templates[depth]):
                return None, f"OOM: stages of the {depth}-node template cannot also hold their successor's state"
            return depth, ""
        best: tuple[float, int] | None = None
        for depth, template in sorted(templates.items()):
            if depth < self.params.min_pipeline_depth or not self.fits(template):
                continue
            state = self._fresh_state(depth, nodes)
            if state is None:
                continue
            key = (self.iteration_s(state), depth)
            if best is None or key < best:
                best = key
        if best is None:
            return None, (
                f"OOM: no pipeline depth up to {len(nodes)} nodes lets every stage also hold its successor's "
                f"state in {self.context.cluster.device_memory_bytes / 1e9:.0f} GB"
            )
        return best[1], ""

    def start(self, nodes: Sequence[int], *, restart: bool = False) -> Reaction:
        if self.depth is None:
            try:
                depth, why = self.choose_depth(nodes)
            except PlanningError as error:  # the model fits on no number of nodes at all
                depth, why = None, f"OOM: {error}"

            if depth is None:
                return Reaction("oom" if why.startswith("OOM") else "stop", None, reason=why)
            self.depth = depth
        state = self._fresh_state(self.depth, nodes)
        if state is None:
            return Reaction("stop", None, reason=f"{len(nodes)} nodes cannot form one pipeline of the fixed depth {self.depth}")
        if not restart:
            return Reaction("start", self._layout(state))
        downtime = self.restart_s()
        return Reaction("restart", self._layout(state), downtime_s=downtime, rollback=True, breakdown=(("restart", downtime),))

    def _stage_state_bytes(self, template: PipelineTemplate, stage: int) -> float:
        spec = template.stages[stage]
        return layer_params(self.context.profile, spec.start, spec.end) * self.params.moved_bytes_per_param

    def react(self, layout: Layout, alive: Sequence[int], removed: Sequence[int], joined: Sequence[int]) -> Reaction:
        state: BambooState = layout.state
        depth = state.depth
        template = self._template(depth)
        pipelines = [list(slots) for slots in state.pipelines]
        spares = [n for n in state.spares if n not in set(removed)]
        failovers = 0
        for node in sorted(removed):
            where = next(((p, s) for p, slots in enumerate(pipelines) for s, n in enumerate(slots) if n == node), None)
            if where is None:
                continue  # a standby left
            p, s = where
            if depth == 1 or FAILED in (pipelines[p][(s - 1) % depth], pipelines[p][(s + 1) % depth]):
                return self.global_restart(alive, f"adjacent stages of pipeline {p} lost: global restart")
            pipelines[p][s] = FAILED
            failovers += 1
        spares.extend(sorted(joined))
        moves: list[tuple[int, int, float]] = []  # (source node, target node, bytes)
        dissolved = False

        def repair(candidates: list[list[int]], pool: list[int]) -> None:
            for slots in candidates:
                for s, node in enumerate(slots):
                    if node == FAILED and pool:
                        slots[s] = pool.pop(0)
                        source = slots[(s - 1) % depth]  # the predecessor holds the copy
                        moves.append((source, slots[s], self._stage_state_bytes(template, s)))

        repair(pipelines, spares)
        while len(spares) >= depth and len(pipelines) < self.context.num_microbatches:
            new, spares = spares[:depth], spares[depth:]
            donor = next(slots for slots in pipelines if FAILED not in slots) if pipelines else None
            for s, node in enumerate(new):
                source = donor[s] if donor else node
                moves.append((source, node, self._stage_state_bytes(template, s)))
            pipelines.append(new)
        if not spares and len(pipelines) > 1 and any(FAILED in slots for slots in pipelines):
            # Rebalance: dissolve the most degraded pipeline into the others if that is faster.
            worst = max(range(len(pipelines)), key=lambda i: (pipelines[i].count(FAILED), i))
            rest = [list(slots) for i, slots in enumerate(pipelines) if i != worst]
            pool = [n for n in pipelines[worst] if n != FAILED]
            trial_moves_before = len(moves)
            repair(rest, pool)
            current = BambooState(depth, tuple(map(tuple, pipelines)), ())
            candidate = BambooState(depth, tuple(map(tuple, rest)), tuple(pool))
            if self.iteration_s(candidate) < self.iteration_s(current):
                pipelines, spares = rest, pool
                dissolved = True
            else:
                del moves[trial_moves_before:]
        new_state = BambooState(depth, tuple(map(tuple, pipelines)), tuple(spares))
        new_layout = self._layout(new_state)
        if moves or dissolved or len(pipelines) != len(state.pipelines):
            copy = transfer_s(moves, self.context.cluster.inter_node_bandwidth)
            fixed = self.params.reconfigure_fixed_s
            return Reaction(
                "reconfiguration",
                new_layout,
                downtime_s=fixed + copy,
                bytes_moved=int(sum(m[2] for m in moves)),
                breakdown=(("fixed", fixed), ("state_copy", copy)),
                reason=f"{failovers} failed over, {len(moves)} stage copies"
                + (", dissolved the most degraded pipeline" if dissolved else ""),
            )
        if failovers:
            return Reaction("failover", new_layout, downtime_s=self.params.failover_s, breakdown=(("failover", self.params.failover_s),))
        return Reaction("none", new_layout)

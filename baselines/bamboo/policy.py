"""Bamboo-style resilience (Thorpe et al., NSDI'23): redundant computation, failover, restart.

- Fixed depth: P is chosen once (``pipeline_depth``, or the fastest depth of at least
  ``min_pipeline_depth`` whose busiest device fits) and never changes; D = floor(nodes / P)
  pipelines share the batch evenly; leftover nodes stand by.
- Partition: the layers are split into P contiguous stages balancing parameter bytes (what
  DeepSpeed's pipeline engine, which Bamboo builds on, does by default), one stage per node on
  all of its devices — not Oobleck's throughput-optimal templates.
- Redundancy: the node of stage i also holds stage (i+1) mod P (its successor; the ring closes so
  every stage has a copy; Bamboo's ``get_redundant_stage_ids``), with its optimizer state, kept
  identical through the gradient reduction (``ExecutionPlan.shadows``). Where the redundant
  forward runs is ``redundancy`` (``oobleck.schedules.bamboo``, read from Bamboo's schedule and
  engine): ``lazy`` (Bamboo's default: none in steady state, the copy in host memory), ``eager``
  (before each wait for gradients, in the bubble) or ``inline`` (not one of Bamboo's; the mode the
  paper experiments here set: right after the stage's own forward, on the critical path). What
  each keeps on the device and in host memory is ``baselines.bamboo.memory.stage_memory``; a
  layout whose busiest device does not fit is refused (out of memory), and the memory it needs is
  stated.
- Time: the planner's Eq. 1-4 on the stages, plus the redundant forward by mode: lazy adds
  nothing; eager adds what the operation-level cost (``oobleck.schedules.cost``, list scheduling
  the very lists the runtime executes) finds the redundant forwards add to each pipeline; inline
  puts ``redundant_forward_exposed`` of it on the stage's critical path and lets the rest fill the
  1F1B bubble of ``(P-1) w_i`` (calibrated on real runs, see conf/strategy/bamboo.yaml):
  ``w_i + e F_{i+1} + max(0, (1 - e) m F_{i+1} - (P-1) w_i) / m``.
- A lost node whose ring neighbours live: failover. Its predecessor already holds its layers and
  runs both stages from the next step with no state copy (a lost first stage goes to the second
  stage's node instead, copying stage 0 from live holders: our runtime runs one contiguous layer
  range per device, and the ring predecessor of stage 0 is the last stage). Redundancy for the
  merged stage is re-established by copies from live holders. A decision in which a lost stage is
  taken over by its predecessor is a failover, whatever else it does.
- Two ring-adjacent stages of one pipeline lost (a stage and its only copy): global restart from
  the last checkpoint with D = floor(nodes / P).
- Standbys replace failed-over stages first; P standbys form a new pipeline (reconfigurations with
  state copies). ``rebalance`` (off by default: real Bamboo has no such step) also dissolves the
  most degraded pipeline to repair the others when a failure leaves no standby and that is faster
  under the cost model.
- A preemption notice (``on_notice``): the nodes under notice are treated as lost at once, while
  they still live: a failover onto their predecessors (or a repair from standbys), so that their
  kill later changes nothing. That is Bamboo's spot agent (``project_pactum/agent``): it polls the
  EC2 spot instance-action endpoint every 3 s (``get_notices.py``) and, on a notice, sends SIGTERM
  to its workers; the engine (``deepspeed/runtime/pipe/engine.py``, ``train_batch``) records in
  the store that the rank leaves at the next step, and at that step the rank exits cleanly while
  its neighbours switch to the failover schedule (``check_preemptions``), after copying a leaving
  shadow holder's layers to a node that stays when no other holder has them
  (``save_shadow_node_state``). Where ours differs: the change is carried out at once (the step in
  flight is redone) rather than at the next step boundary; the nodes under notice send nothing
  (our runtime copies only between workers of the new plan; every stage has a live copy anyway);
  and where a failover is impossible (a stage and its copy both under notice) it checkpoints the
  next step boundary and restarts without them (nothing lost) where Bamboo would reconfigure
  from the leaving nodes' state.

This module holds the decisions (the depth, failover, restart, repair by standbys, notices); the
settings and the pipelines' state are ``baselines.bamboo.config``, memory, step time and plan
``baselines.bamboo.cost``, the stage split ``baselines.fixed_depth.balanced_partition``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from baselines.bamboo.config import FAILED, BambooConfig, BambooState
from baselines.bamboo.cost import BambooCostModel
from oobleck.planning.reconfigure import plan_transfers
from oobleck.strategy import Decision, Kind, RunState


class Bamboo(BambooCostModel):
    Config = BambooConfig

    # ----- layouts -------------------------------------------------------------------------------
    def _memory_message(self, depth: int) -> str:
        need = max(self.stage_memory(self.partition(depth)))
        return (
            f"out of memory: with pipeline depth {depth} a stage and its successor's copy "
            f"({self.config.redundancy} redundancy) need {need / 1e9:.2f} GB on one device but it has "
            f"{self.context.cluster.device_memory_bytes / 1e9:.2f} GB"
        )

    def choose_depth(self, nodes: Sequence[int]) -> tuple[int | None, str]:
        layers = len(self.context.profile.layers)
        low = max(2, int(self.config.min_pipeline_depth))
        if self.config.pipeline_depth is not None:
            depth = int(self.config.pipeline_depth)
            if not low <= depth <= min(layers, len(nodes)):
                return None, (
                    f"strategy.pipeline_depth={depth} needs {low} <= depth <= min(layers={layers}, nodes={len(nodes)}); "
                    "Bamboo's redundancy needs every stage's successor on another node"
                )
            if not self.fits(self.partition(depth)):
                return None, self._memory_message(depth)
            return depth, ""
        best: tuple[float, int] | None = None
        for depth in range(low, min(layers, len(nodes)) + 1):
            if not self.fits(self.partition(depth)):
                continue
            state = self.fresh_state(depth, nodes)
            if state is None:
                continue
            key = (self.iteration_s(state), depth)
            if best is None or key < best:
                best = key
        if best is None:
            deepest = min(layers, len(nodes))
            if deepest >= low:
                # The depth that needs the least memory per device says by how much nothing fits.
                leanest = min(range(low, deepest + 1), key=lambda d: (max(self.stage_memory(self.partition(d))), d))
                why = self._memory_message(leanest)
            else:
                why = f"{len(nodes)} nodes cannot form a pipeline of depth >= {low}"
            return None, f"no pipeline depth from {low} to {deepest} fits: {why}"
        return best[1], ""

    def on_change(self, run: RunState) -> Decision:
        state: BambooState = run.layout.state
        depth = state.depth
        pipelines = [list(slots) for slots in state.pipelines]
        alive = set(run.alive)
        spares = [n for n in state.spares if n in alive]
        lost: list[tuple[int, int]] = []  # (pipeline, slot) of the stages lost in this change
        for node in sorted(run.removed):
            where = next(((p, s) for p, slots in enumerate(pipelines) for s, n in enumerate(slots) if n == node), None)
            if where is None:
                continue  # a standby left
            p, s = where
            if FAILED in (pipelines[p][(s - 1) % depth], pipelines[p][(s + 1) % depth]):
                return self.restart(
                    run, f"ring-adjacent stages of pipeline {p} lost (a stage and its only copy): global restart"
                )
            pipelines[p][s] = FAILED
            lost.append((p, s))
        spares.extend(sorted(n for n in run.joined if n in alive and n not in spares))
        moved = False

        def repair(candidates: list[list[int]], pool: list[int]) -> bool:
            done = False
            for slots in candidates:
                for s, node in enumerate(slots):
                    if node == FAILED and pool:
                        slots[s] = pool.pop(0)
                        done = True
            return done

        moved |= repair(pipelines, spares)
        while len(spares) >= depth and len(pipelines) < self.context.num_microbatches:
            pipelines.append(spares[:depth])
            spares = spares[depth:]
            moved = True
        dissolved: int | None = None
        rebalance = self.config.rebalance and not spares and len(pipelines) > 1
        if rebalance and any(FAILED in slots for slots in pipelines):
            # Dissolve the most degraded pipeline into the others if that is faster (an option:
            # real Bamboo has no such step).
            worst = max(range(len(pipelines)), key=lambda i: (pipelines[i].count(FAILED), i))
            rest = [list(slots) for i, slots in enumerate(pipelines) if i != worst]
            pool = [n for n in pipelines[worst] if n != FAILED]
            repair(rest, pool)
            current = replace(state, pipelines=tuple(map(tuple, pipelines)), spares=())
            candidate = replace(state, pipelines=tuple(map(tuple, rest)), spares=tuple(pool))
            if self.iteration_s(candidate) < self.iteration_s(current):
                pipelines, spares, moved, dissolved = rest, pool, True, worst
                lost = [(p - (p > worst), s) for p, s in lost if p != worst]
        taken_over = sum(pipelines[p][s] == FAILED for p, s in lost)
        new_state = replace(state, pipelines=tuple(map(tuple, pipelines)), spares=tuple(spares))
        layout = self.layout(new_state)
        if not moved and not lost:
            return Decision(Kind.CONTINUE, layout)
        transfers = plan_transfers(
            run.layout.plan,
            layout.plan,
            run.removed,
            self.context.layer_param_bytes,
            max_sources=self.context.transfer_sources,
        )
        taken = f"{taken_over} stage(s) taken over by their predecessor" if taken_over else ""
        replaced = len(lost) - taken_over
        why = [
            taken,
            f"{replaced} lost stage(s) replaced by standbys" if replaced else "",
            f"pipeline {dissolved} dissolved to repair the others (rebalance)" if dissolved is not None else "",
        ]
        reason = "; ".join(w for w in why if w) or "standbys repaired failed-over stages or formed a pipeline"
        # A stage taken over by its predecessor is a failover, whatever else the decision moves.
        kind = Kind.FAILOVER if taken_over else Kind.RECONFIGURE
        return Decision(kind, layout, transfers=transfers, reason=reason)

    def on_notice(self, run: RunState) -> Decision:
        """The nodes under notice taken out while they live (module docstring)."""
        gone = replace(run, alive=run.staying, removed=tuple(sorted({*run.removed, *run.leaving})))
        decision = self.on_change(gone)
        if decision.kind is Kind.RESTART:
            return replace(decision, rollback_to_step=run.step, checkpoint_first=True)
        return decision

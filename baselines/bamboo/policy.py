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
  (before each wait for gradients, in the bubble) or ``inline`` (this harness's earlier mode: right
  after the stage's own forward, on the critical path). What each keeps on the device and in host
  memory is ``baselines.bamboo.memory.stage_memory``; a layout whose busiest device does not fit
  is refused (out of memory), and the memory it needs is stated.
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
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from baselines.bamboo.memory import StageMemory, stage_memory
from baselines.fixed_depth import FixedDepthPipelines, PipelinesState
from oobleck.errors import PlanningError
from oobleck.planning.layouts import even_split
from oobleck.planning.outputs import (
    REDUNDANCY_MODES,
    ExecutionPlan,
    PipelineInstance,
    PipelineTemplate,
    ShadowCopy,
)
from oobleck.planning.pipeline_cost import ProfileArrays
from oobleck.planning.reconfigure import plan_transfers
from oobleck.strategy import Decision, Kind, Layout, RunState, StrategyConfig, StrategyContext

FAILED = -1  # a stage slot whose node failed; a neighbour runs it


@dataclass
class BambooConfig(StrategyConfig):
    _target_: str = "baselines.bamboo.policy.Bamboo"
    name: str = "bamboo"
    # Assumption: Bamboo falls back to checkpoints only for adjacent failures, so it checkpoints
    # rarely (neither paper states an interval).
    checkpoint_every_steps: int = 100
    pipeline_depth: int | None = None  # None: the fastest depth whose doubled state fits
    # Redundancy needs each stage's successor on another node: depth 1 would be plain data parallelism.
    min_pipeline_depth: int = 2
    # None: a failed-over pipeline is timed by the cost model (its merged stage runs both stages);
    # a number multiplies the iteration time instead while any pipeline is failed over (the
    # Oobleck artifact's Bamboo simulator used 1.5).
    failover_slowdown: float | None = None
    # Where the redundant forward runs: lazy (Bamboo's default), eager, or inline (module docstring).
    redundancy: str = "lazy"
    # inline only: share of the redundant forward on a stage's critical path (1: none hidden).
    redundant_forward_exposed: float = 1.0
    # eager and inline: the redundant forward's activations stay in device memory (memory model).
    keep_redundant_activations: bool = True
    # Activations take this many times the bytes the profile counts (2.0: fp32 against a
    # bf16/fp16 profile; Bamboo's released DeepSpeed configs have no fp16 section, so it trains
    # in fp32). Memory only: the iteration time stays the profile's.
    activation_bytes_factor: float = 1.0
    # Dissolve the most degraded pipeline into the others when faster (not in real Bamboo).
    rebalance: bool = False

    def __post_init__(self) -> None:
        from oobleck.errors import ConfigError

        if self.redundancy not in REDUNDANCY_MODES:
            raise ConfigError(
                f"strategy.redundancy={self.redundancy!r} must be one of {', '.join(REDUNDANCY_MODES)} "
                "(lazy is Bamboo's default; see baselines/bamboo/policy.py)"
            )
        if not float(self.activation_bytes_factor) > 0:
            raise ConfigError(
                f"strategy.activation_bytes_factor={self.activation_bytes_factor!r} must be > 0 "
                "(2.0: fp32 activations against a bf16 profile)"
            )
        if not 0.0 <= float(self.redundant_forward_exposed) <= 1.0:
            raise ConfigError(
                f"strategy.redundant_forward_exposed={self.redundant_forward_exposed!r} must be in [0, 1] "
                "(the share of the redundant forward that adds to a stage's time)"
            )


@dataclass(frozen=True)
class BambooState(PipelinesState):
    """A slot's node is FAILED when its predecessor runs it (failed over)."""


def balanced_partition(param_bytes: Sequence[int], parts: int) -> tuple[tuple[int, int], ...]:
    """Contiguous ``[start, end)`` ranges of ``parts`` non-empty stages minimising the largest
    stage's parameter bytes (exact DP; ties go to the earliest split). Cached: every simulation
    of a model asks for the same splits."""
    return _balanced_partition(tuple(param_bytes), int(parts))


@functools.lru_cache(maxsize=4096)
def _balanced_partition(param_bytes: tuple[int, ...], parts: int) -> tuple[tuple[int, int], ...]:
    n = len(param_bytes)
    if not 1 <= parts <= n:
        raise PlanningError(f"cannot split {n} layers into {parts} stages")
    prefix = [0]
    for b in param_bytes:
        prefix.append(prefix[-1] + b)
    inf = float("inf")
    # best[k][j]: smallest max over the first j layers cut into k stages; cut[k][j]: where the last starts.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    ranges, j = [], n
    for k in range(parts, 0, -1):
        i = cut[k][j]
        ranges.append((i, j))
        j = i
    return tuple(reversed(ranges))


class Bamboo(FixedDepthPipelines[BambooState]):
    Config = BambooConfig
    config: BambooConfig

    def __init__(self, config: BambooConfig, context: StrategyContext) -> None:
        super().__init__(config, context, BambooState)
        self._arrays = ProfileArrays(context.profile)
        self._partitions: dict[int, tuple[tuple[int, int], ...]] = {}
        self._memory: dict[tuple[tuple[int, int], ...], list[StageMemory]] = {}
        self._eager_extra: dict[tuple[tuple[tuple[int, int], ...], int], float] = {}
        self._plans: dict[tuple, ExecutionPlan] = {}

    # ----- cost model -------------------------------------------------------------------------
    def stage_memory(self, partition: Sequence[tuple[int, int]]) -> list[float]:
        """Peak device bytes of each stage slot's devices: its stage and its successor's copy, as
        the redundancy mode keeps them (``baselines.bamboo.memory``)."""
        return [m.device_bytes for m in self.stage_memories(partition)]

    def stage_memories(self, partition: Sequence[tuple[int, int]]) -> list[StageMemory]:
        """Device and host bytes of each stage slot (per device), by ``baselines.bamboo.memory``."""
        key = tuple(partition)
        cached = self._memory.get(key)
        if cached is not None:
            return cached
        arrays, gpus, size = self._arrays, self.context.cluster.gpus_per_node, len(partition)
        layers = self.context.profile.layers
        factor = float(self.config.activation_bytes_factor)
        memory = []
        for i, (a, b) in enumerate(partition):
            c, d = partition[(i + 1) % size]
            memory.append(
                stage_memory(
                    self.config.redundancy,
                    own_state=arrays.state_bytes(a, b),
                    own_activations=arrays.activation_bytes(a, b) * factor,
                    copy_param_bytes=float(arrays.params[d] - arrays.params[c]),
                    copy_state=arrays.state_bytes(c, d),
                    copy_activations=arrays.activation_bytes(c, d) * factor,
                    input_bytes=float(layers[a - 1].output_bytes) * factor if a > 0 else 0.0,
                    output_bytes=float(layers[b - 1].output_bytes) * factor,
                    stage=i,
                    stages=size,
                    microbatches=-(-self.context.num_microbatches // max(1, self.context.cluster.nodes // size)),
                    gpus=gpus,
                    keep_redundant_activations=bool(self.config.keep_redundant_activations),
                )
            )
        self._memory[key] = memory
        return memory

    def fits(self, partition: Sequence[tuple[int, int]]) -> bool:
        """Every stage's device holds its stage and its successor's copy (state and activations)."""
        return len(partition) > 1 and max(self.stage_memory(partition)) <= self.context.cluster.device_memory_bytes

    def partition(self, depth: int) -> tuple[tuple[int, int], ...]:
        """The fixed stage split of a depth (cached: it is a DP over the layers)."""
        if depth not in self._partitions:
            self._partitions[depth] = balanced_partition(self.context.layer_param_bytes, depth)
        return self._partitions[depth]

    def _forward_s(self, start: int, end: int) -> float:
        return (
            sum(layer.forward_s for layer in self.context.profile.layers[start:end])
            / self.context.cluster.gpus_per_node
        )

    def _effective(self, state: BambooState, slots: Sequence[int]) -> list[tuple[int, int, int]]:
        """(node, start, end) of the stages a pipeline runs: a failed slot merges into its
        predecessor (slot 0 into slot 1)."""
        owner = list(range(state.depth))
        for s, node in enumerate(slots):
            if node == FAILED:
                owner[s] = s - 1 if s > 0 else 1
        stages: dict[int, list[int]] = {}
        for s in range(state.depth):
            stages.setdefault(owner[s], []).append(s)
        result = []
        for keeper in sorted(stages):
            members = stages[keeper]
            start = state.partition[min(members)][0]
            end = state.partition[max(members)][1]
            result.append((slots[keeper], start, end))
        return result

    def _pipeline(
        self, state: BambooState, slots: Sequence[int], microbatches: int, redundancy: bool
    ) -> PipelineTemplate:
        stages = self._effective(state, slots)
        template = self.template([(a, b) for _, a, b in stages])
        size = len(stages)
        if not redundancy or size == 1 or microbatches == 0 or self.config.redundancy != "inline":
            return template  # lazy adds nothing; eager is costed on its operations (_with_eager_cost)
        exposed = float(self.config.redundant_forward_exposed)
        seconds = []
        for j, w in enumerate(template.stage_seconds):
            _, a, b = stages[(j + 1) % size]
            forward = self._forward_s(a, b)
            hidden = (1.0 - exposed) * microbatches * forward  # what may fill the bubble of (P-1) w
            seconds.append(w + exposed * forward + max(0.0, hidden - (size - 1) * w) / microbatches)
        return replace(template, stage_seconds=tuple(seconds))

    def _plan(self, state: BambooState, redundancy: bool = True) -> ExecutionPlan:
        key = (state.partition, state.pipelines, redundancy)
        if key not in self._plans:
            self._plans[key] = self._build_plan(state, redundancy)
        return self._plans[key]

    def _build_plan(self, state: BambooState, redundancy: bool) -> ExecutionPlan:
        ctx = self.context
        split = even_split(ctx.num_microbatches, len(state.pipelines))
        templates, groups, shadows = [], [], []
        for p, (slots, m) in enumerate(zip(state.pipelines, split)):
            stages = self._effective(state, slots)
            templates.append(self._pipeline(state, slots, m, redundancy))
            groups.append(tuple(node for node, _, _ in stages))
            if redundancy and len(stages) > 1:
                for j in range(len(stages)):
                    _, a, b = stages[(j + 1) % len(stages)]
                    shadows.append(ShadowCopy(pipeline=p, stage=j, layers=tuple(range(a, b))))
        plan = self.pipelines_plan(templates, groups, split, shadows)
        plan = replace(plan, redundancy=self.config.redundancy)
        if redundancy and self.config.redundancy == "eager":
            plan = self._with_eager_cost(plan)
        return plan

    def _with_eager_cost(self, plan: ExecutionPlan) -> ExecutionPlan:
        """``plan`` timed with what its eager redundant forwards add to each pipeline: the
        operation-level cost of the pipeline's lists with them, less without them."""
        pipelines, slowest = [], 0.0
        for pipeline in plan.pipelines:
            extra = self.eager_extra_s(pipeline.template, pipeline.microbatches)
            pipelines.append(replace(pipeline, predicted_iteration_s=pipeline.predicted_iteration_s + extra))
            slowest = max(slowest, extra)
        # Pipelines finish together by construction, so the step grows by the largest addition.
        return replace(plan, pipelines=tuple(pipelines), predicted_iteration_s=plan.predicted_iteration_s + slowest)

    def eager_extra_s(self, template: PipelineTemplate, microbatches: int) -> float:
        """Seconds eager redundant forwards add to one pipeline of ``template`` running
        ``microbatches`` (list scheduling of the runtime's own lists, ``oobleck.schedules.cost``)."""
        ranges = tuple((s.start, s.end) for s in template.stages)
        key = (ranges, microbatches)
        if key not in self._eager_extra:
            self._eager_extra[key] = self._op_level_extra(template, microbatches)
        return self._eager_extra[key]

    def _op_level_extra(self, template: PipelineTemplate, microbatches: int) -> float:
        from oobleck.schedules import build_schedule
        from oobleck.schedules.cost import schedule_cost

        ctx = self.context
        size = template.num_stages
        if size < 2 or microbatches == 0:
            return 0.0
        alone = PipelineInstance(0, template, tuple(range(template.num_nodes)), microbatches, 0, 0.0)
        shadows = tuple(
            ShadowCopy(0, j, tuple(range(template.stages[(j + 1) % size].start, template.stages[(j + 1) % size].end)))
            for j in range(size)
        )
        plan = ExecutionPlan(
            (alone,),
            ctx.profile.num_layers,
            microbatches * ctx.microbatch_size,
            ctx.microbatch_size,
            0,
            ctx.cluster.gpus_per_node,
            0.0,
            shadows=shadows,
        )
        times = {}
        for mode in ("eager", "lazy"):
            variant = replace(plan, redundancy=mode)
            times[mode] = schedule_cost(variant, build_schedule(variant), ctx.profile, ctx.cluster).makespan_s
        return max(0.0, times["eager"] - times["lazy"])

    def layout(self, state: BambooState) -> Layout:
        plan = self._plan(state)
        plain = self._plan(state, redundancy=False).predicted_iteration_s
        seconds = plan.predicted_iteration_s
        failed = sum(slot == FAILED for slots in state.pipelines for slot in slots)
        if failed and self.config.failover_slowdown is not None:
            # The flat-slowdown model: the intact layout's time, times the constant.
            seconds = self._plan(self._intact(state)).predicted_iteration_s * float(self.config.failover_slowdown)
        memories = self.stage_memories(state.partition)
        peak = max(m.device_bytes for m in memories) / 1e9
        host = max(m.host_bytes for m in memories) / 1e9
        memory = self.context.cluster.device_memory_bytes / 1e9
        return Layout(
            plan=plan,
            iteration_s=seconds,
            description=(
                f"D={len(state.pipelines)} x P={state.depth}, {failed} failed over, {len(state.spares)} standby, "
                f"{self.config.redundancy} redundancy, {peak:.1f} of {memory:.0f} GB per device"
                + (f" and {host:.1f} GB host memory" if host > 0 else "")
            ),
            redundant_fraction=max(0.0, 1.0 - plain / seconds),
            standby=tuple(state.spares),
            state=state,
        )

    @staticmethod
    def _intact(state: BambooState) -> BambooState:
        """The state as if no stage had failed over (placeholder node ids; for timing only)."""
        pipelines = tuple(tuple(n if n != FAILED else -2 - s for s, n in enumerate(slots)) for slots in state.pipelines)
        return replace(state, pipelines=pipelines)

    def iteration_s(self, state: BambooState, redundancy: bool = True) -> float:
        return self._plan(state, redundancy).predicted_iteration_s

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

"""Bamboo's cost model: what a state of its pipelines needs in device and host memory (per stage
slot, by ``baselines.bamboo.memory``) and how long its step takes (the planner's Eq. 1-4 on the
stages, a failed-over slot merged into its predecessor, plus the redundant forward by mode), and
the plan it runs. How each redundancy mode is timed: the "Time" item of ``baselines.bamboo.policy``.
``BambooCostModel`` is the base of the strategy (``policy.Bamboo``), which adds the decisions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from baselines.bamboo.config import FAILED, BambooConfig, BambooState
from baselines.bamboo.memory import StageMemory, stage_memory
from baselines.fixed_depth import FixedDepthPipelines, balanced_partition
from oobleck.planning.layouts import even_split
from oobleck.planning.outputs import ExecutionPlan, PipelineInstance, PipelineTemplate, ShadowCopy
from oobleck.planning.pipeline_cost import ProfileArrays
from oobleck.strategy import Layout, StrategyContext


class BambooCostModel(FixedDepthPipelines[BambooState]):
    """Memory, step time and plan of Bamboo's pipeline states (see the module docstring)."""

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

"""What Bamboo and ReCycle share: equal pipelines of one depth, chosen at the first start and kept,
over the lowest-numbered nodes, the nodes left over standing by.

A subclass says how the layers split into stages (``partition``), which depth to run
(``choose_depth``) and what a state of its pipelines costs (``layout``); this class builds the
intact template of a split, the plan of a set of pipelines, the pipelines of a fresh start, and the
start decision. ``balanced_partition`` is the contiguous split both use (Bamboo weighs the layers
by parameter bytes, ReCycle by compute time).
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from oobleck.errors import PlanningError
from oobleck.planning.layouts import explicit_plan
from oobleck.planning.outputs import ExecutionPlan, PipelineTemplate, ShadowCopy, StageSpec
from oobleck.planning.templates import make_template
from oobleck.strategy import Decision, Kind, Layout, Strategy, StrategyConfig, StrategyContext


@dataclass(frozen=True)
class PipelinesState:
    """Pipelines of one depth: ``pipelines[p][s]`` is the node of stage slot ``s`` of pipeline ``p``
    (the subclass marks a failed slot), ``spares`` the nodes standing by."""

    depth: int
    partition: tuple[tuple[int, int], ...]  # layer range [start, end) of each stage slot
    pipelines: tuple[tuple[int, ...], ...]
    spares: tuple[int, ...]


State = TypeVar("State", bound=PipelinesState)


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


class FixedDepthPipelines(Strategy, Generic[State]):
    """Equal pipelines of a depth fixed at the first start (see the module docstring)."""

    def __init__(self, config: StrategyConfig, context: StrategyContext, state_type: type[State]) -> None:
        super().__init__(config, context)
        self.depth: int | None = None  # fixed at the first start
        self.state_type = state_type
        self._templates: dict[tuple[tuple[int, int], ...], PipelineTemplate] = {}

    @abstractmethod
    def partition(self, depth: int) -> tuple[tuple[int, int], ...]:
        """The layer range of each of ``depth`` stages."""

    @abstractmethod
    def choose_depth(self, nodes: Sequence[int]) -> tuple[int | None, str]:
        """The pipeline depth of the first start, or None and why none can run."""

    @abstractmethod
    def layout(self, state: State) -> Layout:
        """The plan and predicted step time of ``state``."""

    def template(self, ranges: Sequence[tuple[int, int]]) -> PipelineTemplate:
        """The intact template of ``ranges``: one stage per node on all its devices."""
        key = tuple(ranges)
        if key not in self._templates:
            gpus = self.context.cluster.gpus_per_node
            stages = [StageSpec(a, b, node=i, gpu_offset=0, gpus=gpus) for i, (a, b) in enumerate(ranges)]
            self._templates[key] = make_template(
                self.context.profile, self.context.cluster, stages, self.context.reference_microbatches_per_stage
            )
        return self._templates[key]

    def pipelines_plan(
        self,
        templates: Sequence[PipelineTemplate],
        groups: Sequence[Sequence[int]],
        microbatches: Sequence[int],
        shadows: Sequence[ShadowCopy] = (),
    ) -> ExecutionPlan:
        """``explicit_plan`` of ``templates[i]`` on nodes ``groups[i]`` with ``microbatches[i]``
        microbatches, at the run's batch and cluster; no in-place fault tolerance is promised
        (a lost stage is the strategy's own repair, or a restart)."""
        ctx = self.context
        return explicit_plan(
            templates,
            groups,
            microbatches,
            global_batch_size=ctx.global_batch_size,
            microbatch_size=ctx.microbatch_size,
            fault_tolerance=0,
            gpus_per_node=ctx.cluster.gpus_per_node,
            layer_param_bytes=ctx.layer_param_bytes,
            intra_node_bandwidth=ctx.cluster.intra_node_bandwidth,
            inter_node_bandwidth=ctx.cluster.inter_node_bandwidth,
            shadows=shadows,
        )

    def fresh_state(self, depth: int, nodes: Sequence[int]) -> State | None:
        """As many pipelines of ``depth`` as ``nodes`` fill (at most one per microbatch), in node
        order, the rest standing by; None when not one pipeline fits."""
        ordered = sorted(nodes)
        count = min(len(ordered) // depth, self.context.num_microbatches)
        if count < 1:
            return None
        pipelines = tuple(tuple(ordered[i * depth : (i + 1) * depth]) for i in range(count))
        return self.state_type(depth, self.partition(depth), pipelines, tuple(ordered[count * depth :]))

    def start(self, nodes: Sequence[int]) -> Decision:
        if self.depth is None:
            depth, why = self.choose_depth(nodes)
            if depth is None:
                return Decision(Kind.STOP, reason=why, out_of_memory="out of memory" in why)
            self.depth = depth
        state = self.fresh_state(self.depth, nodes)
        if state is None:
            return Decision(
                Kind.STOP, reason=f"{len(nodes)} nodes cannot form one pipeline of the fixed depth {self.depth}"
            )
        return Decision(Kind.START, self.layout(state))

"""Hand-built plans: an ``ExecutionPlan`` made directly, without the planner, so a test or a
benchmark can run any layout (heterogeneous pipelines, sharded stages, a single deep pipeline,
pure data parallelism)."""

from __future__ import annotations

from oobleck.planning.inputs import ClusterSpec
from oobleck.planning.outputs import ExecutionPlan, PipelineInstance, PipelineTemplate, StageSpec


def cluster(nodes: int, gpus: int = 1, memory: float = 1e13, intra: float = 1e10, inter: float = 1e9) -> ClusterSpec:
    """A planner cluster of ``nodes`` nodes with roomy defaults (memory and bandwidths in bytes)."""
    return ClusterSpec(
        nodes=nodes,
        gpus_per_node=gpus,
        device_memory_bytes=memory,
        intra_node_bandwidth=intra,
        inter_node_bandwidth=inter,
    )


def template(stages: list[tuple[int, int, int, int, int]]) -> PipelineTemplate:
    """stages: (start, end, node position, gpu offset, gpus)."""
    specs = tuple(StageSpec(*s) for s in stages)
    num_nodes = max(s.node for s in specs) + 1
    return PipelineTemplate(num_nodes, specs, tuple(1.0 for _ in specs), tuple(0.0 for _ in specs), 4 * len(specs), 1.0)


def hand_plan(
    pipelines: list[tuple[PipelineTemplate, tuple[int, ...], int]],
    *,
    batch: int,
    micro: int,
    layers: int,
    f: int,
    gpus: int,
) -> ExecutionPlan:
    """pipelines: (template, node ids, microbatches); offsets are contiguous in order."""
    instances, first = [], 0
    for index, (tmpl, nodes, mbs) in enumerate(pipelines):
        instances.append(PipelineInstance(index, tmpl, nodes, mbs, first, 1.0))
        first += mbs
    if first != batch // micro:
        raise ValueError(f"pipelines take {first} microbatches but the batch has {batch // micro}")
    return ExecutionPlan(tuple(instances), layers, batch, micro, f, gpus, 1.0)


def two_pipelines_of_two_nodes() -> ExecutionPlan:
    """gpt3_tiny's 6 layers as two 2-node pipelines (layers 0-2 on nodes 0 and 2, 3-5 on nodes 1
    and 3), 4 microbatches each of tiny_config's batch: losing nodes 0 and 2 loses layers 0-2."""
    two_stages = template([(0, 3, 0, 0, 1), (3, 6, 1, 0, 1)])
    return hand_plan([(two_stages, (0, 1), 4), (two_stages, (2, 3), 4)], batch=16, micro=2, layers=6, f=1, gpus=1)

"""Execution plans from explicitly given pipeline templates (strategies that do not instantiate).

``instantiate`` chooses templates and splits the batch itself; a strategy with its own layout
rules (Varuna's identical pipelines, Bamboo's fixed-depth pipelines with failed-over stages and
shadow copies) builds the templates and says how many microbatches each pipeline takes, and
``explicit_plan`` turns that into an ``ExecutionPlan`` timed by the same formula as every other
plan (``oobleck.planning.instantiate``'s module docstring): the slowest pipeline's Eq. 1-4 time
plus its in-node all-reduce, then the cross-pipeline ring all-reduce of the most parameter bytes
one node holds (shadow copies included: their holders join the reduction).
"""

from __future__ import annotations

from collections.abc import Sequence

from oobleck.errors import PlanningError
from oobleck.planning.gradient_sync import _intra_sync
from oobleck.planning.outputs import ExecutionPlan, PipelineInstance, PipelineTemplate, ShadowCopy
from oobleck.planning.pipeline_cost import pipeline_time, ring_allreduce_seconds


def even_split(total: int, parts: int) -> list[int]:
    """``total`` microbatches over ``parts`` pipelines, as evenly as integers allow (first ones get more)."""
    if parts <= 0:
        raise PlanningError("a plan needs at least one pipeline")
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def explicit_plan(
    templates: Sequence[PipelineTemplate],
    node_groups: Sequence[Sequence[int]],
    microbatches: Sequence[int],
    *,
    global_batch_size: int,
    microbatch_size: int,
    fault_tolerance: int,
    gpus_per_node: int,
    layer_param_bytes: Sequence[int],
    intra_node_bandwidth: float,
    inter_node_bandwidth: float,
    shadows: Sequence[ShadowCopy] = (),
) -> ExecutionPlan:
    """A plan running ``templates[i]`` on ``node_groups[i]`` with ``microbatches[i]`` microbatches."""
    if not (len(templates) == len(node_groups) == len(microbatches)):
        raise PlanningError("explicit_plan needs one node group and one microbatch count per template")
    if sum(microbatches) != global_batch_size // microbatch_size:
        raise PlanningError(
            f"pipelines take {sum(microbatches)} microbatches but the batch has {global_batch_size // microbatch_size}"
        )
    for template, group in zip(templates, node_groups):
        if template.num_nodes != len(group):
            raise PlanningError(f"a {template.num_nodes}-node template cannot run on nodes {list(group)}")
    per_pipeline = [
        pipeline_time(t.stage_seconds, m) + _intra_sync(t, layer_param_bytes, intra_node_bandwidth) if m else 0.0
        for t, m in zip(templates, microbatches)
    ]
    instances, first = [], 0
    for index, (template, group, m, seconds) in enumerate(zip(templates, node_groups, microbatches, per_pipeline)):
        instances.append(PipelineInstance(index, template, tuple(group), int(m), first, seconds))
        first += m
    plan = ExecutionPlan(
        pipelines=tuple(instances),
        num_layers=templates[0].num_layers,
        global_batch_size=global_batch_size,
        microbatch_size=microbatch_size,
        fault_tolerance=fault_tolerance,
        gpus_per_node=gpus_per_node,
        predicted_iteration_s=0.0,
        shadows=tuple(shadows),
    )
    node_bytes: dict[int, int] = {}
    for assignment in plan.assignments():
        held = sum(layer_param_bytes[layer] for layer in assignment.held_layers)
        node_bytes[assignment.worker[0]] = max(node_bytes.get(assignment.worker[0], 0), held)
    cross = ring_allreduce_seconds(max(node_bytes.values()), len(templates), inter_node_bandwidth)
    return _with_time(plan, max(per_pipeline) + cross)


def _with_time(plan: ExecutionPlan, seconds: float) -> ExecutionPlan:
    from dataclasses import replace

    return replace(plan, predicted_iteration_s=seconds)

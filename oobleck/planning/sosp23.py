"""The paper's reconfiguration (Oobleck, SOSP'23, Section 4): shrink, borrow, merge, one source per copy.

The algorithm of the released code, ``ReconfigurationEngine.on_reconfigure`` and
``_copy_model_states`` in ``oobleck/execution/engine.py`` of SymbioticLab/Oobleck (branch
``sosp23-artifact``; ``develop`` differs only in sorting each pipeline's nodes), on the planner's
public types:

1. Drop the lost nodes from every pipeline, keeping the survivors' order. A pipeline left with no
   node disappears; one left with at least n0 nodes *shrinks* to the template of its new size.
2. A pipeline left with fewer than n0 nodes *borrows* nodes from the biggest pipeline (the last of
   the biggest, in pipeline order), taking that pipeline's last node, as long as the lender keeps
   more than n0; borrowed nodes are appended.
3. When no pipeline can lend, the short pipelines are *merged*: each is concatenated with the next
   short ones until it has n0 nodes; the last one, when no short pipeline is left, with the first
   full pipeline.
4. The new pipelines are ordered by size (stable), each gets the template of its node count, and
   the global batch is redistributed over them (``build_plan``: the same exact min-max split as
   every plan, where the paper solves its MINLP).
5. Copies: a layer whose holders changed is sent by *one* holder to every new holder: the first
   old pipeline's holder (in old pipeline order) that keeps holding the layer in the new plan.

Where this differs from the released code: when no surviving holder keeps the layer (every
pipeline changed), that code stops ("No alive ranks for the layer"); here the first surviving old
holder sends it, as the paper's text describes copying from a surviving replica. Joins are not
part of the paper's reconfiguration (the released code has no join path): the strategy leaves
joined nodes standing by. Pure Python on the planner's public API; no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from oobleck.errors import PlanningError
from oobleck.planning.instantiate import build_plan
from oobleck.planning.outputs import ExecutionPlan, LayerTransfer, ReconfigurationPlan, Worker
from oobleck.planning.templates import TemplateSet


@dataclass(frozen=True)
class Regrouping:
    """The node groups after steps 1-4 and what produced them (node ids; pipelines by old index)."""

    groups: tuple[tuple[int, ...], ...]  # the new pipelines' nodes, in the new pipeline order
    shrunk: tuple[int, ...] = ()  # old pipelines that lost nodes and kept at least n0
    borrowed: tuple[tuple[int, int, int], ...] = ()  # (node, lending pipeline, borrowing pipeline)
    merged: tuple[tuple[int, ...], ...] = ()  # old pipelines merged into one, per merge
    dropped: tuple[int, ...] = ()  # old pipelines that lost every node

    def describe(self) -> str:
        parts = []
        if self.shrunk:
            parts.append(f"shrank pipelines {list(self.shrunk)} to smaller templates")
        for node, lender, borrower in self.borrowed:
            parts.append(f"pipeline {borrower} borrowed node {node} from pipeline {lender}")
        for merge in self.merged:
            parts.append(f"merged pipelines {list(merge)}")
        if self.dropped:
            parts.append(f"pipelines {list(self.dropped)} lost every node")
        sizes = "+".join(str(len(g)) for g in self.groups)
        return f"paper's reconfiguration: {'; '.join(parts) or 'no pipeline changed'}; now {sizes} nodes"


def regroup(pipelines: Sequence[Sequence[int]], lost: Sequence[int], min_nodes: int) -> Regrouping:
    """Steps 1-4 of the module docstring on node lists: ``pipelines`` in the running plan's order."""
    if min_nodes <= 0:
        raise PlanningError(f"n0={min_nodes} must be > 0")
    gone = set(lost)
    # Lists shared by reference, as in the released code: a lender that already joined the new
    # order gives up its node there too.
    survivors = [[n for n in nodes if n not in gone] for nodes in pipelines]
    owner = {id(nodes): index for index, nodes in enumerate(survivors)}
    shrunk = tuple(i for i, (old, now) in enumerate(zip(pipelines, survivors)) if min_nodes <= len(now) < len(old))
    dropped = tuple(i for i, now in enumerate(survivors) if not now)
    borrowed: list[tuple[int, int, int]] = []
    need_merge = False
    order: list[list[int]] = []
    for index, nodes in enumerate(survivors):
        if not nodes:
            continue
        while len(nodes) < min_nodes:
            lender = _biggest(survivors, min_nodes)
            if lender is None:
                need_merge = True
                break
            while len(lender) > min_nodes and len(nodes) < min_nodes:
                node = lender.pop()
                nodes.append(node)
                borrowed.append((node, owner[id(lender)], index))
        order.append(nodes)
    merged: tuple[tuple[int, ...], ...] = ()
    if need_merge:
        order, merged = _merge(order, min_nodes, owner)
    order.sort(key=len)  # stable: equal sizes keep their order
    return Regrouping(
        groups=tuple(tuple(nodes) for nodes in order),
        shrunk=shrunk,
        borrowed=tuple(borrowed),
        merged=merged,
        dropped=dropped,
    )


def _biggest(pipelines: list[list[int]], min_nodes: int) -> list[int] | None:
    """The last of the biggest pipelines, if it can lend a node (it has more than n0)."""
    biggest: list[int] | None = None
    for nodes in pipelines:
        if biggest is None or len(nodes) >= len(biggest):
            biggest = nodes
    return biggest if biggest is not None and len(biggest) > min_nodes else None


def _merge(
    order: list[list[int]], min_nodes: int, owner: dict[int, int]
) -> tuple[list[list[int]], tuple[tuple[int, ...], ...]]:
    short = [nodes for nodes in order if len(nodes) < min_nodes]
    results = [nodes for nodes in order if len(nodes) >= min_nodes]
    merges = []
    while short:
        nodes = short.pop(0)
        members = [owner[id(nodes)]]
        while len(nodes) < min_nodes:
            partner = short.pop(0) if short else results.pop(0) if results else None
            if partner is None:
                raise PlanningError(
                    f"the surviving nodes cannot form a pipeline of n0={min_nodes} nodes even after merging "
                    "every short pipeline; restart from a checkpoint"
                )
            members.append(owner[id(partner)])
            nodes.extend(partner)
        results.append(nodes)
        merges.append(tuple(members))
    return results, tuple(merges)


def reconfigure_sosp23(
    plan: ExecutionPlan,
    templates: TemplateSet,
    removed: Sequence[int],
    layer_param_bytes: Sequence[int],
    fault_tolerance: int,
) -> ReconfigurationPlan:
    """The new plan and its single-source copies after ``removed`` nodes of ``plan`` failed.

    ``PlanningError`` when the paper's algorithm has no answer: a layer lost every holder, the
    survivors cannot form an n0-node pipeline, or a pipeline size has no template."""
    gone = set(removed)
    unknown = sorted(gone - set(plan.nodes))
    if unknown:
        raise PlanningError(f"removed nodes {unknown} are not in the running plan (nodes {list(plan.nodes)})")
    if len(layer_param_bytes) != plan.num_layers:
        raise PlanningError(
            f"layer_param_bytes has {len(layer_param_bytes)} entries but the plan has {plan.num_layers} layers"
        )
    holders = plan.layer_holders()
    lost_layers = sorted(layer for layer, workers in holders.items() if all(w[0] in gone for w in workers))
    if lost_layers:
        raise PlanningError(
            f"layers {lost_layers} have no live replica after losing nodes {sorted(gone)}; restart from a checkpoint"
        )
    regrouping = regroup([p.nodes for p in plan.pipelines], sorted(gone), templates.min_nodes)
    missing = sorted({len(g) for g in regrouping.groups if len(g) not in templates})
    if missing:
        raise PlanningError(
            f"the paper's reconfiguration needs pipelines of {missing} nodes, which have no template "
            f"(templates exist for {list(templates.sizes)}); restart from a checkpoint"
        )
    kept = min(fault_tolerance, len(regrouping.groups) - 1)
    new = build_plan(
        templates,
        [len(g) for g in regrouping.groups],
        regrouping.groups,
        plan.global_batch_size,
        plan.microbatch_size,
        kept,
    )
    transfers = single_source_transfers(plan, new, gone, layer_param_bytes)
    reason = regrouping.describe()
    if kept < fault_tolerance:
        reason += f"; it tolerates {kept} failures, fewer than job.fault_tolerance={fault_tolerance}"
    return ReconfigurationPlan(
        old=plan,
        new=new,
        removed=tuple(sorted(gone)),
        joined=(),
        transfers=transfers,
        min_bytes_moved=sum(t.nbytes for t in transfers),
        reason=reason,
    )


def _holder_sets(plan: ExecutionPlan) -> list[dict[int, tuple[Worker, ...]]]:
    """Per pipeline, in pipeline order: layer -> the workers holding it there (a stage's shards)."""
    result = []
    for pipeline in plan.pipelines:
        sets: dict[int, tuple[Worker, ...]] = {}
        for stage_index, stage in enumerate(pipeline.template.stages):
            for layer in stage.layers:
                sets[layer] = pipeline.stage_workers(stage_index)
        result.append(sets)
    return result


def single_source_transfers(
    old: ExecutionPlan, new: ExecutionPlan, removed: set[int], layer_param_bytes: Sequence[int]
) -> tuple[LayerTransfer, ...]:
    """Step 5: each layer's new holders get it whole from one holder (see the module docstring)."""
    old_sets, new_sets = _holder_sets(old), _holder_sets(new)
    held: dict[Worker, set[int]] = {}
    for assignment in old.assignments():
        held.setdefault(assignment.worker, set()).update(assignment.held_layers)
    transfers = []
    for layer in range(new.num_layers):
        was = [sets[layer] for sets in old_sets]
        now = [sets[layer] for sets in new_sets]
        if all(holders in was for holders in now):
            continue
        keeping = [holders for holders in was if holders in now]
        surviving = [holders for holders in was if not any(w[0] in removed for w in holders)]
        source_set = (keeping or surviving)[0]
        for holders in now:
            for shard, target in enumerate(holders):
                if layer in held.get(target, ()):
                    continue
                source = source_set[min(shard, len(source_set) - 1)]  # shard i from shard i, as FSDP's
                transfers.append(
                    LayerTransfer(
                        layer=layer, source=source, target=target, chunk=0, chunks=1, nbytes=layer_param_bytes[layer]
                    )
                )
    return tuple(transfers)

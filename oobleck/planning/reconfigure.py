"""Reconfiguration planning: new pipelines after nodes fail or join, and the layer copies it needs.

Deterministic (every process computes the same plan from the same input), in this order:

1. Failed nodes leave their pipelines; every layer must still have a live holder in the old plan,
   else ``PlanningError`` names the lost layers and the nodes that held them.
2. A pipeline that is still at least n0 nodes takes the template of its new size (or the largest
   template that fits; its spare nodes join the free pool).
3. A pipeline below n0 borrows nodes from the largest pipeline while that one stays >= n0 and
   both sizes have templates; otherwise it merges with the next short pipeline (or, if none is
   left, with the smallest pipeline).
4. Free nodes (joined, or spare) form a new pipeline when there are n0 or more of them and a
   template fits, else each goes to the smallest pipeline that has a template one node larger.
5. If the local steps cannot reach sizes that all have templates, the survivors are instantiated
   afresh (still deterministic, never idle).

Inside a pipeline, nodes take template positions in the order of the first layer they held
(new nodes last), so layers tend to stay where they are. Every (worker, layer) that the new plan
needs and the worker did not hold gets the layer from up to ``max_sources`` surviving holders,
as equal chunks, choosing the least-loaded sources first so no single source sends it all.
"""

from __future__ import annotations

from collections.abc import Sequence

from oobleck.errors import PlanningError
from oobleck.planning.instantiate import _Sync, build_plan, instantiate
from oobleck.planning.plan import ExecutionPlan, LayerTransfer, ReconfigurationPlan, Worker
from oobleck.planning.templates import TemplateSet

# Default number of distinct surviving holders one layer copy is split across.
DEFAULT_MAX_SOURCES = 4


def _check_replicas(plan: ExecutionPlan, removed: set[int]) -> dict[int, tuple[Worker, ...]]:
    holders = plan.layer_holders()
    live = {layer: tuple(w for w in workers if w[0] not in removed) for layer, workers in holders.items()}
    lost = sorted(layer for layer, workers in live.items() if not workers)
    if lost:
        held_by = sorted({w[0] for layer in lost for w in holders[layer]})
        raise PlanningError(
            f"layers {lost} have no live replica: every node holding them ({held_by}) failed "
            f"(removed nodes {sorted(removed)}); restart from a checkpoint"
        )
    return live


def _first_layer_held(plan: ExecutionPlan) -> dict[int, int]:
    first: dict[int, int] = {}
    for pipeline in plan.pipelines:
        for stage in pipeline.template.stages:
            node = pipeline.nodes[stage.node]
            first[node] = min(first.get(node, stage.start), stage.start)
    return first


def _regroup(groups: list[list[int]], free: list[int], templates: TemplateSet) -> list[list[int]] | None:
    """Steps 2-4 of the module docstring on node-id lists; None if sizes without templates remain."""
    n0 = templates.min_nodes
    sizes = set(templates.sizes)

    def fitting(size: int) -> int | None:
        fits = [s for s in sizes if s <= size]
        return max(fits) if fits else None

    # Step 2: pipelines still >= n0 take the largest template that fits; spares become free.
    for group in groups:
        if len(group) >= n0 and len(group) not in sizes:
            target = fitting(len(group))
            if target is None:
                return None
            while len(group) > target:
                free.append(group.pop())
    # Step 3: short pipelines borrow from the largest, else merge.
    while True:
        short = [g for g in groups if len(g) < n0]
        if not short:
            break
        group = short[0]
        need = n0 - len(group)
        largest = max(groups, key=len)
        if largest is not group and len(largest) - need >= n0 and len(largest) - need in sizes and n0 in sizes:
            for _ in range(need):
                group.append(largest.pop())
            continue
        if free:
            group.append(free.pop(0))
            continue
        others = [g for g in short[1:]] or sorted((g for g in groups if g is not group), key=len)[:1]
        if not others:
            return None
        partner = others[0]
        group.extend(partner)
        groups.remove(partner)
        if len(group) >= n0 and len(group) not in sizes:
            target = fitting(len(group))
            if target is None or target < n0:
                return None
            while len(group) > target:
                free.append(group.pop())
    # Step 4: free nodes form a new pipeline or grow the smallest ones.
    free.sort()
    if len(free) >= n0:
        target = fitting(len(free))
        if target is not None and target >= n0:
            groups.append(free[:target])
            free = free[target:]
    while free:
        node = free.pop(0)
        growable = sorted((g for g in groups if len(g) + 1 in sizes), key=len)
        if not growable:
            return None
        growable[0].append(node)
    if any(len(g) not in sizes for g in groups):
        return None
    return groups


def _order_nodes(group: list[int], first_held: dict[int, int], num_layers: int) -> tuple[int, ...]:
    return tuple(sorted(group, key=lambda n: (first_held.get(n, num_layers), n)))


def _transfers(
    old: ExecutionPlan,
    new: ExecutionPlan,
    live_holders: dict[int, tuple[Worker, ...]],
    layer_param_bytes: Sequence[int],
    max_sources: int,
) -> tuple[LayerTransfer, ...]:
    held: dict[Worker, set[int]] = {}
    for assignment in old.assignments():
        held.setdefault(assignment.worker, set()).update(assignment.held_layers)
    load: dict[Worker, int] = {}
    transfers = []
    for assignment in new.assignments():
        target = assignment.worker
        have = held.get(target, set())
        for layer in assignment.held_layers:
            if layer in have:
                continue
            sources = sorted((w for w in live_holders[layer] if w != target), key=lambda w: (load.get(w, 0), w))
            sources = sources[:max_sources]
            elements = layer_param_bytes[layer] // 4
            chunks = len(sources)
            for chunk, source in enumerate(sources):
                count = elements // chunks + (1 if chunk < elements % chunks else 0)
                transfers.append(
                    LayerTransfer(layer=layer, source=source, target=target, chunk=chunk, chunks=chunks, nbytes=4 * count)
                )
                load[source] = load.get(source, 0) + 4 * count
    return tuple(transfers)


def reconfigure(
    plan: ExecutionPlan,
    templates: TemplateSet,
    removed: Sequence[int] = (),
    joined: Sequence[int] = (),
    layer_param_bytes: Sequence[int] | None = None,
    *,
    max_sources: int = DEFAULT_MAX_SOURCES,
) -> ReconfigurationPlan:
    """The plan after ``removed`` nodes fail and ``joined`` nodes arrive (see module docstring)."""
    if max_sources <= 0:
        raise PlanningError(f"planner.transfer_sources={max_sources} must be > 0")
    layer_bytes = tuple(layer_param_bytes if layer_param_bytes is not None else templates.layer_param_bytes)
    if len(layer_bytes) != plan.num_layers:
        raise PlanningError(
            f"layer_param_bytes has {len(layer_bytes)} entries but the plan has {plan.num_layers} layers"
        )
    current = set(plan.nodes)
    gone = set(removed)
    unknown = sorted(gone - current)
    if unknown:
        raise PlanningError(f"removed nodes {unknown} are not in the current plan (nodes {sorted(current)})")
    already = sorted(set(joined) & current)
    if already:
        raise PlanningError(f"joined nodes {already} are already in the current plan")
    if len(set(joined)) != len(joined):
        raise PlanningError(f"joined nodes {sorted(joined)} contain duplicates")
    live = _check_replicas(plan, gone)
    survivors = sorted((current - gone) | set(joined))
    if len(survivors) < templates.min_nodes:
        raise PlanningError(
            f"{len(survivors)} nodes are left after losing {sorted(gone)}, fewer than n0={templates.min_nodes} "
            "that one pipeline needs; restart from a checkpoint with more nodes"
        )
    groups = [[n for n in p.nodes if n not in gone] for p in plan.pipelines]
    groups = [g for g in groups if g]
    regrouped = _regroup(groups, sorted(joined), templates)
    sync = _Sync(templates, templates.intra_node_bandwidth, templates.inter_node_bandwidth)
    M = plan.num_microbatches
    if regrouped is None or len(regrouped) > M:
        new = instantiate(
            templates, survivors, plan.global_batch_size, plan.microbatch_size, min(plan.fault_tolerance, _max_f(templates, len(survivors), M))
        )
    else:
        first_held = _first_layer_held(plan)
        ordered = [_order_nodes(g, first_held, plan.num_layers) for g in regrouped]
        # Deterministic pipeline order: by the smallest node id each pipeline keeps.
        ordered.sort(key=lambda g: min(g))
        new = build_plan(
            templates,
            [len(g) for g in ordered],
            ordered,
            plan.global_batch_size,
            plan.microbatch_size,
            plan.fault_tolerance,
            sync,
        )
    transfers = _transfers(plan, new, live, layer_bytes, max_sources)
    return ReconfigurationPlan(
        old=plan, new=new, removed=tuple(sorted(gone)), joined=tuple(sorted(joined)), transfers=transfers
    )


def _max_f(templates: TemplateSet, nodes: int, microbatches: int) -> int:
    """The largest f the survivors can still honour (f+1 pipelines of n0 nodes)."""
    return max(0, min(nodes // templates.min_nodes, microbatches) - 1)


def check_fault_tolerance(templates: TemplateSet, nodes: int, fault_tolerance: int) -> None:
    """Raise PlanningError unless every survivor count after up to f failures can be covered.

    Covered: the survivors split exactly into pipelines of template sizes (no idle node). With
    at least f+1 pipelines initially, each holding every layer, f failures leave a replica of
    every layer; with fewer nodes than (f+1) n0 there cannot be f+1 pipelines.
    """
    f = fault_tolerance
    n0 = templates.min_nodes
    if nodes < (f + 1) * n0:
        raise PlanningError(f"f={f} needs {f + 1} pipelines of at least n0={n0} nodes = {(f + 1) * n0} nodes; cluster.nodes={nodes}")
    sizes = templates.sizes
    reachable = [False] * (nodes + 1)
    reachable[0] = True
    for n in range(1, nodes + 1):
        reachable[n] = any(s <= n and reachable[n - s] for s in sizes)
    uncovered = [n for n in range(max(nodes - f, 0), nodes + 1) if not reachable[n]]
    if uncovered:
        raise PlanningError(
            f"with f={f} failures out of {nodes} nodes, survivor counts {uncovered} cannot be split into "
            f"pipelines of the template sizes {list(sizes)}; lower job.fault_tolerance or change cluster.nodes"
        )


def plan_transfers(
    old: ExecutionPlan,
    new: ExecutionPlan,
    removed: Sequence[int],
    layer_param_bytes: Sequence[int],
    *,
    max_sources: int = DEFAULT_MAX_SOURCES,
) -> tuple[LayerTransfer, ...]:
    """The layer copies that take ``old`` to ``new`` after ``removed`` nodes failed, for any pair of
    plans (a strategy that builds its own plans, e.g. with shadow copies, uses this); raises
    ``PlanningError`` when a layer the new plan needs has no live holder."""
    live = _check_replicas(old, set(removed))
    return _transfers(old, new, live, layer_param_bytes, max_sources)

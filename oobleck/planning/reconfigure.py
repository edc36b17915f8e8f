"""Reconfiguration planning: the plan after nodes fail or join, where its nodes go, and the copies.

Deterministic (every process computes the same plan from the same input), in this order:

1. Membership. ``removed`` nodes failed (a node that is both removed and joined failed and came
   back empty); ``joined`` and ``standby`` nodes hold nothing. Every layer must still have a live
   holder in the old plan, else ``PlanningError`` names the lost layers and the nodes that held them.
2. Size. The new plan keeps ``f' + 1`` pipelines, ``f' = min(f, the most the alive nodes allow)``,
   and uses as many alive nodes as template sizes cover exactly with ``f' + 1 .. M`` pipelines (each
   pipeline needs one of the M microbatches). Alive nodes beyond that stay *standby*: a join that
   cannot be used never fails the run, and a later reconfiguration takes standbys back in.
3. Candidates, each an exact choice of template sizes by the cost model (instantiate's search):
   *regroup* keeps every pipeline that lost no node as it is and picks the best sizes for the
   other nodes (if none covers them, intact pipelines are given up, smallest first); *fresh* is
   the best instantiation on the same number of nodes.
4. Placement. A candidate's pipelines go on the alive nodes by a min-cost assignment
   (``scipy.optimize.linear_sum_assignment``): a node at a pipeline position costs the parameter
   bytes that position needs and the node does not hold (the same local rank keeps its device);
   among equal costs, nodes that hold something come first. The optimum is ``min_bytes_moved``.
5. Decision, by the cost model: ``replan_horizon_steps * predicted iteration time + copy time``
   (``cost.copy_seconds`` of the copies); the cheaper candidate wins, ties go to regrouping. So
   the new plan is never slower than a fresh instantiation unless the extra state a fresh plan
   must copy costs more than it saves over the horizon. ``replanned`` and ``reason`` say which.
6. Copies. Every (worker, layer) that the new plan needs and the worker does not hold gets the
   layer from up to ``max_sources`` surviving holders, as equal chunks, choosing the least-loaded
   sources first so no single source sends it all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence

import numpy as np

from oobleck.errors import PlanningError
from oobleck.planning.instantiate import _best_multiset, _Sync, build_plan, sync_of
from oobleck.planning.outputs import ExecutionPlan, LayerTransfer, ReconfigurationPlan, Worker, tolerated_failures
from oobleck.planning.pipeline_cost import MOVED_BYTES_PER_PARAM_BYTE, chain_copy_seconds
from oobleck.planning.templates import TemplateSet

# Default number of distinct surviving holders one layer copy is split across.
DEFAULT_MAX_SOURCES = 4
# Default size of the pieces a relayed chunk streams in (moved bytes; planner.copy_piece_mb).
DEFAULT_COPY_PIECE_BYTES = 4 * 2**20
# Steps over which a faster fresh plan must repay its extra copying, for direct API callers; runs
# pass planner.replan_horizon_steps (conf/config.yaml).
DEFAULT_REPLAN_HORIZON_STEPS = 100
# Assignment costs are float64: the tie-break below is only exact while costs stay below 2**52.
_EXACT_FLOAT = 2.0**52


@dataclasses.dataclass(frozen=True)
class _Candidate:
    """One way to reconfigure: a placed plan, its copies and what they cost."""

    name: str  # regroup | fresh
    plan: ExecutionPlan
    copies: list  # the LayerTransfer fields of every copy (``_copies``): built only for the winner
    min_bytes: int
    standby: tuple[int, ...]
    copy_s: float

    def cost(self, horizon: int) -> float:
        return horizon * self.plan.predicted_iteration_s + self.copy_s

    @property
    def transfers(self) -> tuple[LayerTransfer, ...]:
        return LayerTransfer.of_rows(self.copies)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a reconfiguration is planned, which sits on a
    recovery's critical path. Planning allocates tens of thousands of short acyclic tuples, and a
    full collection they trigger traverses everything the process holds (template sets and their
    memos): at 64 nodes of 8 GPUs it added 14-18 ms to one cold 31-33 ms reconfiguration in four
    (``benchmarks/bench_planner.py``). Paused, that collection runs after the recovery instead."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@_collector_paused()
def reconfigure(
    plan: ExecutionPlan,
    templates: TemplateSet,
    removed: Sequence[int] = (),
    joined: Sequence[int] = (),
    layer_param_bytes: Sequence[int] | None = None,
    *,
    max_sources: int = DEFAULT_MAX_SOURCES,
    replan_horizon_steps: int = DEFAULT_REPLAN_HORIZON_STEPS,
    standby: Sequence[int] = (),
    fault_tolerance: int | None = None,
    piece_bytes: int = DEFAULT_COPY_PIECE_BYTES,
) -> ReconfigurationPlan:
    """The plan after ``removed`` nodes fail and ``joined`` nodes arrive (see module docstring).

    ``standby``: alive nodes outside ``plan`` (the previous result's ``standby``); they are
    candidates like joined nodes and may fail (be ``removed``). ``fault_tolerance``: the job's f
    to keep (default ``plan.fault_tolerance``, which after a drop is the reduced value: pass the
    job's f so that joins can restore it).
    """
    if max_sources <= 0:
        raise PlanningError(f"planner.transfer_sources={max_sources} must be > 0")
    if piece_bytes <= 0:
        raise PlanningError(f"planner.copy_piece_mb={piece_bytes / 2**20:g} must be > 0")
    if replan_horizon_steps < 0:
        raise PlanningError(f"planner.replan_horizon_steps={replan_horizon_steps} must be >= 0")
    layer_bytes = tuple(layer_param_bytes if layer_param_bytes is not None else templates.layer_param_bytes)
    if len(layer_bytes) != plan.num_layers:
        raise PlanningError(
            f"layer_param_bytes has {len(layer_bytes)} entries but the plan has {plan.num_layers} layers"
        )
    f = plan.fault_tolerance if fault_tolerance is None else fault_tolerance
    if f < 0:
        raise PlanningError(f"job.fault_tolerance={f} must be >= 0")
    gone, alive = _membership(plan, removed, joined, standby)
    live = _check_replicas(plan, gone)
    M = plan.num_microbatches
    used, kept_f = _plan_size(templates, len(alive), M, f, gone)
    sync = sync_of(templates)
    held = _held_ranges(plan, gone)

    untouched = [p.nodes for p in plan.pipelines if not gone.intersection(p.nodes)]
    intact = sorted(len(nodes) for nodes in untouched)
    regroup = None
    while regroup is None:
        regroup = _best_multiset(templates, used, M, kept_f + 1, sync, fixed=intact)
        if regroup is None:
            if not intact:
                raise PlanningError(f"no template sizes {list(templates.sizes)} cover {used} nodes (a planner bug)")
            intact.pop(0)  # give up the smallest intact pipeline
    fresh = _best_multiset(templates, used, M, kept_f + 1, sync)
    sizes = {"regroup": regroup[1]}
    if fresh is not None and fresh[1] != regroup[1]:
        sizes["fresh"] = fresh[1]
    candidates = [
        _place(
            name,
            multiset,
            plan,
            untouched,
            templates,
            alive,
            held,
            live,
            layer_bytes,
            max_sources,
            piece_bytes,
            f,
            sync,
        )
        for name, multiset in sizes.items()
    ]
    chosen = min(candidates, key=lambda c: c.cost(replan_horizon_steps))  # ties: the first (regroup)
    return ReconfigurationPlan(
        old=plan,
        new=chosen.plan,
        removed=tuple(sorted(gone)),
        joined=tuple(sorted(set(joined))),
        transfers=chosen.transfers,
        standby=chosen.standby,
        min_bytes_moved=chosen.min_bytes,
        replanned=chosen.name == "fresh",
        reason=_reason(chosen, candidates, replan_horizon_steps, f, len(alive)),
    )


def _membership(
    plan: ExecutionPlan, removed: Sequence[int], joined: Sequence[int], standby: Sequence[int]
) -> tuple[set[int], list[int]]:
    """The failed nodes and the sorted alive ones, after checking the change makes sense."""
    current, idle, gone, arrived = set(plan.nodes), set(standby), set(removed), set(joined)
    for name, values in (("removed", removed), ("joined", joined), ("standby", standby)):
        if len(set(values)) != len(values):
            raise PlanningError(f"{name} nodes {sorted(values)} contain duplicates")
    if idle & current:
        raise PlanningError(f"standby nodes {sorted(idle & current)} are in the current plan; standby means idle")
    unknown = sorted(gone - current - idle)
    if unknown:
        raise PlanningError(
            f"removed nodes {unknown} are not in the current plan (nodes {sorted(current)}) nor standby ({sorted(idle)})"
        )
    already = sorted(arrived & ((current | idle) - gone))
    if already:
        raise PlanningError(
            f"joined nodes {already} are already alive (in the current plan or standby); a node that "
            "failed and came back is both removed and joined"
        )
    return gone, sorted(((current | idle) - gone) | arrived)


def _check_replicas(plan: ExecutionPlan, removed: set[int]) -> dict[int, tuple[Worker, ...]]:
    """Every layer's surviving holders, sorted (``_copies`` picks sources in worker order);
    ``PlanningError`` if a layer has none. Layers between the same stage boundaries of every
    pipeline have the same holders, so without shadow copies each such segment is filtered and
    sorted once and its layers share the tuple."""
    holders = plan.layer_holders()
    if plan.shadows:
        live = {layer: tuple(sorted(w for w in workers if w[0] not in removed)) for layer, workers in holders.items()}
    else:
        cuts = sorted({stage.start for p in plan.pipelines for stage in p.template.stages} | {plan.num_layers})
        live = {}
        for start, end in zip(cuts, cuts[1:]):
            survivors = tuple(sorted(w for w in holders[start] if w[0] not in removed))
            live.update(dict.fromkeys(range(start, end), survivors))
    lost = sorted(layer for layer, workers in live.items() if not workers)
    if lost:
        held_by = sorted({w[0] for layer in lost for w in holders[layer]})
        raise PlanningError(
            f"layers {lost} have no live replica: every node holding them ({held_by}) failed "
            f"(removed nodes {sorted(removed)}); restart from a checkpoint"
        )
    return live


def _plan_size(templates: TemplateSet, alive: int, microbatches: int, f: int, gone: set[int]) -> tuple[int, int]:
    """(nodes to use, failures the new plan keeps tolerating): step 2 of the module docstring.

    ``counts[n]`` is a bit set of the pipeline counts whose template sizes sum to n exactly.
    """
    n0 = templates.min_nodes
    if alive < n0:
        raise PlanningError(
            f"{alive} nodes are left after losing {sorted(gone)}, fewer than n0={n0} that one pipeline needs; "
            "restart from a checkpoint with more nodes"
        )
    counts = [1] + [0] * alive
    for n in range(1, alive + 1):
        for size in templates.sizes:
            if size > n:
                break
            counts[n] |= counts[n - size] << 1
    usable = (1 << (min(microbatches, alive) + 1)) - 2  # 1 .. M pipelines (never more than nodes)
    most = max((counts[n] & usable).bit_length() - 1 for n in range(alive + 1))
    if most < 1:
        raise PlanningError(
            f"no template sizes {list(templates.sizes)} fit in {alive} alive nodes; restart from a checkpoint"
        )
    kept = min(f, most - 1)
    wanted = usable & ~((1 << (kept + 1)) - 1)  # kept + 1 .. M pipelines
    used = max(n for n in range(alive + 1) if counts[n] & wanted)
    return used, kept


def _held_ranges(plan: ExecutionPlan, gone: set[int]) -> dict[Worker, tuple[int, int]]:
    """The layer range every surviving worker of ``plan`` holds (one stage each)."""
    held = {}
    for pipeline in plan.pipelines:
        for stage_index, stage in enumerate(pipeline.template.stages):
            for worker in pipeline.stage_workers(stage_index):
                if worker[0] not in gone:
                    held[worker] = (stage.start, stage.end)
    return held


def _home_slots(
    intact: Sequence[tuple[int, ...]], multiset: Sequence[int], slots: Sequence[tuple[int, int]]
) -> dict[int, int]:
    """Node -> the slot it keeps if the new pipeline matched to its old one (same size, in order)."""
    unmatched = list(intact)
    index = {slot: c for c, slot in enumerate(slots)}
    home = {}
    for p, size in enumerate(multiset):
        match = next((nodes for nodes in unmatched if len(nodes) == size), None)
        if match is not None:
            unmatched.remove(match)
            home.update({node: index[(p, q)] for q, node in enumerate(match)})
    return home


def _place(
    name: str,
    multiset: Sequence[int],
    old: ExecutionPlan,
    intact: Sequence[tuple[int, ...]],
    templates: TemplateSet,
    alive: Sequence[int],
    held: dict[Worker, tuple[int, int]],
    live: dict[int, tuple[Worker, ...]],
    layer_bytes: Sequence[int],
    max_sources: int,
    piece_bytes: int,
    f: int,
    sync: _Sync,
) -> _Candidate:
    """Step 4: put ``multiset``'s pipelines on alive nodes with the fewest bytes to copy."""
    G = templates.gpus_per_node
    prefix = np.concatenate(([0], np.cumsum(np.asarray(layer_bytes, dtype=np.int64))))
    slots = [(p, q) for p, n in enumerate(multiset) for q in range(n)]
    # need[c, g] / have[r, g]: the layer range local rank g needs at slot c / holds on node r.
    need = np.zeros((len(slots), G, 2), dtype=np.int64)
    for c, (p, q) in enumerate(slots):
        for stage in templates[multiset[p]].stages:
            if stage.node == q:
                need[c, stage.gpu_offset : stage.gpu_offset + stage.gpus] = (stage.start, stage.end)
    have = np.zeros((len(alive), G, 2), dtype=np.int64)
    for r, node in enumerate(alive):
        for g in range(G):
            have[r, g] = held.get((node, g), (0, 0))
    needed = (prefix[need[:, :, 1]] - prefix[need[:, :, 0]]).sum(axis=1)
    lo = np.maximum(have[:, None, :, 0], need[None, :, :, 0])
    hi = np.minimum(have[:, None, :, 1], need[None, :, :, 1])
    kept = np.where(hi > lo, prefix[hi] - prefix[lo], 0).sum(axis=2)
    missing = needed[None, :] - kept  # [node, slot]: bytes the node would receive there
    # Among placements that copy equally little, keep nodes where they were: each new pipeline is
    # matched to an old intact pipeline of its size (in order) and a node at its own position there
    # costs 0, another node that holds something 1, a node that holds nothing 2.
    preference = np.where((have[:, :, 1] == have[:, :, 0]).all(axis=1), 2, 1)[:, None].repeat(len(slots), axis=1)
    home = _home_slots(intact, multiset, slots)
    row_of = {node: r for r, node in enumerate(alive)}
    for node, c in home.items():
        if node in row_of:
            preference[row_of[node], c] = 0
    weight = 2 * len(alive) + 1  # the preference sum of any assignment is below it
    if missing.size and missing.max() * weight >= _EXACT_FLOAT:
        weight, preference = 1, np.zeros_like(preference)  # bytes alone (over 2**52 / weight bytes)
    cost = missing.astype(np.float64) * weight + preference
    from scipy.optimize import linear_sum_assignment  # here, not at import: see ``preload_solver``

    rows, cols = linear_sum_assignment(cost)
    groups: list[list[int]] = [[0] * n for n in multiset]
    for r, c in zip(rows, cols):
        p, q = slots[c]
        groups[p][q] = alive[r]
    groups.sort(key=min)  # deterministic pipeline order: by the smallest node id
    placed = set(int(alive[r]) for r in rows)
    new = build_plan(templates, [len(g) for g in groups], groups, old.global_batch_size, old.microbatch_size, f, sync)
    new = dataclasses.replace(new, fault_tolerance=min(f, tolerated_failures(new)))
    copies = _copies(new, {w: range(a, b) for w, (a, b) in held.items()}, live, layer_bytes, max_sources, piece_bytes)
    seconds = chain_copy_seconds(
        (
            (layer, source[0], target[0], chunk, nbytes, hop, pieces)
            for layer, source, target, chunk, _, nbytes, hop, pieces in copies
        ),
        sync.inter,
    )
    return _Candidate(
        name=name,
        plan=new,
        copies=copies,
        min_bytes=int(missing[rows, cols].sum()),
        standby=tuple(n for n in alive if n not in placed),
        copy_s=seconds,
    )


def preload_solver() -> None:
    """Import the placement's assignment solver now (``scipy.optimize``, 0.3-0.5 s of CPU here).

    ``reconfigure`` imports it on first use, so that importing the planner stays cheap for every
    process that never reconfigures (workers, agents, the CLI); but a process that will
    reconfigure otherwise pays the import inside its first recovery: measured here, the
    controller's first ``plan_s`` was 0.70 s and its second 0.004 s in one run (analysis/README.md).
    Call this once when such a process starts (the controller).
    """
    import scipy.optimize  # noqa: F401


def _transfers(
    new: ExecutionPlan,
    held: Mapping[Worker, Container[int]],
    live_holders: dict[int, tuple[Worker, ...]],
    layer_param_bytes: Sequence[int],
    max_sources: int,
    piece_bytes: int = DEFAULT_COPY_PIECE_BYTES,
    relay: bool = True,
) -> tuple[LayerTransfer, ...]:
    """Copies of every layer a worker holds in ``new`` (stage layers and shadow copies) but not in
    ``held`` (``_copies``)."""
    return tuple(
        LayerTransfer(*row)
        for row in _copies(new, held, live_holders, layer_param_bytes, max_sources, piece_bytes, relay)
    )


def _copies(
    new: ExecutionPlan,
    held: Mapping[Worker, Container[int]],
    live_holders: dict[int, tuple[Worker, ...]],
    layer_param_bytes: Sequence[int],
    max_sources: int,
    piece_bytes: int,
    relay: bool = True,
) -> list[tuple[int, Worker, Worker, int, int, int, int, int]]:
    """The ``LayerTransfer`` fields of every copy: each layer split into chunks across up to
    ``max_sources`` live holders, least-loaded first. Each chunk goes to every worker that needs
    the layer: straight from its holder when the layer has no more such workers than chunks
    (each holder then sends its chunk at most that many times), else down one chain through them
    all (``_chain``), relayed in pieces of about ``piece_bytes`` moved bytes, so each holder sends
    each chunk once. ``relay=False``: always straight from the holders (the copies before relays,
    for comparison)."""
    needed: dict[int, list[Worker]] = {}
    for worker, layers in _held_by_worker(new):
        for layer in _missing(layers, held.get(worker, ())):
            needed.setdefault(layer, []).append(worker)
    load: dict[Worker, int] = {}  # bytes each holder sends, for those that send any
    ordered: dict[int, list[Worker]] = {}  # a holder tuple's workers sorted, by the tuple's id
    rows = []
    for layer, targets in sorted(needed.items()):
        receiving = set(targets)
        # The max_sources least-loaded holders, ties by worker: those that sent nothing yet (most
        # of them) in worker order, then the loaded ones by (load, worker) if they fall short.
        # Layers of one stage share their holder tuple (``_check_replicas``): sorted once.
        holders = live_holders[layer]
        by_worker = ordered.get(id(holders))
        if by_worker is None:
            by_worker = ordered[id(holders)] = sorted(holders)
        sources = []
        for w in by_worker:
            if w not in load and w not in receiving:
                sources.append(w)
                if len(sources) == max_sources:
                    break
        if len(sources) < max_sources:
            loaded = sorted((load[w], w) for w in by_worker if w in load and w not in receiving)
            sources += [w for _, w in loaded[: max_sources - len(sources)]]
        elements = layer_param_bytes[layer] // 4
        chunks = len(sources)
        chained = relay and len(targets) > chunks
        for chunk, source in enumerate(sources):
            count = elements // chunks + (1 if chunk < elements % chunks else 0)
            nbytes = 4 * count
            sent = nbytes * (1 if chained else len(targets))
            if sent:
                load[source] = load.get(source, 0) + sent
            if not chained:
                rows += [(layer, source, target, chunk, chunks, nbytes, 0, 1) for target in targets]
                continue
            pieces = max(1, min(count, -(-MOVED_BYTES_PER_PARAM_BYTE * nbytes // piece_bytes)))
            if chunk == 0:
                by_node: dict[int, list[Worker]] = {}
                for worker in sorted(targets):
                    by_node.setdefault(worker[0], []).append(worker)
            order = _chain(source, by_node, chunk, chunks)
            for hop, (sender, target) in enumerate(zip((source, *order), order)):
                rows.append((layer, sender, target, chunk, chunks, nbytes, hop, pieces))
    return rows


def _missing(layers: Iterable[int], have: Container[int]) -> Iterable[int]:
    """The layers of ``layers`` not in ``have``, in order; for two layer ranges (a stage and what
    the worker held) by their bounds instead of a test per layer."""
    if isinstance(layers, range) and isinstance(have, range) and layers.step == 1 and have.step == 1:
        lo, hi = max(layers.start, have.start), min(layers.stop, have.stop)
        if lo >= hi:
            return layers
        return itertools.chain(range(layers.start, lo), range(hi, layers.stop))
    return [layer for layer in layers if layer not in have]


def _held_by_worker(plan: ExecutionPlan) -> Iterable[tuple[Worker, Iterable[int]]]:
    """(worker, layers it holds) for every worker of ``plan``, in assignment order (straight from
    the stages when the plan has no shadow copies: no assignment objects to build)."""
    if plan.shadows:
        return ((a.worker, a.held_layers) for a in plan.assignments())
    return (
        ((pipeline.nodes[stage.node], stage.gpu_offset + g), range(stage.start, stage.end))
        for pipeline in plan.pipelines
        for stage in pipeline.template.stages
        for g in range(stage.gpus)
    )


def _chain(source: Worker, by_node: Mapping[int, list[Worker]], chunk: int, chunks: int) -> list[Worker]:
    """The order a chunk travels through the workers that need it (``by_node``: by node, sorted):
    the source's own node first (in-node copies), then node by node, each node's workers together,
    so the chunk crosses into every other node once; the node order is rotated by chunk, so chunks
    of one layer start their chains on different nodes (no node is first for all of them)."""
    nodes = [node for node in sorted(by_node) if node != source[0]]
    shift = chunk * len(nodes) // chunks if nodes else 0
    nodes = nodes[shift:] + nodes[:shift]
    return list(by_node.get(source[0], ())) + [worker for node in nodes for worker in by_node[node]]


def _reason(chosen: _Candidate, candidates: Sequence[_Candidate], horizon: int, f: int, alive: int) -> str:
    """One sentence with the cost-model figures behind the decision (for events and logs)."""
    by_name = {c.name: c for c in candidates}
    regroup, fresh = by_name["regroup"], by_name.get("fresh")
    if fresh is None:
        text = "regrouped: the pipelines that lost no node stay as they are, and a fresh plan would choose the same template sizes"
    else:
        other = fresh if chosen is regroup else regroup
        saved = horizon * (other.plan.predicted_iteration_s - chosen.plan.predicted_iteration_s)
        extra = chosen.copy_s - other.copy_s
        verb, versus = ("regrouped", "a fresh plan") if chosen is regroup else ("re-planned from scratch", "regrouping")
        text = (
            f"{verb}: {chosen.plan.predicted_iteration_s:.4g} s per iteration and {chosen.copy_s:.3g} s of copying "
            f"({chosen.min_bytes / 1e9:.3g} GB of parameters) against {other.plan.predicted_iteration_s:.4g} s and "
            f"{other.copy_s:.3g} s ({other.min_bytes / 1e9:.3g} GB) for {versus}: over "
            f"planner.replan_horizon_steps={horizon} steps it saves {saved - extra:.4g} s"
        )
    if chosen.plan.fault_tolerance < f:
        text += f"; it tolerates {chosen.plan.fault_tolerance} failures, fewer than job.fault_tolerance={f}"
    if chosen.standby:
        text += (
            f"; nodes {list(chosen.standby)} stay standby: with {chosen.plan.fault_tolerance + 1} to "
            f"{chosen.plan.num_microbatches} pipelines the template sizes cover {len(chosen.plan.nodes)} of the "
            f"{alive} alive nodes, not all"
        )
    return text


def check_fault_tolerance(templates: TemplateSet, nodes: int, fault_tolerance: int) -> None:
    """Raise PlanningError unless every survivor count after up to f failures can be covered.

    Covered: the survivors split exactly into pipelines of template sizes (no idle node). With
    at least f+1 pipelines initially, each holding every layer, f failures leave a replica of
    every layer; with fewer nodes than (f+1) n0 there cannot be f+1 pipelines.
    """
    f = fault_tolerance
    n0 = templates.min_nodes
    if nodes < (f + 1) * n0:
        raise PlanningError(
            f"f={f} needs {f + 1} pipelines of at least n0={n0} nodes = {(f + 1) * n0} nodes; cluster.nodes={nodes}"
        )
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
    piece_bytes: int = DEFAULT_COPY_PIECE_BYTES,
    relay: bool = True,
) -> tuple[LayerTransfer, ...]:
    """The layer copies that take ``old`` to ``new`` after ``removed`` nodes failed, for any pair of
    plans (a strategy that builds its own plans, e.g. with shadow copies, uses this); raises
    ``PlanningError`` when a layer the new plan needs has no live holder. ``relay``: see
    ``_transfers``."""
    live = _check_replicas(old, set(removed))
    held: dict[Worker, set[int]] = {}
    for assignment in old.assignments():
        if assignment.worker[0] not in removed:
            held.setdefault(assignment.worker, set()).update(assignment.held_layers)
    return _transfers(new, held, live, layer_param_bytes, max_sources, piece_bytes, relay)

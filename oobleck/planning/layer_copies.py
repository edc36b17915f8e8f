"""Layer copies: what the survivors hold, and how the layers a new plan needs reach the workers that lack them.

Step 6 of ``reconfigure``'s module docstring, and ``plan_transfers`` for any pair of plans. Every
layer keeps its surviving holders (``_check_replicas``; ``PlanningError`` when one has none).
Every (worker, layer) the new plan needs and the worker does not hold gets the layer from up to
``max_sources`` of them, as equal chunks, least-loaded sources first so no single source sends it
all; where more workers need a layer than it has chunks, each chunk is relayed down one chain
through them (``_chain``), in pieces, so each holder sends each chunk once (``_copies``).
"""

from __future__ import annotations

import itertools
from collections.abc import Container, Iterable, Mapping, Sequence

from oobleck.errors import PlanningError
from oobleck.planning.outputs import ExecutionPlan, LayerTransfer, Worker
from oobleck.planning.pipeline_cost import MOVED_BYTES_PER_PARAM_BYTE

# Default number of distinct surviving holders one layer copy is split across.
DEFAULT_MAX_SOURCES = 4
# Default size of the pieces a relayed chunk streams in (moved bytes; planner.copy_piece_mb).
DEFAULT_COPY_PIECE_BYTES = 4 * 2**20


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


def _held_ranges(plan: ExecutionPlan, gone: set[int]) -> dict[Worker, tuple[int, int]]:
    """The layer range every surviving worker of ``plan`` holds (one stage each)."""
    held = {}
    for pipeline in plan.pipelines:
        for stage_index, stage in enumerate(pipeline.template.stages):
            for worker in pipeline.stage_workers(stage_index):
                if worker[0] not in gone:
                    held[worker] = (stage.start, stage.end)
    return held


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

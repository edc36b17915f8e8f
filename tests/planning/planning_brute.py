"""Brute-force references for the planner's exactness tests (small inputs only)."""

from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import strategies as st

from oobleck.planning.outputs import StageSpec
from oobleck.planning.pipeline_cost import pipeline_iteration_time, pipeline_time
from oobleck.planning.templates import stage_memories_of, stage_seconds_of

# The small planning problems the brute-force tests draw (hypothesis strategies, keyword
# arguments of ``given``): layer count, GPUs per node, nodes, the synthetic profile's seed, device
# memory (from unlimited to forcing several stages), a layer's output bytes and a stage's most GPUs.
SMALL_PROBLEMS = {
    "layers": st.integers(min_value=1, max_value=6),
    "gpus": st.integers(min_value=1, max_value=3),
    "nodes": st.integers(min_value=1, max_value=3),
    "seed": st.integers(min_value=0, max_value=10_000),
    "memory": st.sampled_from([1e13, 0.5e9, 1e9, 1.6e9]),
    "output_bytes": st.sampled_from([0, 4_000_000, 400_000_000]),
    "max_gpus": st.sampled_from([None, 1, 2]),
}


def compositions(total: int, max_part: int):
    """Ordered ways to write ``total`` as positive parts <= max_part."""
    if total == 0:
        yield ()
        return
    for first in range(1, min(total, max_part) + 1):
        for rest in compositions(total - first, max_part):
            yield (first,) + rest


def all_layouts(num_layers: int, nodes: int, gpus: int, max_gpus: int):
    """Every template layout: per node a GPU composition, then every split of the layers."""
    node_shapes = list(compositions(gpus, max_gpus))
    for shapes in itertools.product(node_shapes, repeat=nodes):
        widths = [(node, g) for node, shape in enumerate(shapes) for g in shape]
        S = len(widths)
        if S > num_layers:
            continue
        for cuts in itertools.combinations(range(1, num_layers), S - 1):
            bounds = (0,) + cuts + (num_layers,)
            stages, offsets = [], {}
            for i, (node, g) in enumerate(widths):
                off = offsets.get(node, 0)
                stages.append(StageSpec(start=bounds[i], end=bounds[i + 1], node=node, gpu_offset=off, gpus=g))
                offsets[node] = off + g
            yield stages


def brute_force_template(profile, cluster, nodes, r, max_gpus=None):
    best = math.inf
    for stages in all_layouts(profile.num_layers, nodes, cluster.gpus_per_node, max_gpus or cluster.gpus_per_node):
        if any(m > cluster.device_memory_bytes for m in stage_memories_of(profile, stages)):
            continue
        seconds = stage_seconds_of(profile, cluster, stages)
        best = min(best, pipeline_iteration_time(seconds, r * len(stages)))
    return best


def brute_force_distribution(stage_seconds_list, total):
    best, best_split = math.inf, None
    P = len(stage_seconds_list)
    for split in itertools.product(range(1, total + 1), repeat=P):
        if sum(split) != total:
            continue
        value = max(pipeline_time(w, m) for w, m in zip(stage_seconds_list, split))
        if value < best:
            best, best_split = value, split
    return best, best_split


def multisets(sizes, total, min_parts):
    """Every multiset (non-increasing tuple) of ``sizes`` summing to ``total`` with >= min_parts parts."""

    def rec(remaining, largest):
        if remaining == 0:
            yield ()
            return
        for s in sorted(sizes, reverse=True):
            if s <= largest and s <= remaining:
                for rest in rec(remaining - s, s):
                    yield (s,) + rest

    return [m for m in rec(total, max(sizes)) if len(m) >= min_parts]


def greedy_split(curves, total):
    """The textbook exact min-max split of nondecreasing functions: start every pipeline at one
    microbatch and give each further one to the pipeline that would finish it soonest.
    ``curves`` are functions m -> time; independent of the planner's own search."""
    split = [1] * len(curves)
    for _ in range(total - len(curves)):
        p = min(range(len(curves)), key=lambda q: (curves[q](split[q] + 1), q))
        split[p] += 1
    return max(c(m) for c, m in zip(curves, split)), split


def _ring(nbytes, participants, bandwidth):
    return 0.0 if participants <= 1 or nbytes <= 0 else 2.0 * (participants - 1) / participants * nbytes / bandwidth


def plan_value(templates, combo, microbatches):
    """Predicted iteration time of the best split over pipelines of template sizes ``combo``,
    from the cost model's definition (module docstring of oobleck.planning.instantiate)."""
    layer_bytes = templates.layer_param_bytes or (0,) * templates.num_layers
    curves, node_bytes = [], []
    for n in combo:
        template = templates[n]
        intra = max(
            _ring(sum(layer_bytes[s.start : s.end]), s.gpus, templates.intra_node_bandwidth) for s in template.stages
        )
        per_node = [0] * template.num_nodes
        for s in template.stages:
            per_node[s.node] += sum(layer_bytes[s.start : s.end])
        node_bytes.append(max(per_node))
        curves.append(lambda m, w=template.stage_seconds, intra=intra: pipeline_time(w, m) + intra)
    compute, _ = greedy_split(curves, microbatches)
    return compute + _ring(max(node_bytes), len(combo), templates.inter_node_bandwidth)


def brute_force_instantiation(templates, nodes, global_batch, microbatch, f):
    """The best predicted iteration time over every multiset of template sizes (inf if none)."""
    best = math.inf
    M = global_batch // microbatch
    for combo in multisets(templates.sizes, len(nodes), f + 1):
        if len(combo) <= M:
            best = min(best, plan_value(templates, combo, M))
    return best


def brute_force_min_bytes(old, removed, alive, templates, sizes, layer_bytes):
    """The least parameter bytes any placement of pipelines of ``sizes`` on ``alive`` nodes copies
    (every assignment of nodes to pipeline positions tried; local rank g keeps device g)."""
    held = {}
    for a in old.assignments():
        if a.worker[0] not in removed:
            held[a.worker] = set(a.layers)
    slots = [(n, q) for n in sizes for q in range(n)]
    best = math.inf
    for nodes in itertools.permutations(alive, len(slots)):
        total = 0
        for node, (n, q) in zip(nodes, slots):
            for stage in templates[n].stages:
                if stage.node == q:
                    for g in range(stage.gpu_offset, stage.gpu_offset + stage.gpus):
                        have = held.get((node, g), set())
                        total += sum(layer_bytes[layer] for layer in stage.layers if layer not in have)
        best = min(best, total)
    return best


def coverable(templates, alive, microbatches, f):
    """(nodes a new plan uses, failures it keeps tolerating) by enumeration: the most pipelines
    up to f + 1, then the most nodes template sizes cover with that many pipelines (<= M)."""
    counts = {
        n: {len(m) for m in multisets(templates.sizes, n, 1) if len(m) <= microbatches} for n in range(1, alive + 1)
    }
    kept = min(f, max(max(c, default=0) for c in counts.values()) - 1)
    used = max(n for n, c in counts.items() if any(k >= kept + 1 for k in c))
    return used, kept


def sweeping_1f1b_makespan(stage_seconds, microbatches: int, forward_fraction: float) -> float:
    """The 1F1B makespan by sweeping every stage until none can progress (the planner's earlier
    implementation; ``exact_1f1b_makespan`` must agree with it to the last bit)."""
    stages = len(stage_seconds)
    m = microbatches
    if m <= 0:
        return 0.0
    fwd = [w * forward_fraction for w in stage_seconds]
    bwd = [w - f for w, f in zip(stage_seconds, fwd)]
    orders = []
    for i in range(stages):
        warmup = min(stages - i - 1, m)
        order = [("F", j) for j in range(warmup)]
        next_f = warmup
        for j in range(m):
            if next_f < m:
                order.append(("F", next_f))
                next_f += 1
            order.append(("B", j))
        orders.append(order)
    f_end = [[-1.0] * m for _ in range(stages)]
    b_end = [[-1.0] * m for _ in range(stages)]
    position = [0] * stages
    clock = [0.0] * stages
    remaining = 2 * m * stages
    while remaining:
        progressed = False
        for i in range(stages):
            order = orders[i]
            while position[i] < len(order):
                kind, j = order[position[i]]
                if kind == "F":
                    ready = 0.0 if i == 0 else f_end[i - 1][j]
                    if ready < 0:
                        break
                    end = max(clock[i], ready) + fwd[i]
                    f_end[i][j] = end
                else:
                    ready = f_end[i][j] if i == stages - 1 else b_end[i + 1][j]
                    if ready < 0:
                        break
                    end = max(clock[i], ready) + bwd[i]
                    b_end[i][j] = end
                clock[i] = end
                position[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for a well-formed 1F1B order; guard against a silent loop
            raise RuntimeError("1F1B schedule deadlocked")
    return max(clock)


def straightforward_copies(new, held, live_holders, layer_param_bytes, max_sources: int, piece_bytes: int):
    """``layer_copies._copies`` as first written (a membership test per layer, a full sort of the
    holders per layer): the faster one must return the same rows."""
    from oobleck.planning.layer_copies import _chain, _held_by_worker
    from oobleck.planning.pipeline_cost import MOVED_BYTES_PER_PARAM_BYTE

    needed: dict = {}
    for worker, layers in _held_by_worker(new):
        have = held.get(worker, ())
        for layer in layers:
            if layer not in have:
                needed.setdefault(layer, []).append(worker)
    load: dict = {}
    rows = []
    for layer, targets in sorted(needed.items()):
        receiving = set(targets)
        sources = sorted((w for w in live_holders[layer] if w not in receiving), key=lambda w: (load.get(w, 0), w))
        sources = sources[:max_sources]
        elements = layer_param_bytes[layer] // 4
        chunks = len(sources)
        chained = len(targets) > chunks
        for chunk, source in enumerate(sources):
            count = elements // chunks + (1 if chunk < elements % chunks else 0)
            nbytes = 4 * count
            load[source] = load.get(source, 0) + nbytes * (1 if chained else len(targets))
            if not chained:
                rows += [(layer, source, target, chunk, chunks, nbytes, 0, 1) for target in targets]
                continue
            pieces = max(1, min(count, -(-MOVED_BYTES_PER_PARAM_BYTE * nbytes // piece_bytes)))
            if chunk == 0:
                by_node: dict = {}
                for worker in sorted(targets):
                    by_node.setdefault(worker[0], []).append(worker)
            order = _chain(source, by_node, chunk, chunks)
            for hop, (sender, target) in enumerate(zip((source, *order), order)):
                rows.append((layer, sender, target, chunk, chunks, nbytes, hop, pieces))
    return rows


def all_rows_root_bounds(costs, max_nodes: int):
    """``node_bounds.root_bounds`` as first written, every row of every step computed (the
    faster one skips rows that are INF or never read again and must agree to the last bit)."""
    bound = np.full(max_nodes + 1, math.inf)
    if max_nodes < 1:
        return bound
    L = costs.geometry.num_layers
    after = costs.after  # [x, d] -> x + d + 1, or L + 1 (an INF slot) past the end
    _, last_right, last_marker = costs.last_vectors()
    right = np.full(L + 2, math.inf)  # [x]: covering [x, L) right of the marker (slot L + 1: nothing)
    full = np.full(L + 2, math.inf)  # [x]: the same, holding the marker
    fewest = np.full(L + 2, math.inf)  # [x]: the fewest stages covering [x, L) with the same nodes
    right[: L + 1], full[: L + 1], fewest[: L + 1] = last_right, last_marker, costs.last_stage_counts()
    bound[1] = full[0]
    for u in range(2, max_nodes + 1):
        in_flight = np.where(np.isfinite(fewest), fewest + 1, L + 2).astype(np.int64)
        if np.all(in_flight[np.isfinite(fewest)] <= u):  # (every cover has one stage per node)
            left_b, right_b, marker_b = costs.bands(u)
        else:
            left_b, right_b, marker_b = entrywise_bands(costs, np.maximum(in_flight, u))
        next_right, next_full = right[after], full[after]
        right[: L + 1] = (right_b + next_right).min(axis=1)
        full[: L + 1] = np.minimum((marker_b + next_right).min(axis=1), (left_b + next_full).min(axis=1))
        fewest[: L + 1] = (entrywise_stage_counts(costs, np.maximum(in_flight, u)) + fewest[after]).min(axis=1)
        bound[u] = full[0]
    return bound * (1 - 1e-9)


def entrywise_bands(costs, in_flight, rows=slice(None)):
    """``NodeCosts.chain_steps``' bands as first written: every entry's split-node bounds
    computed with its own most compute per stage (the faster one takes them from the whole band
    at each of the few distinct values and must agree to the last bit)."""
    band_in_flight = in_flight[np.minimum(costs.after[rows], len(in_flight) - 1)]
    fits = costs.cap_band[rows] >= band_in_flight
    split = costs._split_sides(tuple(part[rows] for part in costs._split_band), costs._most_of(band_in_flight))
    return [np.minimum(np.where(fits, w[rows], math.inf), s) for w, s in zip(costs.whole_band, split)]


def entrywise_stage_counts(costs, in_flight, rows=slice(None)):
    """``NodeCosts.chain_steps``' stage counts as first written (see ``entrywise_bands``)."""
    band_in_flight = in_flight[np.minimum(costs.after[rows], len(in_flight) - 1)]
    whole = costs._whole_usable[rows] & (costs.cap_band[rows] >= band_in_flight)
    exists = costs._split_band[0][rows]
    most = costs._most_of(band_in_flight)
    split = np.where(
        exists & (most > 0),
        np.maximum(
            max(2, costs.geometry.stages_per_node),
            np.ceil(costs._split_band[1][rows] / np.maximum(most, 1e-9) - 1e-9),
        ),
        math.inf,
    )
    return np.where(whole, 1.0, split)


def all_columns_prefix_tables(costs, max_nodes: int, in_flight: int):
    """``PrefixBounds._arrays`` as first written, every prefix end of every node count computed
    (the faster one only computes the ends u nodes can reach and must agree to the last bit)."""
    L = costs.geometry.num_layers
    before = costs.before
    left_b, right_b, marker_b = costs.by_end(in_flight)
    left = np.full((max_nodes + 1, L + 2), math.inf)
    marked = np.full((max_nodes + 1, L + 2), math.inf)
    left[0, 0] = 0.0
    for u in range(1, max_nodes + 1):
        previous_left = left[u - 1][before]
        left[u, : L + 1] = (previous_left + left_b).min(axis=1)
        marked[u, : L + 1] = np.minimum(
            (previous_left + marker_b).min(axis=1), (marked[u - 1][before] + right_b).min(axis=1)
        )
    scale = 1 - 1e-9
    return left[:, : L + 1] * scale, marked[:, : L + 1] * scale


def windowed_partial(prefix, in_flight: int, free_gpus: int):
    """``PrefixBounds.partial`` by a plain minimum over every window (the faster one shares one
    sparse table between its three minima and must agree to the last bit)."""
    costs = prefix.costs
    geometry, W, r = costs.geometry, costs.W, costs.r
    y, compute = geometry.cheapest_intra, geometry.compute
    in_flight = 1 << (max(in_flight, 1).bit_length() - 1)
    left, marked = prefix._arrays(in_flight)
    room = (W - y) * free_gpus * (1 + 1e-9)
    first = np.searchsorted(compute, compute - room, side="left")
    share = compute / free_gpus

    def window_min(values):
        out = np.full(values.shape, math.inf)
        for s in range(values.shape[1]):
            if first[s] <= s - 1:
                out[:, s] = values[:, first[s] : s].min(axis=1)
        return out

    left_part = window_min(left - share[None, :]) + share[None, :] + y + r * W
    right_part = window_min(marked - 2 * share[None, :]) + 2 * (share[None, :] + y)
    right_part = right_part + (r - 1) * W
    holding = window_min(left) + r * W
    scale = 1 - 1e-9
    return (left_part * scale).tolist(), (np.minimum(right_part, holding) * scale).tolist()

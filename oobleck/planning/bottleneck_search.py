"""The least slowest stage: the seed layouts, their descent, and the bottleneck DP.

Layouts here are lists of (start, end, gpus) from right to left, as the DPs return them; node
changes follow from the GPU counts (``_to_stages``). ``_one_stage_per_node`` gives, for every node
count, the layout of one full-node stage per node with the least slowest stage (a cheap min-max
partition): the seed whose T is the template search's first budget. ``_bottleneck_dp`` gives the
least slowest stage over every layout (n0, and the stage counts a threshold forces, with a stage
cap).

The template search first improves that seed's T by a short descent over its boundaries
(``_descend``): the min-max layout is often a few tenths of a percent above the optimum in T, and
only a budget within about 0.1% of it rules out most thresholds before any search (on the
realistic profile that halves the time). Equal layers make plateaus of equal T (two stages of a
run swap their lengths and T stays) on which that descent stalls; there
``_least_t_one_stage_per_node`` gives the one-stage-per-node layout with the least T at the seed's
slowest stage, for every node count sharing it at once. ``_refine`` improves any layout, several
stages per node included, by shifting a boundary and moving GPUs between two stages of a node:
it refines the first layout found for node counts where memory rules the seed out.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import numpy as np

from oobleck.planning.outputs import StageSpec
from oobleck.planning.pipeline_cost import LINK_INTER, LINK_INTRA, LINK_NONE, pipeline_iteration_time
from oobleck.planning.stage_table import STAGE_COUNT_NODES, _StageTable

INF = math.inf
# The seeds (one stage per node, least slowest stage) are improved by moving the boundaries of at
# most this many consecutive stages one layer at a time (``_descend``): the searches look only
# for layouts strictly better than their budget, so a budget near the optimum skips most of them
# (realistic 64 x 8: a budget within 0.1% of the optimum halves the time; block moves longer than
# one boundary gain little more on the profiles measured and cost more).
DESCENT_BLOCK = 1
# ``_refine``: a step shifts one boundary by at most this many layers (with one GPU moved between
# the two stages where they share a node), for at most this many steps.
REFINE_SHIFT = 4
REFINE_STEPS = 200


def _stage_links(stages: Sequence[StageSpec]) -> list[int]:
    links = []
    for i, stage in enumerate(stages):
        if i == len(stages) - 1:
            links.append(LINK_NONE)
        elif stages[i + 1].node == stage.node:
            links.append(LINK_INTRA)
        else:
            links.append(LINK_INTER)
    return links


def _one_stage_per_node(table: _StageTable, gpus: int, max_nodes: int) -> dict[int, list[tuple[int, int, int]]]:
    """For every n, the layout with one stage of all G GPUs per node that minimises the slowest
    stage (memory-feasible), right to left as the DPs return them. A quick upper bound that
    seeds both searches' budgets; the searches then only look for strictly better layouts."""
    L, G = table.num_layers, gpus
    cost = np.full((L + 1, L + 1, 2), INF)  # [start, end, last?]
    for end in range(1, L + 1):
        cost[:end, end, 0] = table.cost[G][LINK_INTER][end]
        cost[:end, end, 1] = table.cost[G][LINK_NONE][end]
    cap = table.cap_matrix(G)
    # best[k][a]: min slowest stage of [a, L) split into k one-node stages; choice[k][a]: end.
    best = np.full(L + 1, INF)
    best[L] = 0.0
    layouts: dict[int, list[tuple[int, int, int]]] = {}
    choices = []
    for k in range(1, min(max_nodes, L) + 1):
        link = 1 if k == 1 else 0
        # Stage [a, b) is the k-th from the end: k microbatches in flight.
        stage = np.where(cap >= k, cost[:, :, link], INF)
        candidate = np.maximum(stage, best[None, :])
        candidate[np.tril_indices(L + 1)] = INF  # b > a only
        choice = np.argmin(candidate, axis=1)
        best = candidate[np.arange(L + 1), choice]
        choices.append(choice)
        if best[0] < INF:
            a, stages = 0, []
            for level in range(k - 1, -1, -1):
                b = int(choices[level][a])
                stages.append((a, b, G))
                a = b
            layouts[k] = list(reversed(stages))
    return layouts


def _seed_layouts(table: _StageTable, gpus: int, max_nodes: int) -> dict[int, list[tuple[int, int, int]]]:
    """``_one_stage_per_node`` for at least every node count up to ``max_nodes``, kept on the table
    (the layout of n nodes does not depend on how many counts one asks for). A count past those
    kept doubles them, so asking for every count in turn, as n0's search does where nothing fits
    until many nodes, costs about as much as asking once for the last."""
    kept = table.seed_layouts
    if kept is None or kept[0] < max_nodes:
        covered = max(max_nodes, 2 * kept[0]) if kept is not None else max_nodes
        kept = table.seed_layouts = (covered, _one_stage_per_node(table, gpus, covered))
    return kept[1]


def _descend(
    table: _StageTable, gpus: int, r: int, layout: list[tuple[int, int, int]]
) -> tuple[float, list[tuple[int, int, int]]]:
    """A one-stage-per-node layout (right to left, as the DPs return them) improved by steepest
    descent on its T (Eq. 1-4 at m = r S): each step shifts the boundaries of up to
    ``DESCENT_BLOCK`` consecutive stages by one layer, keeping every stage within memory, and
    takes the move that lowers T most, until none does. Returns (T, layout). A heuristic: it
    only makes the searches' starting budgets tighter, never decides a template."""
    G, n = gpus, len(layout)
    bounds = np.array([0] + [end for _, end, _ in reversed(layout)])
    value = pipeline_iteration_time(_layout_seconds(table, layout, G), r * n)
    if n < 2:
        return value, layout
    cost = table.cost_stack[G]
    cap = table.cap_matrix(G)
    links = np.full(n, LINK_INTER)
    links[-1] = LINK_NONE
    in_flight = n - np.arange(n)  # stage i of S keeps S - i microbatches in flight
    first, last = np.triu_indices(n - 1)  # shift the boundaries first + 1 .. last + 1
    shift = last - first < DESCENT_BLOCK
    positions = np.arange(n + 1)[None, :]
    block = ((positions > first[shift, None]) & (positions <= last[shift, None] + 1)).astype(np.int64)
    moves = np.concatenate([block, -block])
    while True:
        candidates = bounds[None, :] + moves
        starts, ends = candidates[:, :-1], candidates[:, 1:]
        valid = (ends > starts).all(axis=1)
        candidates, starts, ends = candidates[valid], starts[valid], ends[valid]
        valid = (cap[starts, ends] >= in_flight[None, :]).all(axis=1)
        candidates, starts, ends = candidates[valid], starts[valid], ends[valid]
        if not len(candidates):
            break
        seconds = cost[links[None, :], starts, ends]
        choice = candidates[int(np.argmin(_additive_times(seconds, r)))]
        moved = [(int(choice[i]), int(choice[i + 1]), G) for i in range(n - 1, -1, -1)]
        moved_value = pipeline_iteration_time(_layout_seconds(table, moved, G), r * n)
        if not moved_value < value:
            break
        bounds, layout, value = choice, moved, moved_value
    return value, layout


def _refine(
    table: _StageTable, gpus: int, r: int, layout: list[tuple[int, int, int]], most_steps: int = REFINE_STEPS
) -> tuple[float, list[tuple[int, int, int]]]:
    """Any layout (right to left) improved by steepest descent on its T: each step shifts one
    boundary by up to ``REFINE_SHIFT`` layers, where the two stages share a node moving one GPU
    between them too, keeping every stage within memory at its in-flight count and every node's
    GPUs as they were; it takes the move that lowers T most, until none does (or after
    ``most_steps``). Returns (T, layout). A heuristic for the budgets of node counts where memory
    puts several stages on a node (the search's first layout there can be several percent above
    the optimum, and every search after it then looks that much wider); it never decides a
    template."""
    G, S = gpus, len(layout)
    value = pipeline_iteration_time(_layout_seconds(table, layout, G), r * S)
    if S < 2:
        return value, layout
    stages = _to_stages(layout, G)
    bounds = np.array([0] + [stage.end for stage in stages])
    widths = np.array([stage.gpus for stage in stages])
    links = np.array(_stage_links(stages))
    shared = np.array([stages[i].node == stages[i + 1].node for i in range(S - 1)])
    cost = table.cost_stack
    cap = table.cap_stack()
    in_flight = S - np.arange(S)  # stage i of S keeps S - i microbatches in flight
    # Moves: boundary i + 1 (between stages i and i + 1) by `shift`, and `moved` GPUs from stage
    # i + 1 to stage i where they share a node.
    shifts = np.arange(-REFINE_SHIFT, REFINE_SHIFT + 1)
    pair, shift, moved = (a.ravel() for a in np.meshgrid(np.arange(S - 1), shifts, (-1, 0, 1), indexing="ij"))
    keep = ((shift != 0) | (moved != 0)) & ((moved == 0) | shared[pair])
    pair, shift, moved = pair[keep], shift[keep], moved[keep]
    rows = np.arange(len(pair))
    for _ in range(most_steps):
        new_bounds = np.repeat(bounds[None, :], len(pair), axis=0)
        new_bounds[rows, pair + 1] += shift
        new_widths = np.repeat(widths[None, :], len(pair), axis=0)
        new_widths[rows, pair] += moved
        new_widths[rows, pair + 1] -= moved
        starts, ends = new_bounds[:, :-1], new_bounds[:, 1:]
        valid = (ends > starts).all(axis=1) & (new_widths >= 1).all(axis=1)
        valid &= (new_widths <= table.stage_gpu_limit).all(axis=1)
        starts, ends, new_widths = starts[valid], ends[valid], new_widths[valid]
        fits = (cap[new_widths, starts, ends] >= in_flight[None, :]).all(axis=1)
        starts, ends, new_widths = starts[fits], ends[fits], new_widths[fits]
        if not len(starts):
            break
        totals = _additive_times(cost[new_widths, links[None, :], starts, ends], r)
        choice = int(np.argmin(totals))
        moved_layout = [
            (int(starts[choice, i]), int(ends[choice, i]), int(new_widths[choice, i])) for i in range(S - 1, -1, -1)
        ]
        moved_value = pipeline_iteration_time(_layout_seconds(table, moved_layout, G), r * S)
        if not moved_value < value:
            break
        bounds = np.concatenate(([0], ends[choice]))
        widths, layout, value = new_widths[choice], moved_layout, moved_value
    return value, layout


def _additive_times(seconds: np.ndarray, r: int) -> np.ndarray:
    """T of every row of stage times (left to right), by the additive form of Eq. 1-4 at m = r S
    (module docstring of ``templates``), k the rightmost slowest stage."""
    S = seconds.shape[1]
    slowest = seconds.max(axis=1)
    k = S - 1 - np.argmax((seconds == slowest[:, None])[:, ::-1], axis=1)
    index = np.arange(S)[None, :]
    left = np.where(index < k[:, None], seconds, 0.0).sum(axis=1)
    right = np.where(index > k[:, None], seconds, 0.0).sum(axis=1)
    return left + 2 * right + ((k + 1) * r + (S - 1 - k) * (r - 1)) * slowest


def _bottleneck_dp(
    table: _StageTable,
    gpus: int,
    max_nodes: int,
    only: int | None = None,
    stage_cap: int | None = None,
    below: float = INF,
    in_flight: bool = True,
) -> dict[int, float]:
    """Smallest achievable slowest-stage time for every node count up to ``max_nodes`` (INF where
    nothing fits), or for ``only`` that count; with ``stage_cap``, over layouts of at most that
    many stages. Only values under ``below`` are searched for: ``below`` itself means "at least
    ``below``".

    Branch and bound like the main DP: a sub-search only looks for values below its budget and
    is memoised as a lower bound otherwise. The slowest stage of [0, a) is at least its compute
    spread over the GPUs still free (a stage of g GPUs needs w >= compute / g), and a state whose
    rest memory cannot cover on the GPUs still free is ruled out (``in_flight=False``: only the
    stage cap uses that count, on any GPUs, as the search before it did).
    """
    G = gpus
    compute = table.compute_prefix
    cost, cap = table.cost, table.cap
    # A stage cap needs the exact count of stages placed in the memo key, not its compression.
    exact_count = list(range(table.num_layers + 2)) if stage_cap is not None else None
    most_stages = stage_cap if stage_cap is not None else table.num_layers + 1
    # One memo per in-flight compression: a search below budget B only places stages with
    # w < B, so only their memory limits bind (``compressions_within``).
    memos: dict[tuple[int, ...], dict[tuple[int, int, int, int], tuple[float, bool]]] = {}
    memo: dict[tuple[int, int, int, int], tuple[float, bool]] = {}
    compress: list[int] = []
    bisect_left = bisect.bisect_left
    # The fewest stages covering [0, a) when the first of them (from the right) keeps j + 1
    # microbatches in flight, by memory, on the GPUs left (``by_gpus[j][u][a]``, where at most
    # ``few_gpus`` are) or on any (``by_memory[j][a]``): INF rules a state out, and so does a
    # stage cap it would exceed.
    few_gpus = STAGE_COUNT_NODES * G if in_flight else -1  # (-1: every state counts by memory)
    by_gpus = table.gpu_stage_counts(few_gpus) if in_flight else []
    by_memory = table.memory_stage_counts()[2]

    def best(a: int, j: int, nl: int, h: int, budget: float) -> float:
        if a == 0:
            return 0.0 if nl == 0 and h == G else INF
        if nl + (1 if h < G else 0) > a or j + nl + (1 if h < G else 0) > most_stages:
            return INF
        free = nl * G + G - h  # GPUs for [0, a): the nodes still to open and the current one's rest
        needed = by_gpus[j][free][a] if free <= few_gpus else by_memory[j][a]
        if (needed == INF and in_flight) or (stage_cap is not None and j + needed > stage_cap):
            return INF
        key = (a, compress[j], nl, h)
        hit = memo.get(key)
        if hit is not None and (hit[1] or hit[0] >= budget):
            return hit[0]
        result = INF
        same_node = j > 0 and h < G
        for g in range(G, 0, -1):
            if same_node:
                if h + g > G:
                    continue
                link, nl2, h2 = LINK_INTRA, nl, h + g
            elif nl > 0:
                link, nl2, h2 = (LINK_NONE if j == 0 else LINK_INTER), nl - 1, g
            else:
                break
            lo = bisect_left(cap[g][a], j + 1)
            costs = cost[g][link][a]
            free = (nl2 + 1) * G - h2  # GPUs left for [0, start)
            for start in range(a - 1, lo - 1, -1):
                w = costs[start]
                limit = result if result < budget else budget
                if w >= limit:
                    break  # costs only grow as the stage takes more layers
                if start and compute[start] >= limit * free:
                    continue  # the rest cannot get below the limit
                rest = best(start, j + 1, nl2, h2, limit)
                value = w if w > rest else rest
                if value < result:
                    result = value
        exact = result < budget
        memo[key] = (result if exact else budget, exact)
        return result if exact else budget

    seeds = _seed_layouts(table, G, max_nodes)
    result = {}
    for n in range(1, max_nodes + 1) if only is None else (only,):
        bound = max(_layout_seconds(table, seeds[n], G)) if n in seeds and n <= most_stages else INF
        bound = min(bound, below)
        compress = exact_count or table.compressions_within(bound)
        memo = memos.setdefault(tuple(compress), {})
        # Search strictly below the seed; the seed itself is the answer if nothing beats it.
        found = best(table.num_layers, 0, n, G, bound)
        result[n] = found if found < bound else bound
    return result


def _layout_seconds(table: _StageTable, layout: list[tuple[int, int, int]], gpus: int) -> list[float]:
    """w of every stage of a right-to-left layout (node changes implied by GPU counts)."""
    stages = _to_stages(layout, gpus)
    links = _stage_links(stages)
    return [table.cost[s.gpus][link][s.end][s.start] for s, link in zip(stages, links)]


def _to_stages(layout_right_to_left: list[tuple[int, int, int]], gpus: int) -> list[StageSpec]:
    stages = []
    node, offset = 0, 0
    for start, end, g in reversed(layout_right_to_left):
        if offset + g > gpus:
            node, offset = node + 1, 0
        stages.append(StageSpec(start=start, end=end, node=node, gpu_offset=offset, gpus=g))
        offset += g
    return stages


def _least_t_one_stage_per_node(
    table: _StageTable, gpus: int, r: int, W: float, max_nodes: int
) -> dict[int, list[tuple[int, int, int]]]:
    """For every n up to ``max_nodes``, the layout of one stage of all G GPUs per node with the
    least T among those whose slowest stage is exactly W (memory-feasible), right to left.

    T is additive over stages once W is fixed (``templates``' module docstring): from the right,
    stages before the marker cost 2w + (r-1)W, the marker (w == W) rW, stages after it w + rW.
    The k-th stage from the right keeps k microbatches in flight whatever n is, so one DP over
    k gives every n at once. Stages whose w <= W hold few layers where n is large, so the DP
    runs over a band of stage lengths."""
    L, G = table.num_layers, gpus
    costs = table.cost_stack[G]
    cap = table.cap_matrix(G)
    starts = np.arange(L + 1)
    # Stages no slower than W, with or without a link after them (start >= end is no stage).
    allowed = np.argwhere((costs[LINK_INTER] <= W) | (costs[LINK_NONE] <= W))
    allowed = allowed[allowed[:, 1] > allowed[:, 0]]
    if not len(allowed):
        return {}
    band = int((allowed[:, 1] - allowed[:, 0]).max())  # the most layers such a stage holds
    ends = starts[None, :] + np.arange(1, band + 1)[:, None]  # [d, a]: stage [a, a + d + 1)
    inside = ends <= L
    clipped = np.minimum(ends, L)
    rW, r1W = r * W, (r - 1) * W
    result: dict[int, list[tuple[int, int, int]]] = {}
    # By the first layer a of the k stages placed: the least cost of [a, L) with the marker still
    # to come (every stage placed right of it) and with the marker among them.
    before = np.full(L + 2, INF)
    after = np.full(L + 2, INF)
    before[L] = 0.0
    choices: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for k in range(1, min(max_nodes, L) + 1):
        link = LINK_NONE if k == 1 else LINK_INTER
        w = np.where(inside, costs[link][starts[None, :], clipped], INF)
        fits = inside & (cap[starts[None, :], clipped] >= k)
        w = np.where(fits, w, INF)
        next_before = before[np.where(inside, ends, L + 1)]
        next_after = after[np.where(inside, ends, L + 1)]
        keep_before = np.where(w < W, 2 * w + r1W + next_before, INF)
        become = np.where(w == W, rW + next_before, INF)
        keep_after = np.where(w <= W, w + rW + next_after, INF)
        d_before = np.argmin(keep_before, axis=0)
        d_become = np.argmin(become, axis=0)
        d_after = np.argmin(keep_after, axis=0)
        new_before = keep_before[d_before, starts]
        via_become = become[d_become, starts]
        via_after = keep_after[d_after, starts]
        marked_here = via_become <= via_after
        before = np.append(new_before, INF)
        after = np.append(np.minimum(via_become, via_after), INF)
        choices.append((d_before, np.where(marked_here, d_become, d_after), marked_here))
        if after[0] < INF:
            a, marked, stages = 0, True, []
            for level in range(k - 1, -1, -1):
                d_b, d_a, here = choices[level]
                if marked:
                    d = int(d_a[a])
                    marked = not bool(here[a])
                else:
                    d = int(d_b[a])
                stages.append((a, a + d + 1, G))
                a += d + 1
            result[k] = list(reversed(stages))
    return result

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
realistic profile that halves the time).
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

    seeds = _one_stage_per_node(table, G, max_nodes)
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

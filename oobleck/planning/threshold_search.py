"""The exact template DP for one bottleneck value W (``_solve_for_threshold``).

The DP runs right to left over layers; its state is (layers left, stages placed, nodes still to
open, GPUs used on the current node, marker placed). Stages placed is needed because memory
depends on it (stage i of S keeps S - i microbatches in flight); it is compressed to the
largest in-flight count at which the memory limit of any stage the DP may place binds. For one
W only stages with w <= W are placed, and those are short, so at most thresholds the count
drops out of the state altogether (``_StageTable.compressions_within``).

Inside the DP, the unexplored prefix [0, a) is bounded by the same node-level tables as the sweep's
chain bound (``PrefixBounds``: whole nodes, or the rest of the current node then whole nodes; built
for the power of two at or below the stages' in-flight count, since fewer in flight only loosens
memory and a looser admissible bound changes no search's result, so a search builds a handful where
memory binds at many counts), and a state that has not placed the marker yet is bounded through the
markers still ahead of it. Where memory forces several narrow stages per node (few nodes for a
large model), the node-level bounds are loosest and most of the time goes there; what memory forces
at the stages' in-flight counts narrows it (``_StageTable.memory_stage_counts`` and, where few GPUs
are left, ``gpu_stage_counts``: narrow stages keep few layers): the rest of a state needs at least
that many stages, each costing (r-1)W or more, and the marker keeps at most its own memory limit in
flight, so it lies within that many stages of the pipeline's end.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

import numpy as np

from oobleck.planning.marker_bounds import _fewest_nodes
from oobleck.planning.node_geometry import TIE_FACTOR
from oobleck.planning.pipeline_cost import LINK_INTER, LINK_INTRA, LINK_NONE
from oobleck.planning.prefix_bounds import PrefixBounds
from oobleck.planning.stage_table import STAGE_COUNT_NODES, _StageTable

INF = math.inf


def _solve_for_threshold(
    table: _StageTable,
    gpus: int,
    W: float,
    r: int,
    budgets: dict[int, float],
    markers: set[tuple[int, int, int]] | None = None,
    prefix: PrefixBounds | None = None,
    in_flight: bool = True,
) -> dict[int, tuple[float, list[tuple[int, int, int]]]]:
    """Exact DP for one bottleneck value W: the best T among layouts whose slowest stage is W.

    Branch and bound: ``budgets[n]`` is the best T already known for n nodes, and only layouts
    strictly below it matter. A sub-search that cannot beat its budget (by the bound below)
    stops and is memoised as a lower bound, re-searched only if a larger budget asks again.
    ``markers`` (start, end, gpus), if given, are the only stages allowed as the bottleneck.
    Layouts are returned right to left as (start, end, gpus); node changes follow from the GPU
    counts (a node closes when its GPUs are used up). ``in_flight=False`` leaves out the bounds
    from what memory forces at the in-flight counts of the stages still to place (the search
    before them, for comparison).
    """
    G = gpus
    # key -> (value, exact, choice); inexact values are lower bounds.
    memo: dict[tuple[int, int, int, int, int], tuple[float, bool, Any]] = {}
    rW = r * W
    r1W = (r - 1) * W
    compute = table.compute_prefix
    per_stage_compute = W * G
    cross = table.min_cross_link

    compress = table.compressions_within(W)
    cost, cap = table.cost, table.cap
    bisect_left, bisect_right = bisect.bisect_left, bisect.bisect_right
    # Node-level bounds of a prefix whose stages keep >= j + 1 microbatches in flight, by j
    # (made on first use).
    prefix_tables: list[Any] = [None] * ((table.num_layers + 2) * (G + 1))

    # Lower bound on the cost of covering [0, start) (inlined in ``solve``; INF if impossible).
    # Once the marker is placed every stage costs w + rW; before it, every stage costs
    # >= 2w + (r-1)W (w + rW >= that when w <= W), except the marker itself, which costs
    # rW = 2W + (r-1)W - W. sum w >= compute / G plus one cross-node boundary per node still to
    # open; there are at least as many stages as nodes left to fill and as compute / (W G); and
    # a stage of g GPUs does at most W g of compute, so the GPUs left bound the compute that
    # still fits (with a relative slack of 1e-9 for float rounding).
    # The bound's per-start parts, hoisted out of the inner loop.
    compute_per_gpu = [c / G for c in compute]
    least_stages = [math.ceil(c / per_stage_compute - 1e-9) for c in compute]
    slack = 1 + 1e-9
    # ``bound`` is INF once [0, start) holds more compute than the GPUs left (nl nodes and the
    # current one's G - h) can take at w <= W; compute grows with start, so those starts form a
    # suffix, cut at ``fits_below[nl][h]``.
    most_nodes = max(budgets, default=0)
    fits_below = [
        [bisect_right(compute, (per_stage_compute * (nl + 1) - W * h) * slack) for h in range(G + 1)]
        for nl in range(most_nodes + 1)
    ]
    # Memory: a stage of g GPUs ending at a fits from its first start up when the widest range
    # (start 0) already keeps enough microbatches in flight; bisect only when it does not.
    within_table = table.first_starts_within(W)
    widest_cap = [[row[0] if row else INF for row in cap[g]] if g else [] for g in range(G + 1)]
    # Before the marker is placed, [0, start) must still hold one, ending at or before start:
    # stages right of it cost 2w + (r-1)W, the marker rW, and the k >= (fewest stages of
    # compute <= W G covering its left) stages left of it w + rW, so [0, start) costs at least
    # 2 C(e, start)/G + C(0, s)/G + (k + 1) W + stages (r-1)W over the markers [s, e) (the
    # marker's compute is dropped, and with it a cross-node link it may end in; the stage
    # count term moves stages to the cheaper side).
    # INF where no marker fits: the search stops as soon as it has passed every marker.
    before_marker = np.full(len(compute), INF)
    if markers is not None:
        cumulative = table.arrays.compute
        for m_start, m_end, _ in markers:
            k = _fewest_nodes(compute, 0, m_start, per_stage_compute * slack, per_stage_compute * slack)
            if k is None:
                continue
            rest = 2 * (cumulative[m_end:] - cumulative[m_end]) / G + cumulative[m_start] / G + (k + 1) * W
            before_marker[m_end:] = np.minimum(before_marker[m_end:], rest)
    else:
        before_marker[:] = -INF
    before_marker_list: list[float] = before_marker.tolist()
    # The marker is stage k of S and keeps S - k microbatches in flight, at most what its memory
    # allows: a state with j stages right of the marker still needs a marker ending at or before
    # its start that keeps j + 1 in flight. ``marker_room[start]``: the most any marker ending
    # at or before ``start`` keeps (0 where none ends there).
    marker_room = np.full(len(compute), INF)
    if markers is not None and in_flight:
        marker_room[:] = 0.0
        for m_start, m_end, m_gpus in markers:
            marker_room[m_end:] = np.maximum(marker_room[m_end:], cap[m_gpus][m_end][m_start])
    marker_room_list: list[float] = marker_room.tolist()
    # Memory forces at least so many stages on [0, start) (``_bottleneck_dp``), each costing at
    # least (r-1)W: ``by_gpus`` where few GPUs are left, ``by_memory`` otherwise.
    few_gpus = STAGE_COUNT_NODES * G
    by_gpus = table.gpu_stage_counts(few_gpus) if in_flight else []
    by_memory = table.memory_stage_counts()[2]
    no_count = [0.0] * (table.num_layers + 1)  # (in_flight=False)

    def prefix_at(j: int, h: int) -> Any:
        """(left, marked) bounds of [0, start) after a stage that is the j-th from the right and
        leaves h GPUs of its node used (the rest of the node still to fill when h < G)."""
        assert prefix is not None
        found = prefix.at(j + 1) if h == G else prefix.partial(j + 1, G - h)
        prefix_tables[j * (G + 1) + h] = found
        return found

    def solve(a: int, j: int, nl: int, h: int, p: int, budget: float) -> float:
        if a == 0:
            return 0.0 if (nl == 0 and h == G and p == 1) else INF
        if nl + (1 if h < G else 0) > a:
            return INF
        key = (a, compress[j], nl, h, p)
        hit = memo.get(key)
        if hit is not None and (hit[1] or hit[0] >= budget):
            return hit[0]
        result, choice = INF, None
        same_node = j > 0 and h < G
        j1 = j + 1
        # Widest stages and longest layer ranges first: good layouts early tighten the budget.
        for g in range(G - h if same_node else G, 0, -1):
            if same_node:
                link, nl2, h2 = LINK_INTRA, nl, h + g
            elif nl > 0:
                link, nl2, h2 = (LINK_NONE if j == 0 else LINK_INTER), nl - 1, g
            else:
                break
            # memory: the first start that fits; then the first start with w <= W
            lo = 0 if j1 <= widest_cap[g][a] else bisect_left(cap[g][a], j1)
            within = within_table[g][link][a]
            if within > lo:
                lo = within
            hi = fits_below[nl2][h2]
            if hi > a:
                hi = a
            if lo >= hi:
                continue
            costs = cost[g][link][a]
            min_stages = nl2 + (1 if h2 < G else 0)
            # The stages memory forces on [0, start), by start (0 at start 0).
            free = nl2 * G + G - h2
            if not in_flight:
                needs = no_count
            elif free <= few_gpus:
                needs = by_gpus[j1][free]
            else:
                needs = by_memory[j1]
            links_left = nl2 * cross
            links_but_one = links_left - cross if nl2 else 0.0  # one may be the marker's, inside W
            for start in range(lo, hi):
                w = costs[start]
                if p == 1:
                    here, p2 = w + rW, 1
                elif w < W:
                    here, p2 = 2 * w + r1W, 0
                elif w == W and (markers is None or (start, a, g) in markers):
                    here, p2 = rW, 1
                else:
                    continue
                limit = (result if result < budget else budget) - here
                stages = least_stages[start]
                if stages < min_stages:
                    stages = min_stages
                needed = needs[start]
                if needed > stages:
                    if needed == INF:
                        continue
                    stages = int(needed)
                if p2:
                    lower = compute_per_gpu[start] + links_left + stages * rW
                else:
                    lower = 2 * (compute_per_gpu[start] + links_left) + stages * r1W - W
                    if j1 >= marker_room_list[start]:
                        continue  # every marker left of here keeps fewer than j1 + 1 in flight
                    marked = before_marker_list[start] + links_but_one + stages * r1W
                    if marked > lower:
                        lower = marked
                if prefix is not None and start:
                    tables = prefix_tables[j1 * (G + 1) + h2] or prefix_at(j1, h2)
                    whole = tables[1 - p2][nl2][start]
                    if whole >= limit * TIE_FACTOR:
                        continue  # no better than a tie of the best layout found
                    if whole > lower:
                        lower = whole
                if lower >= limit:
                    continue
                # The memo lookup of ``solve``, inlined: most sub-searches are answered here.
                hit = memo.get((start, compress[j1], nl2, h2, p2)) if start else None
                if hit is not None and (hit[1] or hit[0] >= limit):
                    rest = hit[0]
                else:
                    rest = solve(start, j1, nl2, h2, p2, limit)
                if rest >= limit:
                    continue  # cannot beat what we have (rest may be only a lower bound)
                value = here + rest
                if value < result:
                    result, choice = value, (start, g, p2)
        if choice is None:
            memo[key] = (budget, False, None)  # nothing below the budget: the budget is a lower bound
            return budget
        memo[key] = (result, True, choice)
        return result

    def layout(n: int) -> list[tuple[int, int, int]]:
        a, j, nl, h, p = table.num_layers, 0, n, G, 0
        stages = []
        while a > 0:
            start, g, p2 = memo[(a, compress[j], nl, h, p)][2]
            stages.append((start, a, g))
            if j > 0 and h < G:
                h += g
            else:
                nl, h = nl - 1, g
            a, j, p = start, j + 1, p2
        return stages

    results = {}
    for n, budget in budgets.items():
        value = solve(table.num_layers, 0, n, G, 0, budget)
        if value < budget:
            results[n] = (value, layout(n))
    return results

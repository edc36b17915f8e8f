"""Bounds that rule out the bottleneck candidates ("markers") of one threshold W before any search.

A marker is a stage whose time is exactly W, the rightmost slowest stage of the layouts counted
at W. Two bounds, cheapest first, tell which markers could still be the bottleneck of a layout
better than the best known: ``_promising_markers``, from each marker's compute on either side
and the stages it forces (vectorised over every marker of W), and, for the few markers of
distinct layers, ``_marker_bounds``, a node-level relaxation per marker (``_fewest_nodes``: the
fewest nodes a side takes). The sweep (``threshold_sweep``) runs them in that order.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import numpy as np

from oobleck.planning.pipeline_cost import LINK_INTRA
from oobleck.planning.stage_table import _StageTable

INF = math.inf


def _promising_markers(
    table: _StageTable,
    W: float,
    r: int,
    budgets: dict[int, float],
    total_compute: float,
    gpus: int,
    fewest_stages: int = 0,
    in_flight: bool = True,
) -> list[tuple[int, int, int, int]]:
    """Stages (start, end, gpus, link) of time exactly W that could still be the bottleneck of a
    better layout.

    From T = ((r-1)S + 1) W + k W + sum_{i<k} w_i + 2 sum_{i>k} w_i with S >= n stages (n + 1 if
    the marker leaves GPUs of its node to another stage): the k stages left of a marker [s, e)
    each do at most W*G of compute, so k >= C(0, s) / (W G), and the sums are at least the
    compute on each side divided by G.
    """
    lo = int(np.searchsorted(table.marker_costs, W, side="left"))
    hi = int(np.searchsorted(table.marker_costs, W, side="right"))
    if not budgets or lo == hi:
        return []
    compute = table.arrays.compute
    starts = table.marker_starts[lo:hi]
    ends = table.marker_ends[lo:hi]
    left = compute[starts]
    right = total_compute - compute[ends]
    widths = table.marker_gpus[lo:hi]
    k_min = np.maximum(np.ceil(left / (W * gpus) - 1e-9), (starts > 0).astype(float))
    # A marker narrower than a node shares it with another stage: one stage more than nodes;
    # and there are at least as many stages as memory forces (``fewest_stages``), and, with
    # ``in_flight``, as the marker, the k before it and those after it
    # (``_StageTable.marker_stage_counts``; INF: it is never the bottleneck).
    least: float | np.ndarray = fewest_stages
    if in_flight:
        after, before = table.marker_stage_counts()
        k_min = np.maximum(k_min, before[lo:hi])
        least = np.maximum(fewest_stages, k_min + 1 + after[lo:hi])
    extra_stages = (widths < gpus).astype(float)
    base = (k_min + 1) * W + left / gpus + 2 * right / gpus
    keep = np.zeros(hi - lo, dtype=bool)
    for n, budget in budgets.items():
        stages = np.maximum(n + extra_stages, least)
        bottleneck = np.isfinite(stages)  # an INF marker is dropped also when r = 1 (no 0 * INF)
        keep |= bottleneck & (base + (r - 1) * np.where(bottleneck, stages, 0.0) * W < budget)
    links = table.marker_links[lo:hi]
    return [
        (int(a), int(b), int(g), int(link))
        for a, b, g, link in zip(starts[keep], ends[keep], widths[keep], links[keep])
    ]


def _fewest_nodes(compute: list[float], start: int, end: int, most: float, last_most: float) -> int | None:
    """Fewest contiguous blocks covering layers [start, end) with at most ``most`` compute each
    (``last_most`` for the block ending at ``end``), or None if a single layer does not fit.
    Greedy from the right, longest block first (it stays ahead of any other cover)."""
    count, x, limit = 0, end, last_most
    while x > start:
        y = bisect.bisect_left(compute, compute[x] - limit, start, x + 1)
        if y >= x:  # (y > x: a negative capacity)
            return None
        x, count, limit = y, count + 1, most
    return count


def _marker_bounds(
    table: _StageTable, gpus: int, W: float, r: int, marker: tuple[int, int, int, int], nodes: Sequence[int]
) -> dict[int, float]:
    """A lower bound on T, for each n in ``nodes``, over layouts whose bottleneck is ``marker``.

    Node-level relaxation of Eq. 1-4 (the additive form in the module docstring of ``templates``).
    The marker's node covers layers [s, e) and sits between ``nl`` nodes to its left and ``nr`` to
    its right. A left node costs at least ``C/G + cross + rW`` and a right node ``2 (C/G + cross) +
    (r-1) W`` (cross: the cheapest cross-node boundary; the last node has none), whatever its
    stages, because sum_i C_i/g_i >= C/G. A node whose stages all take <= W holds at most G W of
    compute, and at most G (W - cross) if it is one stage with an outgoing cross-node link; a node
    of several stages costs at least (r-1) W more. So ``nl`` and ``nr`` are at least greedy block
    counts at those capacities (two cases: no node split, or some node split) and at most the layer
    counts. A marker narrower than a node shares it with stages on the other G - g GPUs: each of
    their extents [s, e) is tried, those left of the marker costing at least C/(G - g) + rW and
    those right of it 2 C/(G - g) + (r-1) W. With planner.max_gpus_per_stage below G every node has
    at least ceil(G / limit) stages, each charged. Memory is ignored. For layouts with one stage per
    node and equal boundary tensors the bound is exact, which is what lets the sweep skip most
    thresholds without running the DP.
    """
    start, end, width, link = marker
    G, L = gpus, table.num_layers
    compute = table.compute_prefix
    cross = table.min_cross_link
    slack = 1 + 1e-9  # permissive rounding keeps it a lower bound
    rW, r1W = r * W, (r - 1) * W
    # The marker node's extents [s, e) and the least cost of its stages.
    extents: list[tuple[int, int, float]] = []
    if width == G:
        if link != LINK_INTRA:  # a whole-node stage is followed by another node's stage
            extents.append((start, end, rW))
    else:
        spare, other = W * (G - width) * slack, G - width
        lefts = range(bisect.bisect_left(compute, compute[start] - spare, 0, start + 1), start + 1)
        if link == LINK_INTRA:  # stages follow the marker on its node
            rights = range(end + 1, bisect.bisect_right(compute, compute[end] + spare, end, L + 1))
        else:
            rights = range(end, end + 1)
        for s in lefts:
            left_part = compute[start] - compute[s]
            for e in rights:
                right_part = compute[e] - compute[end]
                if left_part + right_part > spare or (s == start and e == end):
                    continue
                cost = rW + (left_part / other + rW if s < start else 0.0)
                cost += 2 * right_part / other + r1W if e > end else 0.0
                # Stages the other GPUs need beyond those counted (max_gpus_per_stage).
                cost += max(0, table.stages_per_node - 1 - (s < start) - (e > end)) * r1W
                extents.append((s, e, cost))
    # Per node beside the marker's: its stages (at least ``q``) and its outgoing link.
    q = table.stages_per_node
    per_left = cross + q * rW
    per_right = 2 * cross + q * r1W

    def side_costs(nl: int, n: int) -> float:
        nr = n - 1 - nl
        return nl * per_left + (nr * per_right - 2 * cross if nr else 0.0)

    whole, single = W * G * slack, (W - cross) * G * slack
    # No node split (capacity of one stage with its link), or some node split (at least one stage
    # more); when every node must split, ``q`` already counts its stages.
    cases = ((single, 0.0), (whole, r1W)) if q == 1 else ((whole, 0.0),)
    bounds = dict.fromkeys(nodes, INF)
    for s, e, node_cost in extents:
        base = compute[s] / G + 2 * (compute[L] - compute[e]) / G + node_cost
        for most, penalty in cases:
            fewest_left = _fewest_nodes(compute, 0, s, most, most)
            fewest_right = _fewest_nodes(compute, e, L, most, whole)
            if fewest_left is None or fewest_right is None:
                continue
            for n in nodes:
                lo = max(fewest_left, n - 1 - (L - e))
                hi = min(s, n - 1 - fewest_right)
                if lo > hi:
                    continue
                # Linear in nl except at nr = 0: the minimum is at an end or at nl = n - 2.
                candidates = (lo, hi, n - 2) if lo <= n - 2 <= hi else (lo, hi)
                value = base + penalty + min(side_costs(nl, n) for nl in candidates)
                if value < bounds[n]:
                    bounds[n] = value
    return bounds

"""The threshold sweep: every distinct stage time W as the bottleneck, ascending, until a bound stops it.

The sweep over W stops for a node count once a lower bound, ``max(2 D + ((r-1) S - 1) W,
((r-1) S + 1) W)``, reaches the best T found. Both follow from Eq. 1-4, T = sum w + ((r-1)S - 1) W +
k W + sum_{i>=k} w_i, with S at least n and at least the stages memory forces (``_fewest_stages``),
and D <= sum w: the total compute C over G, or spread over the n G GPUs with no stage holding more
than memory lets it (``node_costs._spread``), plus the cheapest cross-node boundary per node
boundary.

Every node count starts from its seed (``bottleneck_search``: descended, and where equal layers
make plateaus of equal T the best one-stage-per-node layout at its slowest stage). Node counts for
which memory rules that seed out are first searched at the few thresholds the node-level bound
rates best (``PROBE_THRESHOLDS``), and the first layout found is refined (``_refine``), so the
ascending sweep meets most thresholds with a budget near the optimum. A bound that comes within
``TIE_SLACK`` of a budget rules a search out (``node_geometry``): equal layers make many layouts
of the same T, and proving none of them better would cost as much as finding the first.

Most thresholds never reach the DP: a W is skipped when no stage of time W can be the
bottleneck of a better layout, first by a compute bound (``_promising_markers``), then, for the
few markers of distinct layers, by a per-marker node relaxation (``_marker_bounds``), then by the
node-level chain bound of ``oobleck.planning.node_bounds`` for every node count at once
(``root_bounds``: whole nodes, one-stage nodes exact, split nodes bounded by their compute, links
and the stages memory forces; the one bound that scales when equal layers put a marker at every
position). Where memory forces more stages than nodes, the sweep also counts the stages a
threshold forces: feasibility is monotone in the bottleneck, so the least slowest stage of layouts
with at most s stages (one bottleneck DP with a stage cap, reused by every threshold) tells which
thresholds need more than s, and ``lower_bound`` with that many stages rules them out. Where
memory allows one stage per node, the seed's slowest stage is that least value for n stages on n
nodes (one stage of all G GPUs per node), so a threshold below it forces n + 1 stages, without a
DP; and below the floor under the slowest stage of layouts with at most e nodes of two or more
stages (``node_geometry.split_node_floors``: whole nodes exact, split nodes at their compute floor,
one DP for every node count and e), more than n + e (on gpt128 that rules out half the thresholds
that reached the chain bound). For node counts where memory forces more stages than nodes, a
threshold the compute and per-marker bounds leave meets ``_GpuRelaxation`` (``gpu_relaxation``)
before the chain bound; it decides most searches there that would find nothing (gpt128: 98 of
130), and the same relaxation over an interval of thresholds (costs at its low end, stages up to
its high end) rules out runs of them at once. What is left goes to the exact DP for that W
(``threshold_search``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from oobleck.planning.bottleneck_search import (
    _bottleneck_dp,
    _descend,
    _layout_seconds,
    _least_t_one_stage_per_node,
    _refine,
    _seed_layouts,
)
from oobleck.planning.gpu_relaxation import _GpuRelaxation
from oobleck.planning.marker_bounds import _marker_bounds, _promising_markers
from oobleck.planning.node_bounds import root_bounds
from oobleck.planning.node_costs import NodeCosts, _spread
from oobleck.planning.node_geometry import BOUND_SLACK, TIE_FACTOR, split_node_floors
from oobleck.planning.pipeline_cost import pipeline_iteration_time
from oobleck.planning.prefix_bounds import PrefixBounds
from oobleck.planning.stage_table import _StageTable
from oobleck.planning.threshold_search import _solve_for_threshold

INF = math.inf
# Above this many candidate bottleneck stages at one threshold, the per-marker node bound
# (``_marker_bounds``, Python per marker) costs more than the chain bound it precedes.
MARKER_BOUND_LIMIT = 4
# Node counts without a seed layout are first searched at the thresholds, of PROBE_THRESHOLDS
# spread over the candidates, that the node-level bound rates best, until one has a layout (at
# most PROBE_ATTEMPTS).
PROBE_THRESHOLDS = 64
PROBE_ATTEMPTS = 8
# Where memory allows one stage per node, the sweep tells thresholds that force more than
# n + e stages on n nodes for e up to this (``node_geometry.split_node_floors``; one DP whose cost
# grows with it): past it the chain bound decides (on gpt128, gpt100 and the realistic profile
# no threshold needed more).
MOST_SPLITS = 8
# Where memory puts several stages on a node, thresholds are first ruled out this many at a time
# by one GPU-level relaxation over the interval (doubling or halving as it works or not).
RELAX_INTERVAL = 16


@dataclass(frozen=True)
class TemplateProgress:
    """How far template generation has come: ``settled`` of ``node_counts`` node counts can no
    longer improve, and the sweep is at candidate bottleneck ``threshold`` of ``thresholds``
    (ascending; most node counts settle long before the last)."""

    settled: int
    node_counts: int
    threshold: int
    thresholds: int


def _sweep_thresholds(
    table: _StageTable,
    gpus: int,
    r: int,
    wanted: Sequence[int],
    bottleneck: dict[int, float],
    progress: Callable[[TemplateProgress], None] | None = None,
    stage_caps: bool = True,
    in_flight: bool = True,
) -> dict[int, tuple[float, list[tuple[int, int, int]]]]:
    """Try every distinct stage time W as the bottleneck, ascending, until the bound stops it.
    ``stage_caps=False`` skips the stage-count bound, ``in_flight=False`` the bounds from what
    memory forces at the stages' in-flight counts, ``_GpuRelaxation`` among them (the searches
    before them, for comparison)."""
    candidates = table.candidates
    geometry = table.node_geometry()
    total_per_gpu = table.total_compute / gpus
    cross = table.min_cross_link
    best: dict[int, tuple[float, list[tuple[int, int, int]]]] = {}
    one_stage_slowest: dict[int, float] = {}  # the least slowest stage of one-stage-per-node layouts
    for n, layout in _seed_layouts(table, gpus, max(wanted, default=0)).items():
        if n in wanted:
            one_stage_slowest[n] = max(_layout_seconds(table, layout, gpus))
            best[n] = _descend(table, gpus, r, layout)
    # Equal layers make plateaus of equal T (two stages swap their lengths, T stays), on which
    # the descent, one boundary at a time, stalls: there the seed is replaced by the best
    # one-stage-per-node layout at its slowest stage, one DP for every node count sharing it. On
    # varied layers the descent reaches that layout already (every case of the benchmark), and
    # the DPs would only cost time.
    by_slowest: dict[float, list[int]] = {}
    equal_layers = bool((table.arrays.run_end - table.arrays.run_start).max(initial=0) > 1)
    for n, W in one_stage_slowest.items() if equal_layers else ():
        by_slowest.setdefault(W, []).append(n)
    for W, counts in by_slowest.items():
        found = _least_t_one_stage_per_node(table, gpus, r, W, max(counts))
        for n in counts:
            if n in found:
                value = pipeline_iteration_time(_layout_seconds(table, found[n], gpus), r * n)
                if value < best[n][0]:
                    best[n] = (value, found[n])

    # The bound max(2 least_sum + ((r-1) S - 1) W, ((r-1) S + 1) W) per node count, with S the
    # fewest stages a layout on n nodes has and
    # least_sum = compute / G plus one cheapest cross-node boundary between consecutive nodes.
    # Both terms are linear in W: a rising term caps the W worth trying for n from above (at the
    # best T found so far), a falling one (possible for small r) from below. The window of n is
    # kept as a range of candidate indices and refreshed whenever its best T improves.
    nodes = sorted(wanted)
    # sum w >= sum_i C_i / g_i >= (sum_i sqrt C_i)^2 / (n G), least when stages hold all they
    # may (memory) and one the rest (``node_costs._spread``); and >= C / G.
    most = geometry.most_compute(1) * (1 + 1e-9)
    spread = _spread(np.array([table.total_compute] * len(nodes)), most, 1) if most > 0 else None
    least_sum = {
        n: max(total_per_gpu, float(spread[i]) / (n * gpus) if spread is not None else 0.0) + (n - 1) * cross
        for i, n in enumerate(nodes)
    }
    # S >= n stages, and at least as many as memory forces (few nodes for a large model: several
    # stages per node, which is where, without this count, most thresholds reach the DP).
    fewest = _fewest_stages(table)
    stages = {n: max(n * table.stages_per_node, fewest) for n in nodes}
    terms = {n: (((r - 1) * stages[n] - 1, 2 * least_sum[n]), ((r - 1) * stages[n] + 1, 0.0)) for n in nodes}

    def lower_bound(n: int, W: float) -> float:
        return max(offset + slope * W for slope, offset in terms[n])

    def target(n: int) -> float:
        return best[n][0] if n in best else INF

    # Feasibility is monotone in the bottleneck: a layout with at most s stages, all at most W,
    # exists for every W at or above the least slowest stage of such layouts, ``capped[n][s]``
    # (``_bottleneck_dp`` with a stage cap), and for no W below it. So a threshold below
    # ``capped[n][s - 1]`` forces s or more stages on n nodes, and the bound above with s stages
    # rules it out without any per-threshold search. Each ``capped`` value is one DP, computed
    # when a threshold first asks for it and reused by every later threshold. Only node counts
    # on which memory forces more stages than nodes ask: there several stages share a node, the
    # count of stages a threshold needs varies with it, and without this most thresholds reach the DP;
    # with a stage per node the one-stage node bounds are exact already.
    capped: dict[int, dict[int, tuple[float, float]]] = {}  # n -> stages -> (low, high)
    # ``relax_ahead``: thresholds ruled out up to an index, by node count; the interval's length.
    skip_until: dict[int, int] = {}
    span = [RELAX_INTERVAL]
    split_floors: list[np.ndarray] = []  # ``split_node_floors``, once asked for

    def forces_too_many_stages(n: int, W: float, budget: float) -> bool:
        if not stage_caps or r == 1 or budget == INF:
            return False
        if stages[n] <= n * table.stages_per_node:
            # Memory allows one stage per node. n stages on n nodes are one stage of all G GPUs
            # per node, whose least slowest stage the seed has (``_one_stage_per_node`` is exact),
            # so below it a layout has a split node: n + 1 stages or more. With equal layers the
            # best layout is mostly one stage per node at exactly that bottleneck, the end of the
            # window, and without this the thresholds below it reach the chain bound one by one.
            if table.stages_per_node > 1 or n not in one_stage_slowest or W >= one_stage_slowest[n]:
                return False
            if stage_bound(n, W, n + 1) >= budget:
                return True
            # Below the floor under the slowest stage of layouts with at most e split nodes, a
            # layout has more than n + e stages (``split_node_floors``: one DP for every node
            # count, made on first use); the largest such e gives the strongest bound.
            if not split_floors:
                split_floors.append(split_node_floors(geometry, max(nodes), MOST_SPLITS))
            floors = split_floors[0][n]
            for splits in range(MOST_SPLITS, 0, -1):
                if W < floors[splits]:
                    return stage_bound(n, W, n + splits + 1) >= budget
            return False
        # The fewest stages at which the bound reaches the budget (solved for the count, then
        # corrected by the bound itself), and whether W forces one more than ``most``.
        estimate = min((budget - 2 * least_sum[n] + W) / ((r - 1) * W), (budget - W) / ((r - 1) * W))
        if estimate > table.num_layers:
            return False  # no layout has more stages than layers
        wanted = max(stages[n] + 1, math.ceil(estimate))
        while wanted > stages[n] + 1 and stage_bound(n, W, wanted - 1) >= budget:
            wanted -= 1
        while stage_bound(n, W, wanted) < budget:
            wanted += 1
        most = wanted - 1
        if most >= table.num_layers:
            return False
        # ``capped[n][s]`` is nonincreasing in s: an upper value known at fewer stages that W
        # reaches, or a lower value at more stages that W falls short of, answers without a DP.
        # With as many stages as layers the cap binds no layout: its value is at least the floor
        # under the least slowest stage of all (``bottleneck``).
        # A DP searches only up to the largest threshold the budget leaves in this node count's
        # window (cheaper than the exact value): a result under that is exact, the limit itself
        # means "above every threshold still to come" and is kept as a lower value.
        known = capped.setdefault(n, {})
        if not known:
            known[table.num_layers] = (bottleneck[n], INF)
        if any(count <= most and high <= W for count, (_, high) in known.items()):
            return False
        if any(count >= most and low > W for count, (low, _) in known.items()):
            return True
        last = min((budget - offset) / slope for slope, offset in terms[n] if slope > 0)
        above = math.nextafter(max(W, last), INF)
        found = _bottleneck_dp(table, gpus, n, only=n, stage_cap=most, below=above, in_flight=in_flight)[n]
        known[most] = (found, found) if found < above else (above, INF)
        return W < found

    def stage_bound(n: int, W: float, count: int) -> float:
        """``lower_bound`` for layouts of at least ``count`` stages."""
        return max(2 * least_sum[n] + ((r - 1) * count - 1) * W, ((r - 1) * count + 1) * W)

    def window(n: int) -> tuple[int, int]:
        lo, hi = bottleneck[n], INF
        if n in best:
            for slope, offset in terms[n]:
                if slope > 0:
                    hi = min(hi, (target(n) - offset) / slope)
                elif slope < 0:
                    lo = max(lo, (target(n) - offset) / slope)
                elif offset >= target(n):
                    return 0, 0
        # A hair wider than the division says: the exact test is lower_bound() < target().
        first = int(np.searchsorted(candidates, lo * (1 - 1e-12), side="left"))
        past = int(np.searchsorted(candidates, hi * (1 + 1e-12), side="right")) if hi < INF else len(candidates)
        return first, past

    def attempt(W: float, budgets: dict[int, float]) -> None:
        """Search the layouts whose bottleneck is W for every n in ``budgets`` (only those below
        its budget matter), after the bounds that may rule W out without the DP."""
        promising = _promising_markers(table, W, r, budgets, total_per_gpu * gpus, gpus, fewest, in_flight)
        if not promising:
            return
        if len(promising) <= MARKER_BOUND_LIMIT:
            # Few markers: the per-marker node bound also narrows which of them the DP may use.
            markers: set[tuple[int, int, int]] = set()
            still_open: set[int] = set()
            for marker in promising:
                bounds = _marker_bounds(table, gpus, W, r, marker, list(budgets))
                beaten = {n for n, bound in bounds.items() if bound < budgets[n]}
                if beaten:
                    markers.add(marker[:3])
                    still_open |= beaten
            if not markers:
                return
            budgets = {n: budgets[n] for n in sorted(still_open)}
        else:  # many (equal layers put a marker at every position): one chain bound for all of them
            markers = {marker[:3] for marker in promising}
        # Where memory puts several stages on a node, the chain bound knows only a split node's
        # compute; the GPU-level relaxation knows its stages and decides most searches there
        # that would find nothing (a bound from memory at in-flight counts: ``in_flight``), so
        # it goes first there and the chain bound's tables are made only for what it leaves.
        crowded = [n for n in budgets if stages[n] > n * table.stages_per_node] if in_flight else []
        if crowded:
            relaxed = _GpuRelaxation(table, gpus, W, r, markers).bounds(max(crowded))
            budgets = {
                n: b for n, b in budgets.items() if n not in crowded or relaxed[n] * (1 - BOUND_SLACK) < b * TIE_FACTOR
            }
            if not any(n in budgets for n in crowded):
                span[0] = max(span[0], 2)  # ruled out here: the next thresholds may be too, try two at once
            if not budgets:
                return
        starts, ends, widths = (np.array([m[i] for m in markers]) for i in range(3))
        costs = NodeCosts(geometry, W, r, starts, ends, widths)
        chain = root_bounds(costs, max(budgets))
        budgets = {n: b for n, b in budgets.items() if chain[n] < b * TIE_FACTOR}
        if not budgets:
            return
        prefix = PrefixBounds(costs, max(budgets))
        found = _solve_for_threshold(table, gpus, W, r, budgets, markers, prefix, in_flight)
        for n, (value, layout) in found.items():
            if n not in best or value < best[n][0]:
                best[n] = (value, layout)

    # Node counts without a seed (memory rules out one stage per node) start from the threshold
    # the node-level bound rates best on a coarse grid: the ascending sweep below then meets most
    # thresholds with a budget close to the optimum instead of none.
    unseeded = [n for n in nodes if n not in best]
    if unseeded:
        first = int(np.searchsorted(candidates, min(bottleneck[n] for n in unseeded) * (1 - 1e-12), side="left"))
        grid = np.unique(np.linspace(first, len(candidates) - 1, PROBE_THRESHOLDS).astype(np.int64))
        rated: dict[int, list[tuple[float, float]]] = {n: [] for n in unseeded}
        for index in grid:
            W = float(candidates[index])
            lo = int(np.searchsorted(table.marker_costs, W, side="left"))
            hi = int(np.searchsorted(table.marker_costs, W, side="right"))
            marker = (table.marker_starts[lo:hi], table.marker_ends[lo:hi], table.marker_gpus[lo:hi])
            bounds = root_bounds(NodeCosts(geometry, W, r, *marker), max(unseeded))
            for n in unseeded:
                if bounds[n] < INF:
                    rated[n].append((float(bounds[n]), W))
        for n in unseeded:
            for _, W in sorted(rated[n])[:PROBE_ATTEMPTS]:
                attempt(W, {n: target(n)})
                if n in best:
                    best[n] = _refine(table, gpus, r, best[n][1])
                    break

    def relax_ahead(first: int, budgets: dict[int, float]) -> None:
        """Node counts where memory puts several stages on a node: one GPU-level relaxation over
        the thresholds ``first`` .. ``first + span - 1`` (stage costs at the low end, stages up to
        the high end allowed, any stage within it the marker) bounds every threshold in it; where
        that reaches the budget, the node count skips them all (dropped from ``budgets``). The
        interval doubles while it rules node counts out and halves when it does not (near an
        optimum only single thresholds are); a single threshold ruled out re-opens it at two."""
        crowded = [n for n in budgets if stages[n] > n * table.stages_per_node]
        if not crowded or span[0] < 2:
            return
        last = min(first + span[0], len(candidates)) - 1
        low, high = float(candidates[first]), float(candidates[last])
        lo = int(np.searchsorted(table.marker_costs, low, side="left"))
        hi = int(np.searchsorted(table.marker_costs, high, side="right"))
        markers = set(
            zip(
                table.marker_starts[lo:hi].tolist(),
                table.marker_ends[lo:hi].tolist(),
                table.marker_gpus[lo:hi].tolist(),
            )
        )
        relaxed = _GpuRelaxation(table, gpus, low, r, markers, top=high).bounds(max(crowded))
        ruled = [n for n in crowded if relaxed[n] * (1 - BOUND_SLACK) >= budgets[n] * TIE_FACTOR]
        for n in ruled:
            skip_until[n] = last
            del budgets[n]
        span[0] = span[0] * 2 if ruled else span[0] // 2

    windows = np.array([window(n) for n in nodes], dtype=np.int64).reshape(-1, 2)
    index = 0
    while len(nodes):
        # The next candidate W that some node count still needs.
        starts = np.maximum(windows[:, 0], index)
        still = starts < windows[:, 1]
        if not still.any():
            break
        next_index = int(starts[still].min())
        if progress is not None:
            settled = int(((windows[:, 1] <= next_index) | (windows[:, 0] >= windows[:, 1])).sum())
            progress(TemplateProgress(settled, len(nodes), next_index, len(candidates)))
        W = float(candidates[next_index])
        inside = np.flatnonzero((windows[:, 0] <= next_index) & (next_index < windows[:, 1]))
        open_here = [nodes[i] for i in inside if skip_until.get(nodes[i], -1) < next_index]
        budgets = {n: target(n) for n in open_here if lower_bound(n, W) < target(n)}
        budgets = {n: b for n, b in budgets.items() if not forces_too_many_stages(n, W, b)}
        index = next_index + 1
        if budgets and in_flight:
            relax_ahead(next_index, budgets)
        if not budgets:
            continue
        before = {n: target(n) for n in budgets}
        attempt(W, budgets)
        for n, value in before.items():
            if target(n) < value:
                windows[nodes.index(n)] = window(n)
    return best


def _fewest_stages(table: _StageTable) -> int:
    """The fewest stages any memory-feasible layout has (0 if none fits): stage i of S keeps
    S - i microbatches in flight, so covered from the right, the j-th stage must fit with j in
    flight on as many GPUs as a stage may have. Taking the longest such stage at each step
    leaves the shortest prefix (a stage of fewer layers needs less memory), so it uses fewest."""
    widest = table.cap[table.stage_gpu_limit]
    end, count = table.num_layers, 0
    while end > 0:
        count += 1
        fits = [start for start, cap in enumerate(widest[end]) if cap >= count]
        if not fits:
            return 0
        end = fits[0]
    return count

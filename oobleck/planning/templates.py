"""Pipeline templates: the best stage layout for every node count, found by an exact DP.

A template for ``n`` nodes splits the layers into contiguous stages; each stage runs on ``g`` GPUs
of one node (1 <= g <= G, never spanning nodes); a node may host several consecutive stages and
every GPU of every node is used. Templates are ranked by Eq. 1-4 at ``m = r * S`` microbatches
(``r = reference_microbatches_per_stage``, the paper's 4), subject to per-device memory.

Why the DP enumerates the bottleneck. With W the slowest stage time and k its (rightmost) index,
Eq. 1-4 at m = r*S rewrites as a sum over stages:

    T = sum_{i<k} (w_i + r W) + r W + sum_{i>k} (2 w_i + (r - 1) W)

Whether a sub-layout is best therefore depends on W and on which side of k it falls, not only on
its own time (keeping the locally best sub-plan, as the original divide-and-conquer did, is wrong).
For a fixed W the sum is additive, so the DP fixes W (ascending over the distinct stage times)
and places exactly one "marker" stage whose time equals W, stages to its right strictly faster
(k is the rightmost maximum) and stages to its left at most W. Every layout is counted exactly
once, at its own W, with its exact T; the minimum over W is the optimum. The sweep over W stops
for a node count once a lower bound, ``max(2 C/G + ((r-1) n - 1) W, ((r-1) n + 1) W)`` with C
the total compute (plus the cheapest cross-node boundary per node boundary), reaches the best T
found (both follow from Eq. 1-4 with S >= n: T = sum w + ((r-1)S - 1) W + k W + sum_{i>=k} w_i).

The DP runs right to left over layers; its state is (layers left, stages placed, nodes still to
open, GPUs used on the current node, marker placed). Stages placed is needed because memory
depends on it (stage i of S keeps S - i microbatches in flight); it is compressed to the
largest in-flight count at which any stage's memory limit binds.

Speed without giving up exactness (branch and bound): both searches start from the best layout
with one full-node stage per node (a cheap min-max partition) as an upper bound and look only
for strictly better layouts; a sub-search that cannot beat its budget (by the bound in
``_solve_for_threshold``) stops and is memoised as a lower bound; a W is skipped when no stage of
time W can be the bottleneck of a better layout (``_promising_markers``). The exactness tests
compare against brute force over every layout. The inner loop of ``_solve_for_threshold`` is
kept lean without changing the search: per threshold W, the first start with w <= W for every
(g, link, end) comes from one numpy count, the bound's per-start terms and its compute cut-off
are tabulated, and memo hits are answered before a recursive call. Cost still grows quickly when
many nodes share few layers with G > 1 (many near-equal sub-node splits to rule out); see
benchmarks/bench_planner.py.
"""

from __future__ import annotations

import bisect
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from oobleck.errors import PlanningError
from oobleck.planning.cost import (
    LINK_INTER,
    LINK_INTRA,
    LINK_NONE,
    ProfileArrays,
    link_seconds,
    pipeline_iteration_time,
)
from oobleck.planning.plan import PipelineTemplate, StageSpec
from oobleck.planning.profile import ClusterSpec, ModelProfile

INF = math.inf


@dataclass(frozen=True)
class TemplateSet:
    """Templates by node count, for node counts ``min_nodes .. max_nodes`` that have one."""

    min_nodes: int  # n0
    max_nodes: int  # N - f * n0 at generation time
    templates: dict[int, PipelineTemplate] = field(default_factory=dict)
    num_layers: int = 0
    gpus_per_node: int = 1
    # Parameter bytes of every layer: what reconfiguration moves when a layer changes holder.
    layer_param_bytes: tuple[int, ...] = ()
    # The cluster's links (bytes/s), for the gradient-sync terms of a plan's predicted time.
    intra_node_bandwidth: float = 1e10
    inter_node_bandwidth: float = 1e9

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.templates))

    def __getitem__(self, nodes: int) -> PipelineTemplate:
        try:
            return self.templates[nodes]
        except KeyError:
            raise PlanningError(
                f"no pipeline template for {nodes} nodes; templates exist for {list(self.sizes)}"
            ) from None

    def __contains__(self, nodes: int) -> bool:
        return nodes in self.templates

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {
            "min_nodes": self.min_nodes,
            "max_nodes": self.max_nodes,
            "num_layers": self.num_layers,
            "gpus_per_node": self.gpus_per_node,
            "layer_param_bytes": list(self.layer_param_bytes),
            "intra_node_bandwidth": self.intra_node_bandwidth,
            "inter_node_bandwidth": self.inter_node_bandwidth,
            "templates": {str(n): asdict(t) for n, t in sorted(self.templates.items())},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TemplateSet:
        templates = {int(key): PipelineTemplate.from_dict(t) for key, t in data["templates"].items()}
        return cls(
            min_nodes=data["min_nodes"],
            max_nodes=data["max_nodes"],
            templates=templates,
            num_layers=data.get("num_layers", 0),
            gpus_per_node=data.get("gpus_per_node", 1),
            layer_param_bytes=tuple(data.get("layer_param_bytes", ())),
            intra_node_bandwidth=float(data.get("intra_node_bandwidth", 1e10)),
            inter_node_bandwidth=float(data.get("inter_node_bandwidth", 1e9)),
        )


class _StageTable:
    """Every candidate stage's time and memory limit, as lists indexed for the DP's inner loop.

    For a stage ending at layer ``end`` on ``g`` GPUs with outgoing link ``link``:
    ``cost[g][link][end][start]`` is w (decreasing as start grows smaller), and
    ``cap[g][end][start]`` the most microbatches it may keep in flight within memory.
    """

    def __init__(self, profile: ModelProfile, cluster: ClusterSpec, stage_gpu_limit: int):
        self.arrays = arrays = ProfileArrays(profile)
        max_gpus = cluster.gpus_per_node
        self.cluster = cluster
        L = arrays.num_layers
        self.num_layers = L
        self.max_gpus = max_gpus
        ends = np.arange(L + 1)
        compute = arrays.compute[None, :] - arrays.compute[:, None]  # [start, end]
        state = 4.0 * (arrays.params[None, :] - arrays.params[:, None])
        acts = arrays.activations[None, :] - arrays.activations[:, None]
        out = np.concatenate(([0.0], arrays.output_bytes))  # output bytes of the layer before `end`
        self.cost: list[list[list[list[float]]]] = [[] for _ in range(max_gpus + 1)]
        self.neg_cost: list[list[list[list[float]]]] = [[] for _ in range(max_gpus + 1)]
        self.cap: list[list[list[float]]] = [[] for _ in range(max_gpus + 1)]
        memory = cluster.device_memory_bytes
        values, starts, stage_ends, widths = [], [], [], []
        # cost_stack[g, link, start, end]: the same w for vectorised threshold counts; -inf where
        # start >= end (no stage), so it never counts as slower than a threshold.
        self.cost_stack = np.full((max_gpus + 1, 3, L + 1, L + 1), -INF)
        below = np.tril(np.ones((L + 1, L + 1), dtype=bool))
        binding = 0
        for g in range(1, max_gpus + 1):
            with np.errstate(divide="ignore", invalid="ignore"):
                cap = np.where(acts > 0, np.floor((memory - state) * g / np.where(acts > 0, acts, 1.0)), INF)
            cap = np.where(state > memory, 0.0, cap)
            cap = np.maximum(cap, 0.0)
            if g > stage_gpu_limit:  # planner.max_gpus_per_stage: such a stage never fits
                cap = np.zeros_like(cap)
            self.cap[g] = [cap[: end, end].tolist() for end in ends]
            finite = cap[np.triu_indices(L + 1, 1)]
            finite = finite[(finite < L) & (finite >= 1)]
            if finite.size:
                binding = max(binding, int(finite.max()))
            for link in (LINK_NONE, LINK_INTRA, LINK_INTER):
                comm = np.array(
                    [link_seconds(out[end], link, cluster.intra_node_bandwidth, cluster.inter_node_bandwidth) for end in ends]
                )
                table = compute / g + comm[None, :]
                self.cost_stack[g, link] = np.where(below, -INF, table)
                per_end = [table[: end, end].tolist() for end in ends]
                self.cost[g].append(per_end)
                self.neg_cost[g].append([[-v for v in row] for row in per_end])
                # Only real stages are bottleneck candidates: the last stage has no link, others have one.
                upper = np.triu_indices(L + 1, 1)
                real = (upper[1] == L) if link == LINK_NONE else (upper[1] < L)
                keep = (cap[upper] >= 1) & real
                values.append(table[upper][keep])
                starts.append(upper[0][keep])
                stage_ends.append(upper[1][keep])
                widths.append(np.full(int(keep.sum()), g))
        # In-flight counts >= this behave alike for memory (no stage's limit binds beyond it).
        self.binding_in_flight = binding
        # Every real stage sorted by time: the bottleneck candidates W, and for each W the stages
        # ("markers") whose time is exactly W.
        all_costs = np.concatenate(values)
        order = np.argsort(all_costs, kind="stable")
        self.marker_costs = all_costs[order]
        self.marker_starts = np.concatenate(starts)[order]
        self.marker_ends = np.concatenate(stage_ends)[order]
        self.marker_gpus = np.concatenate(widths)[order]
        self.candidates = np.unique(self.marker_costs)
        self.total_compute = float(arrays.compute[-1])
        # Every node boundary costs at least this much (the cheapest boundary tensor, cross-node).
        boundaries = arrays.output_bytes[:-1]
        self.min_cross_link = (
            link_seconds(float(boundaries.min()), LINK_INTER, cluster.intra_node_bandwidth, cluster.inter_node_bandwidth)
            if boundaries.size
            else 0.0
        )

    def first_starts_within(self, limit: float) -> list[list[list[int]]]:
        """``[g][link][end]``: ``first_start_within`` for every stage end at once (costs grow as
        start shrinks, so the first start with w <= limit is the count of starts with w > limit)."""
        return (self.cost_stack > limit).sum(axis=2).tolist()

    def compress(self, placed: int) -> int:
        """Memo key for ``placed`` stages: counts past the binding limit behave alike (0 stays 0)."""
        return min(placed, max(self.binding_in_flight, 1))

    def first_start_within(self, g: int, link: int, end: int, limit: float) -> int:
        """Smallest start with cost(start, end) <= limit (costs grow as start shrinks)."""
        return bisect.bisect_left(self.neg_cost[g][link][end], -limit)

    def first_start_fitting(self, g: int, end: int, in_flight: int) -> int:
        """Smallest start whose stage keeps ``in_flight`` microbatches within memory."""
        return bisect.bisect_left(self.cap[g][end], in_flight)


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


def stage_seconds_of(profile: ModelProfile, cluster: ClusterSpec, stages: Sequence[StageSpec]) -> list[float]:
    """w_i of every stage of a layout (compute / g + boundary transfer), per the cost model."""
    arrays = ProfileArrays(profile)
    result = []
    for stage, link in zip(stages, _stage_links(stages)):
        out = arrays.output_bytes[stage.end - 1]
        comm = link_seconds(out, link, cluster.intra_node_bandwidth, cluster.inter_node_bandwidth)
        result.append(arrays.compute_s(stage.start, stage.end) / stage.gpus + comm)
    return result


def stage_memories_of(profile: ModelProfile, stages: Sequence[StageSpec]) -> list[float]:
    arrays = ProfileArrays(profile)
    S = len(stages)
    return [
        arrays.state_bytes(s.start, s.end) + arrays.activation_bytes(s.start, s.end) * (S - i) / s.gpus
        for i, s in enumerate(stages)
    ]


def make_template(
    profile: ModelProfile, cluster: ClusterSpec, stages: Sequence[StageSpec], reference_microbatches_per_stage: int
) -> PipelineTemplate:
    """A template from a layout, with its cost-model figures computed from scratch."""
    stages = tuple(stages)
    seconds = stage_seconds_of(profile, cluster, stages)
    m = reference_microbatches_per_stage * len(stages)
    return PipelineTemplate(
        num_nodes=stages[-1].node + 1,
        stages=stages,
        stage_seconds=tuple(seconds),
        stage_memory_bytes=tuple(stage_memories_of(profile, stages)),
        reference_microbatches=m,
        reference_iteration_s=pipeline_iteration_time(seconds, m),
    )


def _one_stage_per_node(table: _StageTable, gpus: int, max_nodes: int) -> dict[int, list[tuple[int, int, int]]]:
    """For every n, the layout with one stage of all G GPUs per node that minimises the slowest
    stage (memory-feasible), right to left as the DPs return them. A quick upper bound that
    seeds both searches' budgets; the searches then only look for strictly better layouts."""
    L, G = table.num_layers, gpus
    cost = np.full((L + 1, L + 1, 2), INF)  # [start, end, last?]
    cap = np.zeros((L + 1, L + 1))
    for end in range(1, L + 1):
        cost[:end, end, 0] = table.cost[G][LINK_INTER][end]
        cost[:end, end, 1] = table.cost[G][LINK_NONE][end]
        cap[:end, end] = table.cap[G][end]
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


def _bottleneck_dp(table: _StageTable, gpus: int, max_nodes: int) -> dict[int, float]:
    """Smallest achievable slowest-stage time for every node count (INF where nothing fits).

    Branch and bound like the main DP: a sub-search only looks for values below its budget and
    is memoised as a lower bound otherwise. The slowest stage of [0, a) is at least its compute
    spread over the GPUs still free (a stage of g GPUs needs w >= compute / g).
    """
    memo: dict[tuple[int, int, int, int], tuple[float, bool]] = {}
    G = gpus
    compute = table.arrays.compute.tolist()
    compress = [table.compress(j) for j in range(table.num_layers + 2)]
    cost, cap = table.cost, table.cap
    bisect_left = bisect.bisect_left

    def best(a: int, j: int, nl: int, h: int, budget: float) -> float:
        if a == 0:
            return 0.0 if nl == 0 and h == G else INF
        if nl + (1 if h < G else 0) > a:
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
    for n in range(1, max_nodes + 1):
        bound = max(_layout_seconds(table, seeds[n], G)) if n in seeds else INF
        # Search strictly below the seed; the seed itself is the answer if nothing beats it.
        found = best(table.num_layers, 0, n, G, bound)
        result[n] = found if found < bound else bound
    return result


def _layout_seconds(table: _StageTable, layout: list[tuple[int, int, int]], gpus: int) -> list[float]:
    """w of every stage of a right-to-left layout (node changes implied by GPU counts)."""
    stages = _to_stages(layout, gpus)
    links = _stage_links(stages)
    return [table.cost[s.gpus][link][s.end][s.start] for s, link in zip(stages, links)]


def _solve_for_threshold(
    table: _StageTable,
    gpus: int,
    W: float,
    r: int,
    budgets: dict[int, float],
    markers: set[tuple[int, int, int]] | None = None,
) -> dict[int, tuple[float, list[tuple[int, int, int]]]]:
    """Exact DP for one bottleneck value W: the best T among layouts whose slowest stage is W.

    Branch and bound: ``budgets[n]`` is the best T already known for n nodes, and only layouts
    strictly below it matter. A sub-search that cannot beat its budget (by the bound below)
    stops and is memoised as a lower bound, re-searched only if a larger budget asks again.
    ``markers`` (start, end, gpus), if given, are the only stages allowed as the bottleneck.
    Layouts are returned right to left as (start, end, gpus); node changes follow from the GPU
    counts (a node closes when its GPUs are used up).
    """
    G = gpus
    # key -> (value, exact, choice); inexact values are lower bounds.
    memo: dict[tuple[int, int, int, int, int], tuple[float, bool, Any]] = {}
    rW = r * W
    r1W = (r - 1) * W
    compute = table.arrays.compute.tolist()
    per_stage_compute = W * G
    cross = table.min_cross_link

    compress = [table.compress(j) for j in range(table.num_layers + 2)]
    cost, cap = table.cost, table.cap
    bisect_left, bisect_right = bisect.bisect_left, bisect.bisect_right

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
            links_left = nl2 * cross
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
                if p2:
                    lower = compute_per_gpu[start] + links_left + stages * rW
                else:
                    lower = 2 * (compute_per_gpu[start] + links_left) + stages * r1W - W
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
            start, g, p2 = memo[(a, table.compress(j), nl, h, p)][2]
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


def _to_stages(layout_right_to_left: list[tuple[int, int, int]], gpus: int) -> list[StageSpec]:
    stages = []
    node, offset = 0, 0
    for start, end, g in reversed(layout_right_to_left):
        if offset + g > gpus:
            node, offset = node + 1, 0
        stages.append(StageSpec(start=start, end=end, node=node, gpu_offset=offset, gpus=g))
        offset += g
    return stages


def _check_inputs(cluster: ClusterSpec, fault_tolerance: int, r: int, max_gpus: int | None) -> int:
    if cluster.nodes <= 0 or cluster.gpus_per_node <= 0:
        raise PlanningError(f"cluster.nodes={cluster.nodes} and cluster.gpus_per_node={cluster.gpus_per_node} must be > 0")
    if fault_tolerance < 0:
        raise PlanningError(f"job.fault_tolerance={fault_tolerance} must be >= 0")
    if r <= 0:
        raise PlanningError(f"planner.reference_microbatches_per_stage={r} must be > 0")
    if max_gpus is not None and max_gpus <= 0:
        raise PlanningError(f"planner.max_gpus_per_stage={max_gpus} must be > 0 (or null for all GPUs of a node)")
    return min(cluster.gpus_per_node, max_gpus) if max_gpus else cluster.gpus_per_node


def _no_fit_message(profile: ModelProfile, cluster: ClusterSpec, up_to: int) -> str:
    largest = max(profile.layers, key=lambda layer: layer.param_bytes)
    return (
        f"no layout of {profile.model} ({profile.num_layers} layers, {profile.param_bytes / 1e9:.2f} GB of "
        f"parameters) fits on up to {up_to} nodes of {cluster.gpus_per_node} devices with "
        f"{cluster.device_memory_bytes / 1e9:.2f} GB each (16 bytes/parameter plus activations; the "
        f"largest layer, {largest.name}, has {largest.param_bytes / 1e9:.3f} GB of parameters); raise "
        "cluster.device_memory_gb or cluster.nodes, or lower job.microbatch_size"
    )


class _DeepRecursion:
    """The DPs recurse once per stage; allow as many stages as layers (restored on exit)."""

    def __init__(self, layers: int):
        self.needed = 20 * layers + 1000

    def __enter__(self) -> None:
        self.saved = sys.getrecursionlimit()
        sys.setrecursionlimit(max(self.saved, self.needed))

    def __exit__(self, *exc: object) -> None:
        sys.setrecursionlimit(self.saved)


def _feasibility(profile: ModelProfile, cluster: ClusterSpec, stage_gpus: int) -> tuple[_StageTable, dict[int, float], int]:
    table = _StageTable(profile, cluster, stage_gpus)
    up_to = min(cluster.nodes, profile.num_layers)
    with _DeepRecursion(profile.num_layers):
        bottleneck = _bottleneck_dp(table, cluster.gpus_per_node, up_to)
    feasible = [n for n in range(1, up_to + 1) if bottleneck[n] < INF]
    if not feasible:
        raise PlanningError(_no_fit_message(profile, cluster, up_to))
    return table, bottleneck, feasible[0]


def min_nodes(
    profile: ModelProfile, cluster: ClusterSpec, *, max_gpus_per_stage: int | None = None, fault_tolerance: int = 0
) -> int:
    """n0: the fewest nodes with a memory-feasible template (PlanningError if none fits)."""
    stage_gpus = _check_inputs(cluster, fault_tolerance, 1, max_gpus_per_stage)
    return _feasibility(profile, cluster, stage_gpus)[2]


def generate_templates(
    profile: ModelProfile,
    cluster: ClusterSpec,
    fault_tolerance: int,
    *,
    reference_microbatches_per_stage: int = 4,
    max_gpus_per_stage: int | None = None,
) -> TemplateSet:
    """The best template for every node count in [n0, N - f*n0] (exact for the cost model)."""
    r = reference_microbatches_per_stage
    stage_gpus = _check_inputs(cluster, fault_tolerance, r, max_gpus_per_stage)
    G = cluster.gpus_per_node
    table, bottleneck, n0 = _feasibility(profile, cluster, stage_gpus)
    f = fault_tolerance
    max_nodes = cluster.nodes - f * n0
    if max_nodes < n0:
        raise PlanningError(
            f"f={f} needs {f + 1} pipelines of at least n0={n0} nodes = {(f + 1) * n0} nodes; "
            f"cluster.nodes={cluster.nodes}"
        )
    wanted = [n for n in bottleneck if n <= max_nodes and bottleneck[n] < INF]
    with _DeepRecursion(profile.num_layers):
        best = _sweep_thresholds(table, G, r, wanted, bottleneck)
    templates = {}
    for n, (value, layout) in sorted(best.items()):
        template = make_template(profile, cluster, _to_stages(layout, G), r)
        templates[n] = template
    return TemplateSet(
        min_nodes=n0,
        max_nodes=max_nodes,
        templates=templates,
        num_layers=profile.num_layers,
        gpus_per_node=G,
        layer_param_bytes=tuple(layer.param_bytes for layer in profile.layers),
        intra_node_bandwidth=cluster.intra_node_bandwidth,
        inter_node_bandwidth=cluster.inter_node_bandwidth,
    )


def _sweep_thresholds(
    table: _StageTable, gpus: int, r: int, wanted: Sequence[int], bottleneck: dict[int, float]
) -> dict[int, tuple[float, list[tuple[int, int, int]]]]:
    """Try every distinct stage time W as the bottleneck, ascending, until the bound stops it."""
    candidates = table.candidates
    total_per_gpu = table.total_compute / gpus
    cross = table.min_cross_link
    best: dict[int, tuple[float, list[tuple[int, int, int]]]] = {}
    for n, layout in _one_stage_per_node(table, gpus, max(wanted, default=0)).items():
        if n in wanted:
            seconds = _layout_seconds(table, layout, gpus)
            best[n] = (pipeline_iteration_time(seconds, r * len(seconds)), layout)

    def least_sum(n: int) -> float:
        """sum_i w_i >= compute / G plus one cross-node boundary between consecutive nodes."""
        return total_per_gpu + (n - 1) * cross

    def lower_bound(n: int, W: float) -> float:
        return max(2 * least_sum(n) + ((r - 1) * n - 1) * W, ((r - 1) * n + 1) * W)

    def window(n: int) -> tuple[float, float]:
        """The W range [lo, hi] whose lower bound is still below the best T found for n.

        Each term of the bound is linear in W; a rising term caps W from above, a falling one
        (possible for small r) from below."""
        lo, hi = bottleneck[n], INF
        if n not in best:
            return lo, hi
        target = best[n][0]
        for slope, offset in (((r - 1) * n - 1, 2 * least_sum(n)), ((r - 1) * n + 1, 0.0)):
            if slope > 0:
                hi = min(hi, (target - offset) / slope)
            elif slope < 0:
                lo = max(lo, (target - offset) / slope)
            elif offset >= target:
                return INF, -INF
        return lo, hi

    def first_needed(n: int, start: int) -> int | None:
        lo, hi = window(n)
        i = max(start, int(np.searchsorted(candidates, lo, side="left")))
        target = best.get(n, (INF,))[0]
        while i < len(candidates) and candidates[i] <= hi:
            if lower_bound(n, candidates[i]) < target:  # (guards float rounding at the ends)
                return i
            i += 1
        return None

    index = 0
    while True:
        # The next candidate W that some node count still needs.
        needed = [i for i in (first_needed(n, index) for n in wanted) if i is not None]
        if not needed:
            break
        next_index = min(needed)
        W = float(candidates[next_index])
        budgets = {}
        for n in wanted:
            lo, hi = window(n)
            if bottleneck[n] <= W and lo <= W <= hi and lower_bound(n, W) < best.get(n, (INF,))[0]:
                budgets[n] = best.get(n, (INF,))[0]
        markers = _promising_markers(table, W, r, budgets, total_per_gpu * gpus, gpus)
        index = next_index + 1
        if not markers:
            continue
        for n, (value, layout) in _solve_for_threshold(table, gpus, W, r, budgets, markers).items():
            if n not in best or value < best[n][0]:
                best[n] = (value, layout)
    return best


def _promising_markers(
    table: _StageTable, W: float, r: int, budgets: dict[int, float], total_compute: float, gpus: int
) -> set[tuple[int, int, int]]:
    """Stages of time exactly W that could still be the bottleneck of a better layout.

    From T = ((r-1)S + 1) W + k W + sum_{i<k} w_i + 2 sum_{i>k} w_i with S >= n stages (n + 1 if
    the marker leaves GPUs of its node to another stage): the k stages left of a marker [s, e)
    each do at most W*G of compute, so k >= C(0, s) / (W G), and the sums are at least the
    compute on each side divided by G.
    """
    lo = int(np.searchsorted(table.marker_costs, W, side="left"))
    hi = int(np.searchsorted(table.marker_costs, W, side="right"))
    if not budgets or lo == hi:
        return set()
    compute = table.arrays.compute
    starts = table.marker_starts[lo:hi]
    ends = table.marker_ends[lo:hi]
    left = compute[starts]
    right = total_compute - compute[ends]
    widths = table.marker_gpus[lo:hi]
    k_min = np.maximum(np.ceil(left / (W * gpus) - 1e-9), (starts > 0).astype(float))
    # A marker narrower than a node shares it with another stage: one stage more than nodes.
    extra_stages = (widths < gpus).astype(float)
    base = (k_min + 1) * W + left / gpus + 2 * right / gpus + (r - 1) * extra_stages * W
    keep = np.zeros(hi - lo, dtype=bool)
    for n, budget in budgets.items():
        keep |= base + (r - 1) * n * W < budget
    return {(int(a), int(b), int(g)) for a, b, g in zip(starts[keep], ends[keep], widths[keep])}

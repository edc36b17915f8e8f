"""Instantiation: cover the live nodes with template pipelines and split the batch over them.

Predicted iteration time of a plan with k pipelines (documented in ``oobleck.planning.cost``):

    V = max_p [ T_p(m_p) + intra_p ] + ring(k, X)

``T_p(m)`` is ``pipeline_time`` of pipeline p's template with m microbatches; ``intra_p`` is the
slowest in-node all-reduce among p's stages (a stage of g devices reduces its parameters'
gradients over g devices); the cross-pipeline ring all-reduce starts when the slowest pipeline
is done and moves, on the busiest node, ``X`` = the largest parameter bytes one node holds in any
chosen pipeline (every layer's gradient is reduced among the k pipelines that hold it).

Batch distribution: each ``T_p`` is nondecreasing in m, so the min-max integer split is exact
with a bisection on the finishing time followed by a greedy fill (no MINLP solver). Choosing the
pipelines is exact and polynomial: for every pipeline count k and every cap X on bytes per node,
a bisection on the finishing time t asks a knapsack DP "can k templates with sum of nodes N
take M microbatches by time t?" (each template's capacity at t is its largest m with
``T(m) + intra <= t``); no enumeration of template multisets.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np

from oobleck.errors import PlanningError
from oobleck.planning.cost import (
    _exact_cached,
    bottleneck_index,
    pipeline_iteration_time,
    pipeline_time,
    ring_allreduce_seconds,
)
from oobleck.planning.plan import ExecutionPlan, PipelineInstance, PipelineTemplate
from oobleck.planning.templates import TemplateSet

# Bisection on a finishing time stops at this relative width; the result is then made exact by
# the greedy fill (distribution) or is optimal to within this tolerance (template choice).
RELATIVE_TOLERANCE = 1e-12
MAX_BISECTION_STEPS = 200


class _PipelineCurve:
    """``T(m) + offset`` of one pipeline and its inverse (largest m finishing by a time)."""

    def __init__(self, stage_seconds: Sequence[float], offset: float = 0.0):
        self.w = tuple(float(x) for x in stage_seconds)
        self.S = len(self.w)
        self.offset = offset
        k = bottleneck_index(self.w)
        self.slope = self.w[k]
        # Eq. 1-4 for m >= S is linear: intercept + slope * m.
        self.intercept = sum(self.w) + (k - self.S - 1) * self.slope + sum(self.w[k:]) + offset
        self.at_stages = pipeline_iteration_time(self.w, self.S) + offset

    def time(self, m: int) -> float:
        if m >= self.S:
            return self.intercept + self.slope * m  # Eq. 1-4, linear in m
        return pipeline_time(self.w, m) + self.offset if m > 0 else 0.0

    def lower_bound(self, m: int) -> float:
        """A cheap lower bound of ``time(m)`` (no schedule simulation)."""
        if m >= self.S:
            return self.time(m)
        return min(max(sum(self.w), m * self.slope), self.at_stages - self.offset) + self.offset

    def capacity(self, t: float) -> int:
        """Largest m >= 0 with time(m) <= t."""
        if t >= self.at_stages:
            m = int(math.floor((t - self.intercept) / self.slope))
            m = max(m, self.S)
            while self.intercept + self.slope * (m + 1) <= t:  # float rounding of the division
                m += 1
            while m > self.S and self.intercept + self.slope * m > t:
                m -= 1
            return m
        # Below m = S: the exact 1F1B makespan, nondecreasing in m; bisect on it. Cheap bounds
        # first: sum(w) and m * w* <= makespan <= min(m * sum(w), (m + S - 1) * w*) (the latter:
        # every stage slowed to the slowest; a longest path only grows with durations).
        budget = t - self.offset
        total = sum(self.w)
        if budget < total:
            return 0
        hi = min(self.S - 1, int(budget // self.slope))
        lo = max(1, min(hi, max(int(budget // total), int(budget // self.slope) - self.S + 1)))
        while lo > 1 and min(lo * total, (lo + self.S - 1) * self.slope) > budget:  # float safety
            lo -= 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _exact_cached(self.w, mid) + self.offset <= t:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _min_max_split(curves: Sequence[_PipelineCurve], total: int) -> list[int]:
    P = len(curves)
    if total == P:
        return [1] * P
    lo, hi = 0.0, max(c.time(total) for c in curves)

    def start(t: float) -> list[int]:
        return [max(1, c.capacity(t)) for c in curves]

    # Invariant: sum(start(lo)) < total <= sum(start(hi)); so lo is below the optimum.
    for _ in range(MAX_BISECTION_STEPS):
        if hi - lo <= RELATIVE_TOLERANCE * hi:
            break
        mid = (lo + hi) / 2
        if sum(start(mid)) < total:
            lo = mid
        else:
            hi = mid
    split = start(lo)
    # Greedy fill from below the optimum is exact for a min-max of nondecreasing functions.
    heap = [(curves[p].time(split[p] + 1), p) for p in range(P)]
    heapq.heapify(heap)
    for _ in range(total - sum(split)):
        _, p = heapq.heappop(heap)
        split[p] += 1
        heapq.heappush(heap, (curves[p].time(split[p] + 1), p))
    return split


def distribute_microbatches(
    pipelines_stage_seconds: Sequence[Sequence[float]], total_microbatches: int, offsets: Sequence[float] | None = None
) -> list[int]:
    """Exact min-max split of ``total_microbatches`` (each pipeline >= 1) by ``pipeline_time``.

    ``offsets`` adds a per-pipeline constant (e.g. its in-node gradient all-reduce).
    """
    P = len(pipelines_stage_seconds)
    if P == 0:
        raise PlanningError("no pipelines to distribute microbatches over")
    if total_microbatches < P:
        raise PlanningError(
            f"{total_microbatches} microbatches cannot feed {P} pipelines (each needs at least one); "
            "raise job.global_batch_size or lower job.microbatch_size"
        )
    offsets = offsets if offsets is not None else [0.0] * P
    curves = [_PipelineCurve(w, o) for w, o in zip(pipelines_stage_seconds, offsets)]
    return _min_max_split(curves, total_microbatches)


def _node_param_bytes(template: PipelineTemplate, layer_param_bytes: Sequence[int]) -> list[int]:
    per_node = [0] * template.num_nodes
    for stage in template.stages:
        per_node[stage.node] += sum(layer_param_bytes[stage.start : stage.end])
    return per_node


def _intra_sync(template: PipelineTemplate, layer_param_bytes: Sequence[int], intra_bandwidth: float) -> float:
    return max(
        ring_allreduce_seconds(sum(layer_param_bytes[s.start : s.end]), s.gpus, intra_bandwidth) for s in template.stages
    )


class _Sync:
    """Gradient synchronisation figures of a template set for one cluster's bandwidths."""

    def __init__(self, templates: TemplateSet, intra_bandwidth: float, inter_bandwidth: float):
        bytes_ = templates.layer_param_bytes or (0,) * templates.num_layers
        self.inter = inter_bandwidth
        self.intra_of = {n: _intra_sync(t, bytes_, intra_bandwidth) for n, t in templates.templates.items()}
        self.node_bytes_of = {n: max(_node_param_bytes(t, bytes_)) for n, t in templates.templates.items()}

    def cross(self, pipelines: int, node_bytes: float) -> float:
        return ring_allreduce_seconds(node_bytes, pipelines, self.inter)


def plan_iteration_time(
    templates: Sequence[PipelineTemplate], microbatches: Sequence[int], sync: _Sync
) -> tuple[float, list[float]]:
    """V of the module docstring, and each pipeline's ``T_p(m_p) + intra_p``."""
    per_pipeline = [
        _PipelineCurve(t.stage_seconds, sync.intra_of[t.num_nodes]).time(m) for t, m in zip(templates, microbatches)
    ]
    node_bytes = max(sync.node_bytes_of[t.num_nodes] for t in templates)
    return max(per_pipeline) + sync.cross(len(templates), node_bytes), per_pipeline


def _best_multiset(
    templates: TemplateSet, nodes: int, microbatches: int, min_pipelines: int, sync: _Sync
) -> tuple[float, list[int]] | None:
    """Exact choice of template sizes (see module docstring); None if none covers ``nodes``."""
    sizes = [n for n in templates.sizes if n <= nodes]
    if not sizes:
        return None
    curves = {n: _PipelineCurve(templates[n].stage_seconds, sync.intra_of[n]) for n in sizes}
    max_pipelines = min(nodes // min(sizes), microbatches)
    node_caps = sorted(set(sync.node_bytes_of[n] for n in sizes))
    best: tuple[float, list[int]] | None = None
    counts = range(min_pipelines, max_pipelines + 1)
    # Lower bound on compute time with k pipelines: some pipeline takes >= ceil(M / k).
    floors = {k: min(curves[n].lower_bound(-(-microbatches // k)) for n in sizes) for k in counts}
    for x in node_caps:
        allowed = [n for n in sizes if sync.node_bytes_of[n] <= x]
        candidates = [k for k in counts if best is None or sync.cross(k, x) + floors[k] < best[0]]
        if best is not None and candidates:
            # One DP over every count at the most generous finishing time any candidate may use
            # (the cross-pipeline term grows with k) rules out most counts at once.
            generous = best[0] - min(sync.cross(k, x) for k in candidates)
            possible = _counts_reaching(curves, allowed, nodes, microbatches, max(candidates), generous)
            candidates = [k for k in candidates if possible[k]]
        for k in candidates:
            cross = sync.cross(k, x)
            if best is not None and cross + floors[k] >= best[0]:
                continue
            # Only a plan faster than the best so far matters: its compute must end by `limit`.
            limit = best[0] - cross if best is not None else None
            result = _solve_count(curves, allowed, nodes, microbatches, k, floors[k], limit)
            if result is None:
                continue
            t, multiset = result
            split_curves = [curves[n] for n in multiset]
            split = _min_max_split(split_curves, microbatches)
            value = max(c.time(m) for c, m in zip(split_curves, split)) + sync.cross(
                k, max(sync.node_bytes_of[n] for n in multiset)
            )
            if best is None or value < best[0]:  # ties keep the first found
                best = (value, multiset)
    return best


def _capacities(curves: Sequence[_PipelineCurve], t: float, microbatches: int) -> np.ndarray:
    """Microbatches each template can take by time t (at most all of them). A template that
    cannot take one is out: every pipeline needs >= 1, so it gets a value no choice survives."""
    caps = np.array([c.capacity(t) for c in curves], dtype=np.int64)
    return np.where(caps >= 1, np.minimum(caps, microbatches), -(1 << 40))


def _counts_reaching(
    curves: dict[int, _PipelineCurve], allowed: Sequence[int], nodes: int, microbatches: int, max_count: int, t: float
) -> list[bool]:
    """For every count c <= max_count: can c allowed templates covering ``nodes`` take all by time t?"""
    values = _capacities([curves[n] for n in allowed], t, microbatches)
    return [False] + [total >= microbatches for total in _Knapsack(allowed, nodes).totals(values, max_count)]


class _Knapsack:
    """Max total capacity of c templates whose sizes sum to ``nodes``", for many capacity vectors
    and counts: the gather pattern (which sub-total each size extends) is built once."""

    NEG = -(1 << 60)

    def __init__(self, allowed: Sequence[int], nodes: int):
        self.sizes = np.array(allowed)
        self.nodes = nodes
        # [size, total] -> total - size, or the padding slot ``nodes + 1`` (always NEG).
        index = np.arange(nodes + 1)[None, :] - self.sizes[:, None]
        self.index = np.where(index >= 0, index, nodes + 1)

    def totals(self, values: np.ndarray, count: int, picks: list[np.ndarray] | None = None) -> list[int]:
        """The max total for c = 1..count templates (NEG // 2 or less where none covers
        ``nodes``); with ``picks``, the size index chosen at every step is appended to it (the
        first maximum: deterministic)."""
        dp = np.full(self.nodes + 2, self.NEG, dtype=np.int64)
        dp[0] = 0
        column, columns, totals = values[:, None], np.arange(self.nodes + 1), []
        for _ in range(count):
            candidates = dp[self.index] + column
            if picks is None:
                dp[: self.nodes + 1] = candidates.max(axis=0)
            else:
                pick = np.argmax(candidates, axis=0)
                dp[: self.nodes + 1] = candidates[pick, columns]
                picks.append(pick)
            dp[: self.nodes + 1][dp[: self.nodes + 1] <= self.NEG // 2] = self.NEG
            totals.append(int(dp[self.nodes]))
        return totals

    def choice(self, values: np.ndarray, count: int) -> list[int]:
        """The template sizes of a best choice of ``count`` templates."""
        picks: list[np.ndarray] = []
        self.totals(values, count, picks)
        multiset, n = [], self.nodes
        for pick in reversed(picks):
            size = int(self.sizes[pick[n]])
            multiset.append(size)
            n -= size
        return multiset


def _solve_count(
    curves: dict[int, _PipelineCurve],
    allowed: Sequence[int],
    nodes: int,
    microbatches: int,
    count: int,
    floor: float = 0.0,
    limit: float | None = None,
) -> tuple[float, list[int]] | None:
    """Least finishing time t at which ``count`` allowed templates covering ``nodes`` take all
    microbatches; ``floor`` is a known lower bound of t, and None is returned if t > ``limit``.

    Feasibility at t depends only on every template's capacity at t, a step function that only
    changes where some ``T(m) + intra`` equals t. So after each test the bracket snaps to those
    breakpoints: a feasible t falls to the latest time any template needs for its capacity there,
    an infeasible one rises to the next time any template's capacity grows. The search ends on
    the exact least t, usually in far fewer steps than plain bisection.
    """
    if not allowed or (limit is not None and limit <= floor):
        return None
    knapsack = _Knapsack(allowed, nodes)
    chosen = [curves[n] for n in allowed]

    def capacities(t: float) -> np.ndarray:
        return _capacities(chosen, t, microbatches)

    def feasible(caps: np.ndarray) -> bool:
        if count * int(caps.max()) < microbatches:
            return False  # even the most capable template, k times, cannot take them all
        return knapsack.totals(caps, count)[-1] >= microbatches

    def latest_needed(caps: np.ndarray) -> float:
        """The earliest time at which every template already has ``caps`` (a breakpoint)."""
        return max(c.time(int(m)) if m >= 1 else 0.0 for c, m in zip(chosen, caps))

    def next_change(caps: np.ndarray) -> float:
        """The earliest time at which some template's capacity exceeds ``caps``."""
        return min(c.time(int(max(m, 0)) + 1) for c, m in zip(chosen, caps))

    hi = max(curves[n].time(microbatches) for n in allowed)
    if limit is not None:
        hi = min(hi, limit)
    caps = capacities(hi)
    if not feasible(caps):
        return None
    hi = latest_needed(caps)
    lo = floor * (1 - RELATIVE_TOLERANCE)  # the optimum is >= lo
    for _ in range(MAX_BISECTION_STEPS):
        if hi - lo <= RELATIVE_TOLERANCE * hi:
            break
        mid = (lo + hi) / 2
        mid_caps = capacities(mid)
        if feasible(mid_caps):
            caps, hi = mid_caps, latest_needed(mid_caps)
        else:
            lo = next_change(mid_caps)
            if lo >= hi:
                break  # nothing changes between mid and hi: hi is the optimum
    return hi, knapsack.choice(caps, count)


def instantiate(
    templates: TemplateSet,
    nodes: Sequence[int],
    global_batch_size: int,
    microbatch_size: int,
    fault_tolerance: int,
    *,
    intra_node_bandwidth: float | None = None,
    inter_node_bandwidth: float | None = None,
) -> ExecutionPlan:
    """The best plan over ``nodes`` (live node ids; sorted order is assignment order)."""
    if microbatch_size <= 0 or global_batch_size <= 0 or global_batch_size % microbatch_size:
        raise PlanningError(
            f"job.global_batch_size={global_batch_size} must be a positive multiple of "
            f"job.microbatch_size={microbatch_size}"
        )
    node_ids = sorted(nodes)
    if len(set(node_ids)) != len(node_ids):
        raise PlanningError(f"node ids {node_ids} contain duplicates")
    N = len(node_ids)
    M = global_batch_size // microbatch_size
    f = fault_tolerance
    n0 = templates.min_nodes
    if N < (f + 1) * n0:
        raise PlanningError(f"f={f} needs {f + 1} pipelines of at least n0={n0} nodes = {(f + 1) * n0} nodes; cluster.nodes={N}")
    if M < f + 1:
        raise PlanningError(
            f"{M} microbatches (job.global_batch_size={global_batch_size} / job.microbatch_size={microbatch_size}) "
            f"are fewer than the f+1={f + 1} pipelines; raise the batch or lower the microbatch size"
        )
    sync = _Sync(templates, *_resolve_bandwidths(templates, intra_node_bandwidth, inter_node_bandwidth))
    chosen = _best_multiset(templates, N, M, f + 1, sync)
    if chosen is None:
        raise PlanningError(
            f"no combination of at least {f + 1} pipelines from templates of {list(templates.sizes)} nodes "
            f"covers exactly {N} nodes with at most {M} microbatches; check job.fault_tolerance and the cluster size"
        )
    return build_plan(templates, chosen[1], node_ids, global_batch_size, microbatch_size, f, sync)


def _resolve_bandwidths(templates: TemplateSet, intra: float | None, inter: float | None) -> tuple[float, float]:
    return (
        intra if intra is not None else templates.intra_node_bandwidth,
        inter if inter is not None else templates.inter_node_bandwidth,
    )


def build_plan(
    templates: TemplateSet,
    pipeline_sizes: Sequence[int],
    node_groups_or_ids: Sequence[int] | Sequence[Sequence[int]],
    global_batch_size: int,
    microbatch_size: int,
    fault_tolerance: int,
    sync: _Sync | None = None,
) -> ExecutionPlan:
    """A plan from template sizes and nodes (a flat sorted id list, or one id list per pipeline).

    Flat ids are dealt out in pipeline order, larger pipelines first. Microbatches are split by
    the exact min-max distribution; offsets are contiguous in pipeline order.
    """
    if sync is None:
        sync = _Sync(templates, templates.intra_node_bandwidth, templates.inter_node_bandwidth)
    M = global_batch_size // microbatch_size
    if node_groups_or_ids and isinstance(node_groups_or_ids[0], int):
        sizes = sorted(pipeline_sizes, reverse=True)
        ids = list(node_groups_or_ids)
        groups, offset = [], 0
        for size in sizes:
            groups.append(tuple(ids[offset : offset + size]))
            offset += size
    else:
        groups = [tuple(g) for g in node_groups_or_ids]  # type: ignore[union-attr]
        sizes = [len(g) for g in groups]
    chosen = [templates[n] for n in sizes]
    curves = [_PipelineCurve(t.stage_seconds, sync.intra_of[t.num_nodes]) for t in chosen]
    split = _min_max_split(curves, M)
    value, per_pipeline = plan_iteration_time(chosen, split, sync)
    pipelines, first = [], 0
    for index, (template, group, m, t) in enumerate(zip(chosen, groups, split, per_pipeline)):
        pipelines.append(
            PipelineInstance(
                index=index, template=template, nodes=group, microbatches=m, first_microbatch=first, predicted_iteration_s=t
            )
        )
        first += m
    return ExecutionPlan(
        pipelines=tuple(pipelines),
        num_layers=templates.num_layers,
        global_batch_size=global_batch_size,
        microbatch_size=microbatch_size,
        fault_tolerance=fault_tolerance,
        gpus_per_node=templates.gpus_per_node,
        predicted_iteration_s=value,
    )

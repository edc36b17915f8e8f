"""Instantiation: cover the live nodes with template pipelines and split the batch over them.

Predicted iteration time of a plan with k pipelines (documented in ``oobleck.planning.pipeline_cost``):

    V = max_p [ T_p(m_p) + intra_p ] + ring(k, X)

``T_p(m)`` is ``pipeline_time`` of pipeline p's template with m microbatches; ``intra_p`` is the
slowest in-node all-reduce among p's stages (a stage of g devices reduces its parameters'
gradients over g devices); the cross-pipeline ring all-reduce starts when the slowest pipeline
is done and moves, on the busiest node, ``X`` = the largest parameter bytes one node holds in any
chosen pipeline (every layer's gradient is reduced among the k pipelines that hold it).

Batch distribution: each ``T_p`` is nondecreasing in m, so the min-max integer split is exact
with a search on the finishing time (no MINLP solver). Choosing the pipelines is exact and
polynomial: for every pipeline count k and every cap X on bytes per node, a search on the
finishing time t asks a knapsack DP "can k templates with sum of nodes N take M microbatches by
time t?" (each template's capacity at t is its largest m with ``T(m) + intra <= t``); no
enumeration of template multisets. Both searches test feasibility only where it can change (at
some ``T(m) + intra``), so they end on the exact optimum, at any m including m <= S; and every
time and capacity comes from one function (``_PipelineCurve``), so they agree to the last bit.

Speed without giving up exactness: the (X, k) pairs are taken best-first by lower bounds of
their value (some pipeline runs ceil(M / K) microbatches; the Eq. 1-4 lines with fractional
template counts, whose optimum uses at most two sizes; lazily, the same with integer
capacities), and the search stops at the first bound that cannot beat the best plan found, so
usually one or two pairs reach the knapsack (benchmarks/bench_planner.py measures it). The
bounds are computed by other float operations than the times, so they carry a relative slack.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from typing import cast

import numpy as np

from oobleck.errors import PlanningError
from oobleck.planning.outputs import ExecutionPlan, PipelineInstance, PipelineTemplate
from oobleck.planning.pipeline_cost import eq14_line, pipeline_time, ring_allreduce_seconds
from oobleck.planning.templates import TemplateSet

# Relative slack on cheap lower bounds of a time that are computed by other float operations than
# the time itself (a bound may only be used to rule things out, so it must never exceed the time).
BOUND_SLACK = 1e-9
# The knapsack adds up to M capacities of at most M each in int64, below its -2**60 sentinel:
# M * M must stay under 2**58, so at most 2**29 microbatches per iteration (536,870,912).
MAX_MICROBATCHES = 2**29
# ``relaxed_floor`` stops bisecting at this relative width (it returns the low end: still a bound).
RELAXED_PRECISION = 1e-6
# A guard against a search that fails to converge (each step halves the bracket, so about 60
# steps exhaust a double's precision); reaching it would be a bug, reported as such.
MAX_BISECTION_STEPS = 400
# Memoised results kept on one template set before they are all dropped (see ``_remember``).
MEMO_ENTRIES = 4096


class _PipelineCurve:
    """``T(m) + offset`` of one pipeline (``T = pipeline_time``) and its exact inverse.

    ``time`` is the only place a pipeline's time is computed, and ``capacity`` inverts it by
    evaluating ``time`` itself (an analytic guess is only a starting point): a capacity can never
    disagree with the time it stands for, whatever the rounding of the inputs.
    """

    def __init__(self, stage_seconds: Sequence[float], offset: float = 0.0):
        self.w = tuple(float(x) for x in stage_seconds)
        self.S = len(self.w)
        self.offset = float(offset)
        self.intercept, self.slope = eq14_line(self.w)
        self._below: dict[int, float] = {}  # time(m) for m < S (the exact makespan, computed lazily)

    def time(self, m: int) -> float:
        if m <= 0:
            return 0.0
        if m >= self.S:
            return (self.intercept + self.slope * m) + self.offset  # pipeline_time's own operations
        value = self._below.get(m)
        if value is None:
            value = self._below[m] = pipeline_time(self.w, m) + self.offset
        return value

    def lower_bound(self, m: int) -> float:
        """A lower bound of ``time(m)`` that never simulates the schedule. Below S the makespan is
        at least one microbatch's round trip (sum w), the slowest stage's m forwards and backwards
        (m w*), and Eq. 1-4 (never above the makespan, pipeline_cost.py), and time(m) is capped at time(S)."""
        if m <= 0 or m >= self.S:
            return self.time(m)
        total = sum(self.w)
        cheap = min(max(total, m * self.slope, self.intercept + self.slope * m), self.intercept + self.slope * self.S)
        return (cheap + self.offset) * (1 - BOUND_SLACK)

    def capacity(self, t: float, limit: int) -> int:
        """The largest m in ``[0, limit]`` with ``time(m) <= t``."""
        if limit <= 0 or self.time(1) > t:
            return 0
        if self.time(limit) <= t:
            return limit
        S = self.S
        if limit > S and self.time(S) <= t:
            # Eq. 1-4 is linear from S on: guess by division, then settle on time() itself.
            guess = (t - self.offset - self.intercept) / self.slope
            m = min(max(S, int(guess) if math.isfinite(guess) else limit), limit)
            while m < limit and self.time(m + 1) <= t:
                m += 1
            while self.time(m) > t:
                m -= 1
            return m
        lo, hi = 1, min(S, limit)  # time(lo) <= t < time(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.time(mid) <= t:
                lo = mid
            else:
                hi = mid
        return lo


def _min_max_split(curves: Sequence[_PipelineCurve], total: int) -> list[int]:
    """The exact min-max split of ``total`` microbatches, every pipeline taking at least one.

    The least finishing time t* is where ``sum_p max(1, capacity_p(t))`` first reaches ``total``;
    it is one of the times ``time_p(m)``, so the search snaps to those (``_least_time``). At t*
    the capacities may exceed ``total`` by increments that all finish exactly at t*; taking them
    back, latest first, leaves a split whose slowest pipeline finishes at t*.
    """
    P = len(curves)
    if total == P:
        return [1] * P

    def counts(t: float) -> list[int]:
        return [max(1, c.capacity(t, total)) for c in curves]

    # Every pipeline runs at least one microbatch, so nothing finishes before the slowest first one.
    first = max(c.time(1) for c in curves)
    best = _least_time(curves, total, counts, lambda caps: sum(caps) >= total, _line_estimate(curves, total), lo=first)
    assert best is not None  # every pipeline at ``total`` microbatches is always feasible
    split = counts(best)
    excess = sum(split) - total
    heap = [(-curves[p].time(split[p]), -p) for p in range(P) if split[p] > 1]
    heapq.heapify(heap)
    while excess > 0:
        _, negative = heapq.heappop(heap)
        p = -negative
        split[p] -= 1
        excess -= 1
        if split[p] > 1:
            heapq.heappush(heap, (-curves[p].time(split[p]), -p))
    return split


def _line_estimate(curves: Sequence[_PipelineCurve], total: int) -> float:
    """Where the pipelines' Eq. 1-4 lines together reach ``total`` microbatches: a first guess."""
    rate = sum(1.0 / c.slope for c in curves)
    return (total + sum((c.intercept + c.offset) / c.slope for c in curves)) / rate


def _least_time(
    curves, limit, counts, feasible, guess: float, lo: float = 0.0, hi: float | None = None
) -> float | None:
    """The least t with ``feasible(counts(t))``, where ``counts(t)`` is a vector of the curves'
    capacities (at most ``limit`` each), so feasibility only changes at some ``time(m)``.

    After each test the bracket snaps to those times: a feasible t falls to the latest time any
    curve needs for its count there, an infeasible one rises to the next time any count can grow.
    The search ends on the exact least t. ``hi`` (default: every curve at ``limit``) bounds it from
    above: None if even ``hi`` is infeasible. ``guess`` is tried first; while tests fail, the
    next one gallops upwards from the low end (the next possible time itself, then steps of one
    fastest microbatch, doubling), since callers' guesses and bounds are usually just below.
    """

    def latest_needed(caps: Sequence[int]) -> float:
        return max(c.time(int(m)) for c, m in zip(curves, caps))

    def next_change(caps: Sequence[int]) -> float:
        growing = [c.time(int(m) + 1) for c, m in zip(curves, caps) if m < limit]
        return min(growing) if growing else math.inf

    if hi is None:
        hi = max(c.time(limit) for c in curves)
    caps = counts(hi)
    if not feasible(caps):
        return None
    hi = latest_needed(caps)
    # Gallop: the next possible time itself first (step 0), then one fastest microbatch on, doubling.
    failures, unit, step = 0, min(c.slope for c in curves), 0.0
    mid = guess if lo < guess < hi else lo
    for _ in range(MAX_BISECTION_STEPS):
        if lo >= hi:
            return hi
        caps = counts(mid)
        if feasible(caps):
            hi = latest_needed(caps)
            step = math.inf  # bracketed: plain halving from now on
        else:
            lo = next_change(caps)
            failures += 1
            if step < math.inf:
                step = 0.0 if failures == 1 else unit * 2 ** (failures - 2)
        mid = min(lo + step, (lo + hi) / 2)
        if not lo < mid < hi:  # the bracket is down to neighbouring doubles: test its low end
            mid = lo
    raise PlanningError(f"finishing-time search did not converge within {MAX_BISECTION_STEPS} steps (a planner bug)")


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
        ring_allreduce_seconds(sum(layer_param_bytes[s.start : s.end]), s.gpus, intra_bandwidth)
        for s in template.stages
    )


class _Sync:
    """Gradient synchronisation figures of a template set for one cluster's bandwidths
    (``sync_of`` builds each once per template set and bandwidths)."""

    def __init__(self, templates: TemplateSet, intra_bandwidth: float, inter_bandwidth: float):
        bytes_ = templates.layer_param_bytes or (0,) * templates.num_layers
        self.intra = intra_bandwidth
        self.inter = inter_bandwidth
        # ``_intra_sync`` and ``_node_param_bytes`` of every template, each stage's bytes taken
        # from integer prefix sums (the same ints as summing its layers; a cold reconfiguration
        # builds this for every template size).
        prefix = list(itertools.accumulate(bytes_, initial=0))
        self.intra_of: dict[int, float] = {}
        self.node_bytes_of: dict[int, int] = {}
        for n, template in templates.templates.items():
            per_node = [0] * template.num_nodes
            reduce_s = []
            for stage in template.stages:
                held = prefix[stage.end] - prefix[stage.start]
                per_node[stage.node] += held
                reduce_s.append(ring_allreduce_seconds(held, stage.gpus, intra_bandwidth))
            self.intra_of[n] = max(reduce_s)
            self.node_bytes_of[n] = max(per_node)

    def cross(self, pipelines: int, node_bytes: float) -> float:
        return ring_allreduce_seconds(node_bytes, pipelines, self.inter)


def sync_of(
    templates: TemplateSet, intra_bandwidth: float | None = None, inter_bandwidth: float | None = None
) -> _Sync:
    """The template set's ``_Sync`` for these bandwidths (default: the set's own), built once."""
    intra, inter = _resolve_bandwidths(templates, intra_bandwidth, inter_bandwidth)
    key = ("sync", intra, inter)
    if key not in templates.memo:
        _remember(templates, key, _Sync(templates, intra, inter))
    return templates.memo[key]


def _remember(templates: TemplateSet, key: tuple, value) -> None:
    """Store a memoised result on the template set, dropping all of them past ``MEMO_ENTRIES``
    (a long simulation asks a few hundred distinct questions; this only bounds pathological use)."""
    if len(templates.memo) >= MEMO_ENTRIES:
        templates.memo.clear()
    templates.memo[key] = value


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
    templates: TemplateSet,
    nodes: int,
    microbatches: int,
    min_pipelines: int,
    sync: _Sync,
    fixed: Sequence[int] = (),
) -> tuple[float, list[int]] | None:
    """``_search_multiset``, memoised on the template set: it is a pure function of the set, the
    bandwidths behind ``sync`` and the other (hashable) arguments, and a reconfiguration asks it
    the same questions over and over (a fresh plan per node count, a regroup per intact sizes)."""
    key = ("multiset", sync.intra, sync.inter, nodes, microbatches, min_pipelines, tuple(sorted(fixed, reverse=True)))
    if key not in templates.memo:
        _remember(templates, key, _search_multiset(templates, nodes, microbatches, min_pipelines, sync, fixed))
    result = templates.memo[key]
    return None if result is None else (result[0], list(result[1]))  # a copy: callers may mutate it


def _search_multiset(
    templates: TemplateSet,
    nodes: int,
    microbatches: int,
    min_pipelines: int,
    sync: _Sync,
    fixed: Sequence[int] = (),
) -> tuple[float, list[int]] | None:
    """The exact best choice of template sizes covering ``nodes`` with at least ``min_pipelines``
    (and at most ``microbatches``) pipelines, always including the sizes in ``fixed``; its
    predicted iteration time first. None if no choice exists. See the module docstring.

    Every (cap X on bytes per node, count) pair gets a lower bound on its value; pairs are
    taken in the order of their bounds, first to tighten the bound (``relaxed_floor``, cheap),
    then to be solved exactly, and the search stops at the first bound that cannot beat the best
    plan found (ties keep the first found, so the choice is deterministic).
    """
    fixed = sorted(fixed, reverse=True)
    free = nodes - sum(fixed)
    sizes = [n for n in templates.sizes if n <= free]
    if free < 0 or (free > 0 and not sizes):
        return None
    curves = {n: _PipelineCurve(templates[n].stage_seconds, sync.intra_of[n]) for n in {*sizes, *fixed}}
    fixed_curves = [curves[n] for n in fixed]
    fixed_bytes = max((sync.node_bytes_of[n] for n in fixed), default=0)
    most_free = min(free // min(sizes), microbatches - len(fixed)) if free else 0
    counts = range(max(min_pipelines - len(fixed), 1 if free else 0), most_free + 1)
    if not counts:
        return None
    floors = _count_floors([curves[n] for n in sizes], sizes, fixed_curves, free, counts, microbatches)
    node_caps = sorted({max(fixed_bytes, sync.node_bytes_of[n]) for n in sizes}) or [fixed_bytes]
    pairs = []
    for index, x in enumerate(node_caps):
        allowed = [n for n in sizes if sync.node_bytes_of[n] <= x]
        if free and not allowed:
            continue
        most = min(free // min(allowed), microbatches - len(fixed)) if free else 0
        for c in counts:
            if c <= most:
                pairs.append((floors[c] + sync.cross(c + len(fixed), x), 0, index, c, floors[c]))
    heapq.heapify(pairs)
    searches: dict[int, _CountSearch] = {}
    best: tuple[float, list[int]] | None = None
    while pairs:
        bound, refined, index, c, floor = heapq.heappop(pairs)
        if best is not None and bound >= best[0]:
            break
        x = node_caps[index]
        if index not in searches:
            allowed = [n for n in sizes if sync.node_bytes_of[n] <= x]
            searches[index] = _CountSearch([curves[n] for n in allowed], allowed, fixed_curves, free, microbatches)
        search = searches[index]
        cross = sync.cross(c + len(fixed), x)
        # Only a plan faster than the best so far matters: its compute must end by `limit`.
        limit = best[0] - cross if best is not None else None
        if not refined:  # first a tighter bound (cheap), then back in line by it
            tighter = search.relaxed_floor(c, floor, limit)
            if tighter is not None:
                heapq.heappush(pairs, (tighter + cross, 1, index, c, tighter))
            continue
        result = search.solve(c, floor, limit)
        if result is None:
            continue
        t, chosen = result
        multiset = sorted([*fixed, *chosen], reverse=True)
        # The least t of this count is the min-max split time of the multiset it returns.
        value = t + sync.cross(len(multiset), max(sync.node_bytes_of[n] for n in multiset))
        if best is None or value < best[0]:
            best = (value, multiset)
    return best


def _count_floors(
    curves: Sequence[_PipelineCurve],
    sizes: Sequence[int],
    fixed: Sequence[_PipelineCurve],
    free: int,
    counts: range,
    microbatches: int,
) -> dict[int, float]:
    """For every count c of free pipelines, a lower bound on the finishing time of any choice of
    c templates covering ``free`` nodes (with the ``fixed`` pipelines) that takes M microbatches.

    Two bounds, the larger wins. (1) Some pipeline takes at least ceil(M / K) microbatches.
    (2) Every time is at least its Eq. 1-4 line ``a + s m`` (pipeline_cost.py), so by t a pipeline takes
    at most ``(t - a) / s``; with the counts of each size relaxed to fractions, the least t with
    ``sum_p (t - a_p) / s_p >= M`` is a linear-fractional program whose optimum sits on a vertex
    of {y >= 0 : sum y = c, sum n y = free} (``_two_sizes``).
    """
    a = np.array([c.intercept + c.offset for c in curves])
    s = np.array([c.slope for c in curves])
    base_u = sum(1.0 / c.slope for c in fixed)
    base_v = sum((c.intercept + c.offset) / c.slope for c in fixed)
    everyone = _CurveArrays([*curves, *fixed])
    floors = {}
    for c in counts:
        share = float(everyone.lower_bounds(-(-microbatches // (c + len(fixed)))).min())
        if c == 0:
            relaxed = (microbatches + base_v) / base_u
        else:
            vertices = _two_sizes(sizes, free, c)
            if vertices is None:
                relaxed = math.inf
            else:
                below, above, y_lo, y_hi = vertices
                rate = base_u + y_lo / s[below][:, None] + y_hi / s[above][None, :]
                work = (
                    microbatches
                    + base_v
                    + y_lo * (a[below] / s[below])[:, None]
                    + y_hi * (a[above] / s[above])[None, :]
                )
                relaxed = float(np.min(work / rate))
        floors[c] = max(share, relaxed * (1 - BOUND_SLACK))
    return floors


class _CurveArrays:
    """The figures ``lower_bound`` reads, of many curves as arrays (built once, read for every
    pipeline count)."""

    def __init__(self, curves: Sequence[_PipelineCurve]):
        self.a = np.array([c.intercept for c in curves])
        self.s = np.array([c.slope for c in curves])
        self.offset = np.array([c.offset for c in curves])
        self.stages = np.array([c.S for c in curves])
        self.total = np.array([sum(c.w) for c in curves])

    def lower_bounds(self, m: int) -> np.ndarray:
        """``lower_bound(m)`` of every curve at once (the same bounds, vectorised)."""
        a, s = self.a, self.s
        line = a + s * m
        below = np.minimum(np.maximum(np.maximum(self.total, m * s), line), a + s * self.stages)
        return np.where(m >= self.stages, line + self.offset, below + self.offset) * (1 - BOUND_SLACK)


def _two_sizes(sizes: Sequence[int] | np.ndarray, free: int, count: int):
    """The vertices of {y >= 0 : sum y = count, sum n y = free} over template sizes n: every pair
    of sizes on either side of free / count (a size equal to it pairs with itself), as index
    arrays ``below``, ``above`` and weight matrices ``y_lo``, ``y_hi`` [below, above]; None if
    no size is on one side."""
    n = np.asarray(sizes, dtype=np.float64)
    q = free / count
    below, above = np.flatnonzero(n <= q), np.flatnonzero(n >= q)
    if not (below.size and above.size):
        return None
    lo, hi = n[below][:, None], n[above][None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        y_lo = np.where(hi > lo, count * (hi - q) / (hi - lo), float(count))
    return below, above, y_lo, count - y_lo


class _Knapsack:
    """Max total capacity of c templates whose sizes sum to ``nodes``", for many capacity vectors
    and counts: the gather pattern (which sub-total each size extends) is built once."""

    NEG = -(1 << 60)

    def __init__(self, allowed: Sequence[int], nodes: int):
        self.sizes = np.array(allowed, dtype=np.int64)
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

    def total(self, values: np.ndarray, count: int, picks: list[np.ndarray] | None = None) -> int:
        """``totals(values, count)[-1]`` alone, with the same picks on the way to it: after i of
        the ``count`` templates only sub-totals the other count - i can still complete are kept
        (at least i smallest sizes, room for count - i smallest, reach with count - i largest).
        Any predecessor of such a sub-total outside the previous band is unreachable, so every
        kept value and pick equals the full DP's; with many pipelines of the smallest size (the
        usual answer on a large cluster) the band is a handful of totals instead of ``nodes``."""
        sizes, nodes, neg = self.sizes, self.nodes, self.NEG
        small, large = int(sizes.min()), int(sizes.max())
        dp = np.full(nodes + 2, neg, dtype=np.int64)
        dp[0] = 0
        column = values[:, None]
        for i in range(1, count + 1):
            lo = max(i * small, nodes - (count - i) * large)
            hi = min(i * large, nodes - (count - i) * small)
            step = np.full(nodes + 2, neg, dtype=np.int64)
            pick = np.zeros(nodes + 1, dtype=np.int64)
            if lo <= hi:
                columns = np.arange(lo, hi + 1)
                index = columns[None, :] - sizes[:, None]
                candidates = dp[np.where(index >= 0, index, nodes + 1)] + column
                chosen = np.argmax(candidates, axis=0)
                best = candidates[chosen, np.arange(len(columns))]
                best[best <= neg // 2] = neg
                step[lo : hi + 1] = best
                pick[lo : hi + 1] = chosen
            if picks is not None:
                picks.append(pick)
            dp = step
        return int(dp[nodes])

    def choice(self, values: np.ndarray, count: int) -> list[int]:
        """The template sizes of a best choice of ``count`` templates."""
        picks: list[np.ndarray] = []
        self.total(values, count, picks)
        multiset, n = [], self.nodes
        for pick in reversed(picks):
            size = int(self.sizes[pick[n]])
            multiset.append(size)
            n -= size
        return multiset


class _CountSearch:
    """For one set of allowed templates (plus ``fixed`` pipelines that are always there): the
    least finishing time at which ``count`` allowed templates covering ``free`` nodes, together
    with the fixed ones, take all M microbatches (``solve``).

    Feasibility at t depends only on every curve's capacity at t (at most M: more never helps),
    so ``_least_time`` finds the exact least t. A template that cannot take one microbatch by t
    is out (every pipeline needs at least one): the knapsack gives it a value no choice survives.
    """

    def __init__(self, allowed_curves, allowed_sizes, fixed_curves, free: int, microbatches: int):
        self.allowed = list(allowed_curves)
        self.fixed = list(fixed_curves)
        self.curves = self.allowed + self.fixed
        self.free = free
        self.M = microbatches
        self.knapsack = _Knapsack(allowed_sizes, free) if allowed_sizes else None

    def capacities(self, t: float) -> list[int]:
        return [c.capacity(t, self.M) for c in self.curves]

    def _values(self, caps: Sequence[int]) -> np.ndarray:
        values = np.array(caps[: len(self.allowed)], dtype=np.int64)
        return np.where(values >= 1, values, _Knapsack.NEG)

    def feasible(self, caps: Sequence[int], count: int) -> bool:
        fixed = caps[len(self.allowed) :]
        if any(m < 1 for m in fixed):
            return False
        if count and max(caps[: len(self.allowed)], default=0) * count + sum(fixed) < self.M:
            return False  # even the most capable template, count times, cannot take them all
        if self.knapsack is None or count == 0:
            free_total = 0 if self.free == 0 else _Knapsack.NEG
        else:
            free_total = self.knapsack.total(self._values(caps), count)
        return free_total + sum(fixed) >= self.M

    def relaxed_floor(self, count: int, floor: float, limit: float | None) -> float | None:
        """A lower bound on ``solve``'s t, or None if it shows t > ``limit``: the least t at which
        ``count`` templates with fractional counts (sizes summing to the free nodes) could take
        the microbatches, each template taking at most ``floor((t - a) / s)`` by t (its Eq. 1-4
        line; time >= line, pipeline_cost.py). The integer capacities make it much tighter than
        ``_count_floors``' bound when the microbatches do not divide evenly."""
        allowed, fixed = self.allowed, self.fixed
        a = np.array([c.intercept + c.offset for c in allowed + fixed])
        s = np.array([c.slope for c in allowed + fixed])
        k = len(allowed)
        if count:
            assert self.knapsack is not None  # (count > 0: some sizes are allowed)
            vertices = _two_sizes(self.knapsack.sizes, self.free, count)
            if vertices is None:
                return None
            lo_side, hi_side, y_lo, y_hi = vertices

        def caps(t: float) -> np.ndarray:
            # Rounded up a hair: an upper bound of every capacity whatever the rounding.
            return np.clip(np.floor((t - a) / s * (1 + BOUND_SLACK) + BOUND_SLACK), 0, self.M)

        unusable = -float(self.M + 1) * max(count, 1)  # a template that cannot take one microbatch

        def reaches(c: np.ndarray) -> bool:
            if (c[k:] < 1).any():
                return False
            total = float(c[k:].sum())
            if count:
                usable = np.where(c[:k] >= 1, c[:k], unusable)  # every pipeline takes at least one
                total += float(np.max(y_lo * usable[lo_side][:, None] + y_hi * usable[hi_side][None, :]))
            return total >= self.M * (1 - BOUND_SLACK)  # the fractional weights round too

        hi = limit if limit is not None else max(c.time(self.M) for c in self.curves)
        if not reaches(caps(hi)):
            return None
        # Bisection; a failing test moves the low end on to where some capacity bound next grows
        # (taken a hair early, so the result stays a lower bound).
        lo = floor
        for _ in range(MAX_BISECTION_STEPS):
            if hi - lo <= RELAXED_PRECISION * hi:
                break
            mid = (lo + hi) / 2
            c = caps(mid)
            if reaches(c):
                hi = mid
            else:
                grow = np.where(c < self.M, a + s * (c + 1 - 2 * BOUND_SLACK) / (1 + BOUND_SLACK), np.inf)
                lo = max(mid, min(float(grow.min()) * (1 - BOUND_SLACK), hi))
        return lo * (1 - BOUND_SLACK)

    def solve(self, count: int, floor: float, limit: float | None) -> tuple[float, list[int]] | None:
        """The least t (at least ``floor``, a known lower bound) and the free template sizes
        chosen there; None if that t exceeds ``limit``."""
        if limit is not None and limit <= floor:
            return None
        t = _least_time(
            self.curves, self.M, self.capacities, lambda caps: self.feasible(caps, count), floor, floor, limit
        )
        if t is None:
            return None
        if count == 0:
            return t, []
        assert self.knapsack is not None  # (count > 0: some sizes are allowed)
        return t, self.knapsack.choice(self._values(self.capacities(t)), count)


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
    if M > MAX_MICROBATCHES:
        raise PlanningError(microbatch_limit_message(global_batch_size, microbatch_size))
    f = fault_tolerance
    n0 = templates.min_nodes
    if N < (f + 1) * n0:
        raise PlanningError(
            f"f={f} needs {f + 1} pipelines of at least n0={n0} nodes = {(f + 1) * n0} nodes; cluster.nodes={N}"
        )
    if M < f + 1:
        raise PlanningError(
            f"{M} microbatches (job.global_batch_size={global_batch_size} / job.microbatch_size={microbatch_size}) "
            f"are fewer than the f+1={f + 1} pipelines; raise the batch or lower the microbatch size"
        )
    sync = sync_of(templates, intra_node_bandwidth, inter_node_bandwidth)
    chosen = _best_multiset(templates, N, M, f + 1, sync)
    if chosen is None:
        raise PlanningError(
            f"no combination of at least {f + 1} pipelines from templates of {list(templates.sizes)} nodes "
            f"covers exactly {N} nodes with at most {M} microbatches; check job.fault_tolerance and the cluster size"
        )
    return build_plan(templates, chosen[1], node_ids, global_batch_size, microbatch_size, f, sync)


def _split_of(
    templates: TemplateSet, sizes: tuple[int, ...], microbatches: int, sync: _Sync
) -> tuple[list[int], float, list[float]]:
    """The min-max split of the microbatches over pipelines of ``sizes`` (in this order), V and
    every pipeline's time: pure in its arguments, so memoised on the template set."""
    key = ("split", sync.intra, sync.inter, sizes, microbatches)
    if key not in templates.memo:
        chosen = [templates[n] for n in sizes]
        curves = [_PipelineCurve(t.stage_seconds, sync.intra_of[t.num_nodes]) for t in chosen]
        split = _min_max_split(curves, microbatches)
        value, per_pipeline = plan_iteration_time(chosen, split, sync)
        _remember(templates, key, (tuple(split), value, tuple(per_pipeline)))
    split, value, per_pipeline = templates.memo[key]
    return list(split), value, list(per_pipeline)


def microbatch_limit_message(global_batch_size: int, microbatch_size: int) -> str:
    return (
        f"job.global_batch_size={global_batch_size} / job.microbatch_size={microbatch_size} = "
        f"{global_batch_size // microbatch_size} microbatches per iteration, more than the planner's "
        f"{MAX_MICROBATCHES}; lower job.global_batch_size or raise job.microbatch_size"
    )


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
        sync = sync_of(templates)
    M = global_batch_size // microbatch_size
    groups: list[tuple[int, ...]] = []
    if node_groups_or_ids and isinstance(node_groups_or_ids[0], int):
        sizes = sorted(pipeline_sizes, reverse=True)
        ids = list(cast("Sequence[int]", node_groups_or_ids))
        offset = 0
        for size in sizes:
            groups.append(tuple(ids[offset : offset + size]))
            offset += size
    else:
        groups = [tuple(g) for g in cast("Sequence[Sequence[int]]", node_groups_or_ids)]
        sizes = [len(g) for g in groups]
    chosen = [templates[n] for n in sizes]
    split, value, per_pipeline = _split_of(templates, tuple(sizes), M, sync)
    pipelines, first = [], 0
    for index, (template, group, m, t) in enumerate(zip(chosen, groups, split, per_pipeline)):
        pipelines.append(
            PipelineInstance(
                index=index,
                template=template,
                nodes=group,
                microbatches=m,
                first_microbatch=first,
                predicted_iteration_s=t,
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

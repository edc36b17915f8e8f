"""Batch distribution: the exact min-max split of microbatches over pipelines, and the search it runs.

``_PipelineCurve`` is one pipeline's time ``T(m) + offset`` (``T = pipeline_time``) and its exact
inverse, the most microbatches it finishes by a time. ``_least_time`` finds the least finishing
time t at which a test of every curve's capacity at t passes: each ``T_p`` is nondecreasing in m,
so the test can only change at some ``T(m) + offset``, and the search snaps to those times and
ends on the exact optimum, at any m including m <= S. ``_min_max_split`` (``distribute_microbatches``)
asks it where the capacities first add up to the batch; the choice of pipelines (``count_search``)
asks it where a knapsack of capacities does, on the same curves, so both agree to the last bit.
The overview is ``instantiate``'s module docstring.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from oobleck.errors import PlanningError
from oobleck.planning.pipeline_cost import eq14_line, pipeline_time

# Relative slack on cheap lower bounds of a time that are computed by other float operations than
# the time itself (a bound may only be used to rule things out, so it must never exceed the time).
BOUND_SLACK = 1e-9
# A guard against a search that fails to converge (each step halves the bracket, so about 60
# steps exhaust a double's precision); reaching it would be a bug, reported as such.
MAX_BISECTION_STEPS = 400


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

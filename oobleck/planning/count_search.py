"""The choice of pipelines for one cap on bytes per node: the knapsack DP and the bounds that order it.

For every pipeline count k and every cap X on bytes per node, ``instantiate._search_multiset``
asks ``_CountSearch.solve`` for the least finishing time t at which k allowed templates with sum
of nodes N take the M microbatches: ``_least_time`` (``batch_distribution``) searches t, and a
knapsack DP (``_Knapsack``) answers "can they take M by t?", each template's capacity at t being
its largest m with ``T(m) + intra <= t``; no enumeration of template multisets.

The (X, k) pairs are taken best-first by lower bounds of their value: ``_count_floors`` (some
pipeline runs ceil(M / K) microbatches; the Eq. 1-4 lines with fractional template counts, whose
optimum uses at most two sizes: ``_two_sizes``) and, lazily, ``_CountSearch.relaxed_floor`` (the
same with integer capacities). The bounds are computed by other float operations than the times,
so they carry a relative slack (``BOUND_SLACK``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from oobleck.planning.batch_distribution import BOUND_SLACK, MAX_BISECTION_STEPS, _least_time, _PipelineCurve

# ``relaxed_floor`` stops bisecting at this relative width (it returns the low end: still a bound).
RELAXED_PRECISION = 1e-6


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

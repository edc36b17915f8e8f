"""What a sweep of simulations replays and shares: shifted trace starts, memoised decisions.

- ``shifted_trace(trace, offset_s)``: the trace as seen from ``offset_s`` into it: the nodes alive
  there form the starting cluster (at time 0) and every later change moves ``offset_s`` earlier.
  ``start_offsets(trace, starts, spacing_s)`` spaces ``starts`` replays ``spacing_s`` apart
  (default: the trace's median time between changes divided by ``starts``, so the starts sample
  one typical interval's phases). Each start is its own simulation over the same duration.
- ``Memoized``: a strategy whose decisions are shared by the simulations of one
  (model, strategy) in an experiment. Shifted starts and the synthetic traces replay the same
  membership changes in the same order, and every policy is deterministic (``Strategy``), so a
  decision already taken for the same layout object and the same change is reused instead of
  re-planned. Keys hold the layout object (decisions hand out the same layout objects, so the
  chain of layouts is shared too), the change, whether any step committed and whether a
  checkpoint exists, plus the strategy's plain attributes (Bamboo's fixed depth), which a hit
  restores. Restarts and stops are never reused (they carry step numbers), but the fresh start a
  restart plans on the survivors is.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from oobleck.faults.kinds import FaultKind
from oobleck.faults.trace import Trace, TraceEvent
from oobleck.sim.charges import CostCache, PlanBytes
from oobleck.strategy import Decision, Kind, RunState, Strategy


def shifted_trace(trace: Trace, offset_s: float) -> Trace:
    """``trace`` replayed from ``offset_s`` into it (module docstring); times count from there."""
    offset_ms = trace.start_ms + round(offset_s * 1000)
    if offset_ms <= trace.start_ms:
        return trace
    live: dict[str, TraceEvent] = {}
    later: list[TraceEvent] = []
    for event in trace.events:
        if event.time_ms <= offset_ms:
            if event.kind == FaultKind.JOIN:
                live[event.node] = event
            else:
                live.pop(event.node, None)
        else:
            later.append(TraceEvent(event.time_ms - offset_ms, event.kind, event.node, event.line))
    first = [TraceEvent(0, FaultKind.JOIN, node, event.line) for node, event in live.items()]
    if not first:
        raise ValueError(f"{trace.name}: no node is alive {offset_s:.0f} s into the trace")
    return Trace(name=trace.name, path=trace.path, events=tuple(first + later))


def start_offsets(trace: Trace, starts: int, spacing_s: float | None = None) -> list[float]:
    """Offsets (seconds) of ``starts`` shifted replays of ``trace``: 0, s, 2s, ..."""
    if starts <= 1:
        return [0.0]
    if spacing_s is None:
        times = [change.time_s for change in trace.changes()]
        gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
        spacing_s = (statistics.median(gaps) if gaps else 0.0) / starts
    return [k * float(spacing_s) for k in range(starts)]


def failure_interval_s(trace: Trace) -> float:
    """The failure-free stretch a moment of the trace typically falls in: the median of the gaps
    between its changes that remove nodes (and from its start to the first, from the last to its
    end), each gap weighted by its length. For a regular trace that is its interval; for a bursty
    one (the spot traces) it is longer than the plain median gap, which a burst of removals
    seconds apart would pull down though training spends little time in such gaps. inf without
    any removal."""
    times = [change.time_s for change in trace.changes() if change.removed]
    if not times:
        return math.inf
    edges = [trace.start_ms / 1000.0, *times, trace.end_ms / 1000.0]
    gaps = sorted(b - a for a, b in zip(edges, edges[1:]) if b > a)
    total, covered = sum(gaps), 0.0
    for gap in gaps:
        covered += gap
        if covered >= total / 2:
            return float(gap)
    return float(gaps[-1])


class DecisionMemo:
    """Decisions (and per-plan costs) of one strategy config on one context, across simulations."""

    def __init__(self) -> None:
        self.starts: dict[tuple, tuple[Decision, tuple]] = {}
        self.changes: dict[tuple, tuple[Any, Decision | None, tuple]] = {}
        self.geometry = PlanBytes()  # what each plan writes and holds: the same under any cost constants
        self.costs = CostCache(self.geometry)
        self.initial: tuple | None = None  # the strategy's plain state before its first decision
        self.hits = 0
        self.misses = 0


def _plain_state(strategy: Strategy) -> tuple:
    return tuple(
        sorted((k, v) for k, v in vars(strategy).items() if isinstance(v, (bool, int, float, str, type(None))))
    )


def _restore(strategy: Strategy, state: tuple) -> None:
    for key, value in state:
        setattr(strategy, key, value)


class Memoized(Strategy):
    """``inner`` with its decisions shared through ``memo`` (module docstring)."""

    def __init__(self, inner: Strategy, memo: DecisionMemo) -> None:
        super().__init__(inner.config, inner.context)
        self.inner, self.memo = inner, memo
        # A fresh simulation: an inner strategy used before (its caches kept) starts from the
        # plain state it had before its first decision.
        if memo.initial is None:
            memo.initial = _plain_state(inner)
        else:
            _restore(inner, memo.initial)
        # The inner strategy's own calls of ``start`` (a restart starts afresh on the survivors)
        # go through the memo too.
        inner.start = self.start  # type: ignore[method-assign]

    @property
    def checkpoint_every_steps(self) -> int:
        return self.inner.checkpoint_every_steps

    def start(self, nodes: Sequence[int]) -> Decision:
        key = (tuple(nodes), _plain_state(self.inner))
        hit = self.memo.starts.get(key)
        if hit is None:
            self.memo.misses += 1
            decision = type(self.inner).start(self.inner, nodes)
            hit = self.memo.starts[key] = (decision, _plain_state(self.inner))
        else:
            self.memo.hits += 1
        _restore(self.inner, hit[1])
        return hit[0]

    def on_change(self, state: RunState) -> Decision:
        key = (
            id(state.layout),
            state.alive,
            state.removed,
            state.joined,
            state.step == 0,
            state.checkpoint_step is None,
            _plain_state(self.inner),
        )
        hit = self.memo.changes.get(key)
        if hit is not None and hit[1] is not None:
            self.memo.hits += 1
            _restore(self.inner, hit[2])
            return hit[1]
        self.memo.misses += 1
        decision = self.inner.on_change(state)
        reusable = decision.kind not in (Kind.RESTART, Kind.STOP)
        # The layout is kept in the value so that its id stays unique while the key lives.
        self.memo.changes[key] = (state.layout, decision if reusable else None, _plain_state(self.inner))
        return decision

"""A simulated job's progress: iterations done, checkpointed, durable, and where node-seconds went.

``Run`` is the mutable state of one simulation. Completed iterations wait in ``uncommitted`` until
a checkpoint's snapshot takes them, then in ``pending`` until its write completes (checkpoints are
written as ``oobleck.checkpoint`` writes them, ``oobleck.recovery_costs.checkpoint_cost``: with
asynchronous writes training pauses only for the snapshot, and a checkpoint becomes durable when
its write completes), then count for good in ``committed``; a rollback (``roll_back``) loses every
iteration not yet durable. ``train`` advances a running layout in closed form (whole checkpoint
cycles at once), so an 11-hour trace costs one step per membership change, not per iteration.

Accounting is in node-seconds of alive nodes, split into ``BREAKDOWN``: useful work, redundant work
(Bamboo), checkpointing, restart (which includes the start), reconfiguration (incl. failover,
re-route and a continue that recovers in place), lost work and idle nodes; the parts sum to the
alive node-seconds (a tested invariant). ``rolled_back`` keeps the spans whose work was thrown away
(rolled back, or abandoned in flight), so a timeline can draw durable progress and discarded work
apart (``oobleck.sim.results.split_durable``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from oobleck.strategy import Layout

BREAKDOWN = ("useful", "redundant", "checkpoint", "restart", "reconfiguration", "lost", "idle")
EPS = 1e-9


@dataclass
class Work:
    """Completed iterations not yet durable (or, for ``committed``, counted for good)."""

    iters: int = 0
    samples: float = 0.0
    busy: float = 0.0  # node-seconds of those iterations
    redundant: float = 0.0  # of which redundant work

    def add(self, other: Work) -> None:
        self.iters += other.iters
        self.samples += other.samples
        self.busy += other.busy
        self.redundant += other.redundant

    def take(self) -> Work:
        taken = Work(self.iters, self.samples, self.busy, self.redundant)
        self.iters, self.samples, self.busy, self.redundant = 0, 0.0, 0.0, 0.0
        return taken


@dataclass
class Run:
    """Mutable simulation state: the layout running or recovering, and its work on the way to durable."""

    layout: Layout | None = None
    recovery_until: float = 0.0
    recovery_kind: str = "restart"
    iters_since_checkpoint: int = 0
    in_checkpoint: bool = False
    inflight_s: float = 0.0  # time spent on the current iteration or checkpoint pause
    uncommitted: Work = field(default_factory=Work)  # since the last checkpoint's snapshot
    pending: Work = field(default_factory=Work)  # in a checkpoint whose write is not done yet
    pending_durable_at: float = math.inf
    committed: Work = field(default_factory=Work)
    lost_samples: float = 0.0
    # When the first iteration of ``uncommitted`` / ``pending`` started (inf when empty): a
    # rollback discards the work done since then.
    uncommitted_from: float = math.inf
    pending_from: float = math.inf
    started: bool = False
    checkpointed: bool = False  # a checkpoint is durable (committed.iters can be restored)
    node_seconds: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in BREAKDOWN})
    rolled_back: list[tuple[float, float]] = field(default_factory=list)  # spans whose work was thrown away

    @property
    def total_samples(self) -> float:
        return self.committed.samples + self.pending.samples + self.uncommitted.samples

    @property
    def steps(self) -> int:
        return self.committed.iters + self.pending.iters + self.uncommitted.iters

    # ----- durability ------------------------------------------------------------------------
    def settle(self, now: float) -> None:
        """A checkpoint whose write is done by ``now`` is durable: its iterations count for good."""
        if self.pending.iters and self.pending_durable_at <= now + EPS:
            self.commit(self.pending)
            self.pending_durable_at = math.inf

    def commit(self, work: Work) -> None:
        ns = self.node_seconds
        if work is self.pending:
            self.pending_from = math.inf
        elif work is self.uncommitted:
            self.uncommitted_from = math.inf
        done = work.take()
        ns["useful"] += done.busy - done.redundant
        ns["redundant"] += done.redundant
        self.committed.add(done)
        self.checkpointed = True

    def _checkpoint_done(self, time_s: float, lag_s: float) -> None:
        """A checkpoint's snapshot ended at ``time_s``: its iterations are durable ``lag_s`` later."""
        self.settle(time_s)
        self._to_pending()
        self.pending_durable_at = time_s + lag_s
        self.iters_since_checkpoint = 0
        if lag_s <= EPS:
            self.settle(time_s)

    def _to_pending(self) -> None:
        """The iterations since the last checkpoint join those waiting to be durable."""
        if self.uncommitted.iters:
            self.pending_from = min(self.pending_from, self.uncommitted_from)
        self.pending.add(self.uncommitted.take())
        self.uncommitted_from = math.inf

    def abandon(self, start: float, end: float) -> None:
        """Work done from ``start`` to ``end`` is thrown away (drawn as such in the timeline)."""
        if end - start > EPS:
            self.rolled_back.append((start, end))

    def roll_back(self, now: float) -> float:
        """Everything not durable at ``now`` is lost; returns the samples lost."""
        self.settle(now)
        first = min(
            self.pending_from if self.pending.iters else math.inf,
            self.uncommitted_from if self.uncommitted.iters else math.inf,
        )
        if math.isfinite(first):
            self.abandon(first, now)
        self.pending_from = self.uncommitted_from = math.inf
        lost = Work()
        lost.add(self.pending.take())
        lost.add(self.uncommitted.take())
        self.pending_durable_at = math.inf
        self.node_seconds["lost"] += lost.busy
        self.lost_samples += lost.samples
        self.iters_since_checkpoint = 0
        self.in_checkpoint, self.inflight_s = False, 0.0
        return lost.samples

    # ----- time advance ----------------------------------------------------------------------
    def train(
        self, t0: float, t1: float, alive: int, interval: int, pause: float, lag: float
    ) -> tuple[float, float, float]:
        """Run ``self.layout`` from ``t0`` to ``t1`` with ``alive`` nodes alive, a checkpoint every
        ``interval`` iterations (0: none) that stops training ``pause`` s and is durable ``lag`` s
        later. Returns the checkpoints completed: how many, when the first and the last did."""
        layout = self.layout
        assert layout is not None
        ns = self.node_seconds
        used = len(layout.nodes)
        ns["idle"] += (alive - used) * (t1 - t0)
        period = layout.iteration_s
        per_iteration = Work(1, layout.samples_per_iteration, used * period, used * period * layout.redundant_fraction)

        def complete(count: int, first_start: float) -> None:
            if not self.uncommitted.iters:
                self.uncommitted_from = first_start
            self.uncommitted.add(
                Work(count, count * per_iteration.samples, count * per_iteration.busy, count * per_iteration.redundant)
            )
            self.iters_since_checkpoint += count

        remaining = t1 - t0
        done: list[float] = [0, math.inf, -math.inf]  # checkpoints completed: count, first and last time
        while remaining > EPS:
            now = t1 - remaining
            if self.in_checkpoint:
                need = pause - self.inflight_s
                if remaining < need:
                    self.inflight_s += remaining
                    ns["checkpoint"] += used * remaining
                    remaining = 0.0
                    break
                ns["checkpoint"] += used * need
                remaining -= need
                self.in_checkpoint, self.inflight_s = False, 0.0
                self._checkpoint_done(now + need, lag)
                done[:] = [done[0] + 1, min(done[1], now + need), now + need]
                # Whole cycles of (interval iterations + one checkpoint) in closed form: every
                # checkpoint but the last is durable by the end of the next cycle's pause.
                cycle = interval * period + pause
                cycles = int(remaining // cycle) if cycle > 0 else 0
                if cycles:
                    start = t1 - remaining
                    ns["checkpoint"] += used * cycles * pause
                    if cycles > 1:
                        complete((cycles - 1) * interval, start)
                        self._checkpoint_done(start + (cycles - 1) * cycle, lag)
                    complete(interval, start + (cycles - 1) * cycle)
                    self._checkpoint_done(start + cycles * cycle, lag)
                    done[:] = [done[0] + cycles, min(done[1], start + cycle), start + cycles * cycle]
                    remaining -= cycles * cycle
                continue
            need = period - self.inflight_s
            if remaining < need:
                self.inflight_s += remaining
                remaining = 0.0
                break
            remaining -= need
            self.inflight_s = 0.0
            complete(1, now + need - period)
            # Whole iterations up to the next checkpoint (or all of them without checkpoints).
            todo = interval - self.iters_since_checkpoint if interval else math.inf
            if todo > 0:
                count = int(min(todo, remaining // period))
                if count:
                    complete(count, t1 - remaining)
                    remaining -= count * period
            if interval and self.iters_since_checkpoint >= interval:
                self.in_checkpoint = True
        return done[0], done[1], done[2]

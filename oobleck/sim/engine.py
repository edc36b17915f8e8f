"""Discrete-event replay of a node trace for one strategy.

Time advances from one membership change to the next. Between changes the cluster is either
recovering (a reaction's downtime: no node makes progress), running a ``Layout`` (iterations of
``iteration_s``, and every ``checkpoint_every_steps`` iterations a checkpoint), or stopped (no
layout fits). Progress inside a running period is computed in closed form (whole checkpoint
cycles at once), so an 11-hour trace costs one step per change, not per iteration.

Nodes: a node the trace adds becomes usable ``node_creation_s`` later (instance creation; a
node removed before then never joins), the cluster the trace starts with included, so a job
starts only once its nodes exist. The start itself is charged like a restart without a
checkpoint to read: every strategy pays for its start.

At a change the strategy decides (``Strategy.on_change``, the same decision the real runtime
executes) and ``oobleck.sim.charges.decision_downtime`` charges it by its kind (a ``continue`` that
lost a working node or put new nodes to work, torchft's, is a recovery in place). A change that took
a working node abandons the iteration in flight; one that did not (a join, a standby lost) is
carried out at the next step boundary: the iteration in flight completes first (a planned
checkpoint is taken there too). A restart, or a stop (the job dies: nothing fits, or there is
nothing to fall back on), also loses every iteration not in a durable checkpoint: checkpoints
are written as ``oobleck.checkpoint`` writes them (``oobleck.recovery_costs.checkpoint_cost``:
with asynchronous writes training pauses only for the snapshot, and a checkpoint becomes durable
when its write completes). A stopped job is started again as soon as the nodes alive allow a
layout (at once, or at the next join). A change that arrives during a recovery extends it: the
cluster runs again only when both the old and the new recovery are done (a second restart
starts its full restart time over; training never continues during a restart).

Accounting is in node-seconds of alive nodes, split into useful work, redundant work (Bamboo),
checkpointing, restart (which includes the start), reconfiguration (incl. failover, re-route and
a continue that recovers in place), lost work and idle nodes; the parts sum to the alive
node-seconds (a tested invariant). Throughput counts samples of iterations that were never rolled
back; ``kept_samples`` counts those done before the last membership change that survived it (0
after a start: the strategy kept no durable progress).
Running segments carry ``durable``: False for the stretches whose work was later rolled back (or
abandoned in flight), so a timeline can draw durable progress and discarded work apart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from oobleck.faults.trace import Trace, TraceChange
from oobleck.sim.charges import CostCache, decision_downtime
from oobleck.strategy import Decision, Kind, Layout, RunState, Strategy

# The event kind each decision is recorded as (the real runtime's events.csv uses the same names).
EVENT_KIND = {
    Kind.START: "start",
    Kind.RECONFIGURE: "reconfiguration",
    Kind.FAILOVER: "failover",
    Kind.REROUTE: "reroute",
    Kind.RESTART: "restart",
    Kind.STOP: "stop",
    Kind.CONTINUE: "continue",
}
# Event kinds that charge downtime (each has ``downtime_s``).
DOWNTIME_EVENTS = ("start", "reconfiguration", "failover", "reroute", "restart", "continue")
# What a strategy can do about a failure that took a working node (recorded with failure=True).
# "continue": the strategy's own workers carried on without the lost node (torchft's replicas).
REACTIONS = ("reconfiguration", "failover", "reroute", "restart", "continue", "stop", "oom")


BREAKDOWN = ("useful", "redundant", "checkpoint", "restart", "reconfiguration", "lost", "idle")
EPS = 1e-9


@dataclass
class _Work:
    """Completed iterations not yet durable (or, for ``committed``, counted for good)."""

    iters: int = 0
    samples: float = 0.0
    busy: float = 0.0  # node-seconds of those iterations
    redundant: float = 0.0  # of which redundant work

    def add(self, other: _Work) -> None:
        self.iters += other.iters
        self.samples += other.samples
        self.busy += other.busy
        self.redundant += other.redundant

    def take(self) -> _Work:
        taken = _Work(self.iters, self.samples, self.busy, self.redundant)
        self.iters, self.samples, self.busy, self.redundant = 0, 0.0, 0.0, 0.0
        return taken


@dataclass
class _Run:
    """Mutable simulation state."""

    layout: Layout | None = None
    recovery_until: float = 0.0
    recovery_kind: str = "restart"
    iters_since_checkpoint: int = 0
    in_checkpoint: bool = False
    inflight_s: float = 0.0  # time spent on the current iteration or checkpoint pause
    uncommitted: _Work = field(default_factory=_Work)  # since the last checkpoint's snapshot
    pending: _Work = field(default_factory=_Work)  # in a checkpoint whose write is not done yet
    pending_durable_at: float = math.inf
    committed: _Work = field(default_factory=_Work)
    lost_samples: float = 0.0
    # When the first iteration of ``uncommitted`` / ``pending`` started (inf when empty): a
    # rollback discards the work done since then.
    uncommitted_from: float = math.inf
    pending_from: float = math.inf
    started: bool = False
    checkpointed: bool = False  # a checkpoint is durable (committed.iters can be restored)
    node_seconds: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in BREAKDOWN})

    @property
    def total_samples(self) -> float:
        return self.committed.samples + self.pending.samples + self.uncommitted.samples

    @property
    def steps(self) -> int:
        return self.committed.iters + self.pending.iters + self.uncommitted.iters


def delayed_changes(trace: Trace, node_creation_s: float) -> list[TraceChange]:
    """The trace's changes with every addition taking effect ``node_creation_s`` later.

    A node removed before its addition took effect never joins (both are dropped); a name that
    leaves and comes back is a new instance (``name#k`` for its k-th arrival after the first).
    """
    changes = trace.changes()
    if node_creation_s <= 0:
        return list(changes)
    delay_ms = round(node_creation_s * 1000)
    arrivals: dict[str, int] = {}
    effective: dict[str, int] = {}  # instance name -> time its addition takes effect
    events: dict[int, tuple[list[str], list[str]]] = {}
    for change in changes:
        for name in change.removed:
            instance = _instance(name, arrivals)
            if effective.get(instance, -1) >= change.time_ms:
                adds = events[effective.pop(instance)][0]
                adds.remove(instance)  # it never became usable
                continue
            effective.pop(instance, None)
            events.setdefault(change.time_ms, ([], []))[1].append(instance)
        for name in change.added:
            arrivals[name] = arrivals.get(name, -1) + 1
            instance = _instance(name, arrivals)
            effective[instance] = change.time_ms + delay_ms
            events.setdefault(change.time_ms + delay_ms, ([], []))[0].append(instance)
    return [TraceChange(t, tuple(a), tuple(r)) for t, (a, r) in sorted(events.items()) if a or r]


def _instance(name: str, arrivals: Mapping[str, int]) -> str:
    count = arrivals.get(name, 0)
    return name if count <= 0 else f"{name}#{count}"


@dataclass
class SimResult:
    """Tidy rows of one simulation: ``segments`` (throughput over time), ``events``, ``summary``."""

    segments: list[dict[str, Any]]
    events: list[dict[str, Any]]
    summary: dict[str, Any]


def split_durable(segments: list[dict[str, Any]], spans: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """``segments`` with ``durable``: running segments cut where ``spans`` (work later thrown
    away) begin and end, the pieces inside a span ``durable=False``; every other row True."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1] + EPS:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    out: list[dict[str, Any]] = []
    for row in segments:
        if row["phase"] != "running" or not merged:
            out.append({**row, "durable": True})
            continue
        t0, t1 = row["t_start_s"], row["t_end_s"]
        cuts = sorted({t0, t1, *(t for span in merged for t in span if t0 < t < t1)})
        for a, b in zip(cuts, cuts[1:]):
            if b - a <= EPS:
                continue
            middle = (a + b) / 2
            lost = any(start <= middle <= end for start, end in merged)
            out.append({**row, "t_start_s": a, "t_end_s": b, "durable": not lost})
    return out


class Simulator:
    """Replays ``trace`` for ``strategy``; ``labels`` are copied into every output row."""

    def __init__(
        self,
        strategy: Strategy,
        trace: Trace,
        *,
        duration_s: float | None = None,
        labels: Mapping[str, Any] | None = None,
        node_creation_s: float = 0.0,
        cache: CostCache | None = None,
        charge_start: bool = True,
    ) -> None:
        self.strategy = strategy
        self.charge_start = charge_start
        self.trace = trace
        self.labels = dict(labels or {})
        self.labels.setdefault("strategy", strategy.name)
        self.labels.setdefault("trace", trace.name)
        self.cache = cache or CostCache()
        self.start_s = trace.start_ms / 1000.0
        self.end_s = self.start_s + duration_s if duration_s is not None else trace.end_ms / 1000.0
        changes = delayed_changes(trace, node_creation_s)
        self.changes = [c for c in changes if c.time_s < self.end_s or c is changes[0]]
        # Every arrival is a fresh node id (a name may leave and come back as a new instance).
        self.ids: dict[str, int] = {}
        self.next_id = 0
        self.run = _Run()
        self.alive: set[int] = set()
        self.segments: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.counts: dict[str, int] = {}
        self.kept_samples: float | None = None  # at the last membership change
        self.rolled_back: list[tuple[float, float]] = []  # spans whose work was thrown away
        self.first_layout: Layout | None = None  # the layout the job first ran
        self.opened_s: float | None = None  # when the first nodes existed (the first chance to start)
        self.first_start_s: float | None = None  # when a layout first started

    # ----- output rows -----------------------------------------------------------------------
    def _event(self, time_s: float, kind: str, count: int = 1, **fields: Any) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + count
        row = {**self.labels, "time_s": time_s, "kind": kind, "count": count, "nodes_alive": len(self.alive), **fields}
        self.events.append(row)

    def _segment(self, start: float, end: float, phase: str, samples_per_s: float) -> None:
        if end - start <= EPS:
            return
        layout = self.run.layout
        self.segments.append(
            {
                **self.labels,
                "t_start_s": start,
                "t_end_s": end,
                "phase": phase,
                "nodes_alive": len(self.alive),
                "nodes_used": len(layout.nodes) if layout is not None and phase == "running" else 0,
                "samples_per_s": samples_per_s,
                "iteration_s": layout.iteration_s if layout is not None else math.nan,
                "layout": layout.description if layout is not None else "",
            }
        )

    # ----- durability ------------------------------------------------------------------------
    def _settle(self, now: float) -> None:
        """A checkpoint whose write is done by ``now`` is durable: its iterations count for good."""
        run = self.run
        if run.pending.iters and run.pending_durable_at <= now + EPS:
            self._commit(run.pending)
            run.pending_durable_at = math.inf

    def _commit(self, work: _Work) -> None:
        run, ns = self.run, self.run.node_seconds
        if work is run.pending:
            run.pending_from = math.inf
        elif work is run.uncommitted:
            run.uncommitted_from = math.inf
        done = work.take()
        ns["useful"] += done.busy - done.redundant
        ns["redundant"] += done.redundant
        run.committed.add(done)
        run.checkpointed = True

    def _checkpoint_done(self, time_s: float, lag_s: float) -> None:
        """A checkpoint's snapshot ended at ``time_s``: its iterations are durable ``lag_s`` later."""
        run = self.run
        self._settle(time_s)
        self._to_pending()
        run.pending_durable_at = time_s + lag_s
        run.iters_since_checkpoint = 0
        if lag_s <= EPS:
            self._settle(time_s)

    def _to_pending(self) -> None:
        """The iterations since the last checkpoint join those waiting to be durable."""
        run = self.run
        if run.uncommitted.iters:
            run.pending_from = min(run.pending_from, run.uncommitted_from)
        run.pending.add(run.uncommitted.take())
        run.uncommitted_from = math.inf

    def _abandon(self, start: float, end: float) -> None:
        """Work done from ``start`` to ``end`` is thrown away (drawn as such in the timeline)."""
        if end - start > EPS:
            self.rolled_back.append((start, end))

    def _roll_back(self, now: float) -> float:
        """Everything not durable at ``now`` is lost; returns the samples lost."""
        run = self.run
        self._settle(now)
        first = min(
            run.pending_from if run.pending.iters else math.inf,
            run.uncommitted_from if run.uncommitted.iters else math.inf,
        )
        if math.isfinite(first):
            self._abandon(first, now)
        run.pending_from = run.uncommitted_from = math.inf
        lost = _Work()
        lost.add(run.pending.take())
        lost.add(run.uncommitted.take())
        run.pending_durable_at = math.inf
        run.node_seconds["lost"] += lost.busy
        run.lost_samples += lost.samples
        run.iters_since_checkpoint = 0
        run.in_checkpoint, run.inflight_s = False, 0.0
        return lost.samples

    # ----- time advance ----------------------------------------------------------------------
    def _advance(self, t_from: float, t_to: float) -> None:
        run, alive = self.run, len(self.alive)
        ns = run.node_seconds
        t = t_from
        if run.layout is None:
            ns["idle"] += alive * (t_to - t)
            self._segment(t, t_to, "stopped" if run.started or alive else "starting", 0.0)
            return
        if run.recovery_until > t:
            end = min(run.recovery_until, t_to)
            ns[run.recovery_kind] += alive * (end - t)
            self._segment(t, end, "recovering", 0.0)
            t = end
        if t_to - t <= EPS:
            return
        self._run_layout(t, t_to)

    def _checkpoint_pause(self, layout: Layout) -> tuple[float, float]:
        """Seconds training stops per checkpoint of ``layout``, and the lag until it is durable."""
        interval = self.strategy.checkpoint_every_steps
        if not interval:
            return 0.0, 0.0
        costs = self.strategy.config.costs
        ck = self.cache.checkpoint(self.strategy, layout)
        return ck.pause_s(costs, interval * layout.iteration_s), ck.durable_after_s(costs)

    def _to_step_boundary(self, now: float) -> float:
        """Seconds from ``now`` to the running layout's next step boundary (0 when nothing runs)."""
        run = self.run
        if run.layout is None or run.recovery_until > now + EPS:
            return 0.0
        if run.in_checkpoint:
            return max(0.0, self._checkpoint_pause(run.layout)[0] - run.inflight_s)
        return max(0.0, run.layout.iteration_s - run.inflight_s)

    def _run_layout(self, t0: float, t1: float) -> None:
        run = self.run
        layout = run.layout
        assert layout is not None
        ns = run.node_seconds
        used = len(layout.nodes)
        ns["idle"] += (len(self.alive) - used) * (t1 - t0)
        period = layout.iteration_s
        interval = self.strategy.checkpoint_every_steps
        pause, lag = self._checkpoint_pause(layout)
        per_iteration = _Work(1, layout.samples_per_iteration, used * period, used * period * layout.redundant_fraction)
        rate = layout.samples_per_iteration / period
        if interval:
            rate = interval * layout.samples_per_iteration / (interval * period + pause)
        self._segment(t0, t1, "running", rate)

        def complete(count: int, first_start: float) -> None:
            if not run.uncommitted.iters:
                run.uncommitted_from = first_start
            run.uncommitted.add(
                _Work(count, count * per_iteration.samples, count * per_iteration.busy, count * per_iteration.redundant)
            )
            run.iters_since_checkpoint += count

        remaining = t1 - t0
        done: list[float] = [0, math.inf, -math.inf]  # checkpoints completed: count, first and last time
        while remaining > EPS:
            now = t1 - remaining
            if run.in_checkpoint:
                need = pause - run.inflight_s
                if remaining < need:
                    run.inflight_s += remaining
                    ns["checkpoint"] += used * remaining
                    remaining = 0.0
                    break
                ns["checkpoint"] += used * need
                remaining -= need
                run.in_checkpoint, run.inflight_s = False, 0.0
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
            need = period - run.inflight_s
            if remaining < need:
                run.inflight_s += remaining
                remaining = 0.0
                break
            remaining -= need
            run.inflight_s = 0.0
            complete(1, now + need - period)
            # Whole iterations up to the next checkpoint (or all of them without checkpoints).
            todo = interval - run.iters_since_checkpoint if interval else math.inf
            if todo > 0:
                count = int(min(todo, remaining // period))
                if count:
                    complete(count, t1 - remaining)
                    remaining -= count * period
            if interval and run.iters_since_checkpoint >= interval:
                run.in_checkpoint = True
        if done[0]:
            # One row per running period (a long trace has tens of thousands of checkpoints):
            # ``count`` checkpoints completed, the first at ``first_time_s``, the last at ``time_s``.
            self._event(
                done[2],
                "checkpoint",
                count=int(done[0]),
                first_time_s=done[1],
                downtime_s=pause,
                durable_after_s=lag,
            )

    # ----- decisions -------------------------------------------------------------------------
    def _apply(
        self,
        time_s: float,
        decision: Decision,
        cause: str = "",
        *,
        restarting: bool = False,
        failure: bool = False,
        at_boundary: bool = False,
    ) -> float:
        """Carry out ``decision`` taken at ``time_s``; returns when it was carried out (the next
        step boundary with ``at_boundary``, else ``time_s``)."""
        run, ns = self.run, self.run.node_seconds
        lost_samples = 0.0
        old = run.layout
        if decision.kind is Kind.CONTINUE:
            new = decision.layout if decision.layout is not None else old
            assert old is not None and new is not None  # on_change is asked only while a layout runs
            if not (set(old.nodes) - self.alive or set(new.nodes) - set(old.nodes)):
                run.layout = new  # idle nodes came or went: nothing changes for the workers
                return time_s
            # The strategy's workers absorb the change themselves (torchft): a working node lost
            # fails the step in flight (its vote does not commit), nodes that start working heal
            # first; both are charged (oobleck.sim.charges) as a recovery in place.
            decision = replace(decision, layout=new)
        if at_boundary and decision.kind is not Kind.STOP:
            # Nothing was lost: the iteration in flight (or the checkpoint pause) completes first.
            delay = self._to_step_boundary(time_s)
            if EPS < delay and time_s + delay < self.end_s:
                self._run_layout(time_s, time_s + delay)
                time_s += delay
        downtime, breakdown = decision_downtime(
            decision, self.strategy, previous=old, restarting=restarting, failure=failure, cache=self.cache
        )
        if old is not None and run.recovery_until <= time_s + EPS:
            # The iteration in flight is abandoned (a checkpoint in flight just has to be redone).
            if not run.in_checkpoint:
                ns["lost"] += len(old.nodes) * run.inflight_s
                self._abandon(time_s - run.inflight_s, time_s)
            run.inflight_s = 0.0
            run.in_checkpoint = False
        if decision.checkpoint_first:
            # Written synchronously before the restart: everything done so far is durable.
            self._commit(run.pending)
            self._commit(run.uncommitted)
            run.pending_durable_at = math.inf
            run.iters_since_checkpoint = 0
        elif decision.kind in (Kind.RESTART, Kind.STOP) and old is not None:
            lost_samples = self._roll_back(time_s)
        run.layout = decision.layout
        restart_like = decision.kind in (Kind.RESTART, Kind.START)
        kind = "restart" if restart_like else "reconfiguration"
        if run.recovery_until > time_s:
            # A recovery in progress still has to finish: a new one can extend it, not shorten it.
            if run.recovery_kind == "restart":
                kind = "restart"
            run.recovery_until = max(run.recovery_until, time_s + downtime)
        else:
            run.recovery_until = time_s + downtime
        run.recovery_kind = kind
        checkpoint_part = dict(breakdown).get("checkpoint", 0.0)
        if checkpoint_part:
            # The checkpoint part of the downtime is checkpointing, not restarting.
            alive = len(self.alive)
            ns["checkpoint"] += alive * checkpoint_part
            ns[run.recovery_kind] -= alive * checkpoint_part
        layout = decision.layout
        if decision.kind is Kind.START:
            event = "restart" if restarting else "start"
        else:
            event = "oom" if decision.out_of_memory else EVENT_KIND[decision.kind]
        self._event(
            time_s,
            event,
            cause=cause,
            failure=failure,
            downtime_s=downtime,
            bytes_moved=decision.bytes_moved * self.strategy.config.costs.moved_bytes_per_param / 4.0,
            lost_samples=lost_samples,
            nodes_used=len(layout.nodes) if layout is not None else 0,
            samples_per_s=layout.samples_per_s if layout is not None else 0.0,
            layout=layout.description if layout is not None else "",
            breakdown=";".join(f"{k}={v:.3f}" for k, v in breakdown),
            reason=decision.reason,
        )
        return time_s

    def _state(self, removed: list[int], joined: list[int], now: float) -> RunState:
        run = self.run
        assert run.layout is not None
        self._settle(now)
        return RunState(
            layout=run.layout,
            alive=tuple(sorted(self.alive)),
            removed=tuple(removed),
            joined=tuple(joined),
            step=run.steps,
            checkpoint_step=run.committed.iters if run.checkpointed else None,
        )

    # ----- main loop -------------------------------------------------------------------------
    def _arrive(self, name: str) -> int:
        self.ids[name] = self.next_id
        self.next_id += 1
        return self.ids[name]

    def _start(self, now: float, cause: str, failure: bool = False) -> bool:
        """A fresh start (or, after a stop, a restart) on the alive nodes; False if still nothing runs."""
        run = self.run
        decision = self.strategy.start(sorted(self.alive))
        kind = "oom" if decision.out_of_memory else EVENT_KIND[decision.kind]
        if decision.layout is None and self.counts.get(kind):
            return False  # still cannot run: already recorded
        restarting = run.started
        if restarting and decision.layout is not None:
            self._settle(now)
            rollback = run.committed.iters if run.checkpointed else 0
            decision = Decision(Kind.START, decision.layout, rollback_to_step=rollback, reason=decision.reason)
        run.started = run.started or decision.layout is not None
        self.first_layout = self.first_layout or decision.layout
        if self.first_start_s is None and decision.layout is not None:
            self.first_start_s = now
        if not restarting and not self.charge_start and decision.layout is not None:
            run.layout = decision.layout  # already running when the window opens (validation)
            return True
        self._apply(now, decision, cause=cause, restarting=restarting, failure=failure and restarting)
        return True

    def simulate(self) -> SimResult:
        first, rest = self.changes[0], self.changes[1:]
        if first.time_s > self.start_s:
            self._advance(self.start_s, min(first.time_s, self.end_s))  # nodes being created
        self.alive = {self._arrive(n) for n in first.added}
        now = self.opened_s = first.time_s
        self._start(now, cause="start")
        waiting: list[int] = []  # joined nodes whose change is carried out with the next one
        for index, change in enumerate(rest):
            self._advance(now, change.time_s)
            now = change.time_s
            removed = sorted(self.ids.pop(n) for n in change.removed)
            arrived = sorted(self._arrive(n) for n in change.added)
            joined = sorted({*waiting, *arrived} - set(removed))
            waiting = []
            self.alive.difference_update(removed)
            self.alive.update(joined)
            for node in removed:
                self._event(now, "failure", node=node)
            for node in arrived:
                self._event(now, "join", node=node)
            self._settle(now)
            run = self.run
            if removed and run.pending.iters:
                # A checkpoint still being written when a node dies is abandoned (its writer may be
                # gone): its iterations are not durable, but in-place recovery keeps them.
                run.uncommitted_from = min(run.pending_from, run.uncommitted_from)
                run.pending_from = math.inf
                run.uncommitted.add(run.pending.take())
                run.pending_durable_at = math.inf
            cause = f"-{len(removed)}+{len(joined)}"
            if run.layout is None:
                self._start(now, cause, failure=bool(removed))
            else:
                lost_working = bool(set(removed) & set(run.layout.nodes))
                following = rest[index + 1].time_s if index + 1 < len(rest) else self.end_s
                if not lost_working and now + self._to_step_boundary(now) > following:
                    # Nothing was lost and the next change comes before the step boundary where
                    # this one would be carried out: both are decided together then.
                    waiting = joined
                    self.kept_samples = run.total_samples
                    continue
                decision = self.strategy.on_change(self._state(removed, joined, now))
                now = self._apply(now, decision, cause=cause, failure=bool(removed), at_boundary=not lost_working)
                if run.layout is None and run.started:
                    # The job stopped: it is started again at once if the nodes alive allow it.
                    self._start(now, cause, failure=bool(removed))
            self.kept_samples = run.total_samples
        self._advance(now, self.end_s)
        self._finish_run()
        self.segments = split_durable(self.segments, self.rolled_back)
        return SimResult(self.segments, self.events, self._summary())

    def _finish_run(self) -> None:
        run, ns = self.run, self.run.node_seconds
        # Training simply ends here: completed iterations count, the one in flight does not.
        self._commit(run.pending)
        self._commit(run.uncommitted)
        if run.layout is not None and run.recovery_until <= self.end_s and not run.in_checkpoint:
            ns["lost"] += len(run.layout.nodes) * run.inflight_s

    def _summary(self) -> dict[str, Any]:
        run, ns = self.run, self.run.node_seconds
        duration = self.end_s - self.start_s
        total = sum(ns.values())
        samples = run.committed.samples
        kept = samples if self.kept_samples is None else self.kept_samples
        summary: dict[str, Any] = {
            **self.labels,
            "duration_s": duration,
            "samples": samples,
            "iterations": run.committed.iters,
            "throughput": samples / duration if duration > 0 else 0.0,
            "lost_samples": run.lost_samples,
            "kept_samples": kept,
            # Only a strategy that ran can lose its progress (one that never fits is marked OOM).
            "no_durable_progress": bool(run.started and kept <= 0),
            "ran": run.started,  # False: no layout ever started (out of memory, or refused the cluster)
            "node_seconds": total,
        }
        for kind in (
            "start",
            "reconfiguration",
            "failover",
            "reroute",
            "restart",
            "continue",
            "checkpoint",
            "stop",
            "oom",
            "failure",
            "join",
        ):
            summary[f"n_{kind}"] = self.counts.get(kind, 0)
        for key in BREAKDOWN:
            summary[f"{key}_node_s"] = ns[key]
            summary[f"{key}_fraction"] = ns[key] / total if total > 0 else 0.0
        # Out of memory only when it never ran: a strategy that could not lay the model out on the
        # first nodes and started once more joined (ReCycle needs two pipelines) started late.
        summary["oom"] = self.counts.get("oom", 0) > 0 and not run.started
        opened = self.opened_s if self.opened_s is not None else self.start_s
        summary["start_delay_s"] = self.first_start_s - opened if self.first_start_s is not None else math.nan
        summary.update(self._recovery_cycle())
        return summary

    def _recovery_cycle(self) -> dict[str, float | None]:
        """How long a failure keeps the job from durable progress when it restarts: the mean
        restart a failure caused, plus one checkpoint interval of the layout it started on and
        that checkpoint's pause and write (None when no failure made it restart or it never
        checkpoints). Beyond the time between failures no checkpoint becomes durable: the cliff
        of ``oobleck.sim.ratios``."""
        reactions = [e for e in self.events if e.get("failure") and e["kind"] in REACTIONS]
        restarts = [e["downtime_s"] for e in reactions if e["kind"] == "restart"]
        restart = sum(restarts) / len(restarts) if restarts else None
        cycle = None
        layout, interval = self.first_layout, self.strategy.checkpoint_every_steps
        if layout is not None and interval:
            pause, lag = self._checkpoint_pause(layout)
            cycle = interval * layout.iteration_s + pause + lag
        total = restart + cycle if restart is not None and cycle is not None else None
        return {
            "restart_s_mean": restart,
            "checkpoint_cycle_s": cycle,
            "recovery_cycle_s": total,
            # How often a failure made it restart (Varuna: every working node lost; Bamboo: only
            # a stage and its only copy lost together).
            "restart_share": len(restarts) / len(reactions) if reactions else 0.0,
        }


def simulate(
    strategy: Strategy,
    trace: Trace,
    *,
    duration_s: float | None = None,
    labels: Mapping[str, Any] | None = None,
    node_creation_s: float = 0.0,
    cache: CostCache | None = None,
    charge_start: bool = True,
) -> SimResult:
    """Replay ``trace`` (until ``duration_s`` after its first event, default its last event) for
    ``strategy``; nodes become usable ``node_creation_s`` after the trace adds them; without
    ``charge_start`` the job is already running at the trace's start (a real run's window)."""
    return Simulator(
        strategy,
        trace,
        duration_s=duration_s,
        labels=labels,
        node_creation_s=node_creation_s,
        cache=cache,
        charge_start=charge_start,
    ).simulate()

"""Discrete-event replay of a node trace for one strategy.

Time advances from one membership change to the next. Between changes the cluster is either
recovering (a reaction's downtime: no node makes progress), running a ``Layout`` (iterations of
``iteration_s``, and every ``checkpoint_every_steps`` iterations a checkpoint: ``Run.train`` of
``oobleck.sim.progress`` advances it in closed form), or stopped (no layout fits). Nodes join as
``oobleck.sim.arrivals.delayed_changes`` says (after their instance is created); the start
itself is charged like a restart without a checkpoint to read: every strategy pays for its start.

At a change the strategy decides (``Strategy.on_change``, the same decision the real runtime
executes) and ``oobleck.sim.charges.decision_downtime`` charges it by its kind (a ``continue`` that
lost a working node or put new nodes to work, torchft's, is a recovery in place). A change that took
a working node abandons the iteration in flight; one that did not (a join, a standby lost) is
carried out at the next step boundary: the iteration in flight completes first (a planned
checkpoint is taken there too). A restart, or a stop (the job dies: nothing fits, or there is
nothing to fall back on), also loses every iteration not in a durable checkpoint
(``oobleck.sim.progress``). A stopped job is started again as soon as the nodes alive allow a
layout (at once, or at the next join). A change that arrives during a recovery extends it: the
cluster runs again only when both the old and the new recovery are done (a second restart
starts its full restart time over; training never continues during a restart).

This module owns the event loop and how decisions are carried out; beside it,
``oobleck.sim.arrivals`` says when the trace's nodes become usable, ``oobleck.sim.progress`` keeps
the run's work on its way to durable and its node-seconds, and ``oobleck.sim.results`` names the
events and makes the rows and the summary.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from oobleck.faults.trace import Trace
from oobleck.sim.arrivals import delayed_changes
from oobleck.sim.charges import CostCache, decision_downtime
from oobleck.sim.progress import EPS, Run
from oobleck.sim.results import EVENT_KIND, SimResult, split_durable, summarize
from oobleck.strategy import Decision, Kind, Layout, RunState, Strategy


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
        self.run = Run()
        self.alive: set[int] = set()
        self.segments: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.counts: dict[str, int] = {}
        self.kept_samples: float | None = None  # at the last membership change
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

    def checkpoint_pause(self, layout: Layout) -> tuple[float, float]:
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
            return max(0.0, self.checkpoint_pause(run.layout)[0] - run.inflight_s)
        return max(0.0, run.layout.iteration_s - run.inflight_s)

    def _run_layout(self, t0: float, t1: float) -> None:
        layout = self.run.layout
        assert layout is not None
        interval = self.strategy.checkpoint_every_steps
        pause, lag = self.checkpoint_pause(layout)
        rate = layout.samples_per_iteration / layout.iteration_s
        if interval:
            rate = interval * layout.samples_per_iteration / (interval * layout.iteration_s + pause)
        self._segment(t0, t1, "running", rate)
        count, first, last = self.run.train(t0, t1, len(self.alive), interval, pause, lag)
        if count:
            # One row per running period (a long trace has tens of thousands of checkpoints):
            # ``count`` checkpoints completed, the first at ``first_time_s``, the last at ``time_s``.
            self._event(
                last,
                "checkpoint",
                count=int(count),
                first_time_s=first,
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
                run.abandon(time_s - run.inflight_s, time_s)
            run.inflight_s = 0.0
            run.in_checkpoint = False
        if decision.checkpoint_first:
            # Written synchronously before the restart: everything done so far is durable.
            run.commit(run.pending)
            run.commit(run.uncommitted)
            run.pending_durable_at = math.inf
            run.iters_since_checkpoint = 0
        elif decision.kind in (Kind.RESTART, Kind.STOP) and old is not None:
            lost_samples = run.roll_back(time_s)
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
        run.settle(now)
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
            run.settle(now)
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
            self.run.settle(now)
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
        self.segments = split_durable(self.segments, self.run.rolled_back)
        return SimResult(self.segments, self.events, summarize(self))

    def _finish_run(self) -> None:
        run, ns = self.run, self.run.node_seconds
        # Training simply ends here: completed iterations count, the one in flight does not.
        run.commit(run.pending)
        run.commit(run.uncommitted)
        if run.layout is not None and run.recovery_until <= self.end_s and not run.in_checkpoint:
            ns["lost"] += len(run.layout.nodes) * run.inflight_s


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

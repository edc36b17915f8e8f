"""Discrete-event replay of a node trace for one strategy.

Time advances from one membership change to the next. Between changes the cluster is either
recovering (a reaction's downtime: no node makes progress), running a ``Layout`` (iterations of
``iteration_s``, and every ``checkpoint_every_steps`` iterations a checkpoint of ``checkpoint_s``), or
stopped (no layout fits). Progress inside a running period is computed in closed form (whole
checkpoint cycles at once), so an 11-hour trace costs one step per change, not per iteration.

At a change the strategy decides (``Strategy.on_change``, the same decision the real runtime
executes) and ``decision_downtime`` charges it by its kind: a reconfiguration or failover its
fixed part plus the layer copies over the links, a restart the restart time (plus a checkpoint
first when it is planned). Unless the decision is ``continue``, the iteration in flight is lost,
and a restart also loses every iteration since the last completed checkpoint. A change that
arrives during a recovery extends it: the cluster runs again only when both the old and the new
recovery are done (a second restart starts its full restart time over).

Accounting is in node-seconds of alive nodes, split into useful work, redundant work (Bamboo),
checkpointing, restart, reconfiguration (incl. failover), lost work and idle nodes; the parts sum
to the alive node-seconds (a tested invariant). Throughput counts samples of iterations that
were never rolled back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from oobleck.faults.trace import Trace
from oobleck.sim.costs import layer_transfer_s
from oobleck.strategy import Decision, Kind, Layout, RunState, Strategy

# The event kind each decision is recorded as (the real runtime's events.csv uses the same names).
EVENT_KIND = {
    Kind.START: "start",
    Kind.RECONFIGURE: "reconfiguration",
    Kind.FAILOVER: "failover",
    Kind.RESTART: "restart",
    Kind.STOP: "stop",
}
# Event kinds that charge downtime (each has ``downtime_s``).
DOWNTIME_EVENTS = ("reconfiguration", "failover", "restart")


def decision_downtime(decision: Decision, strategy: Strategy, *, restarting: bool = False) -> tuple[float, tuple[tuple[str, float], ...]]:
    """Seconds no node makes progress for carrying out ``decision``, and their named parts.

    ``restarting``: a ``start`` after the job had stopped (it pays a restart).
    """
    costs = strategy.config.costs
    profile = strategy.context.profile
    kind = decision.kind
    if kind in (Kind.RECONFIGURE, Kind.FAILOVER):
        fixed = costs.reconfigure_fixed_s if kind is Kind.RECONFIGURE else costs.failover_s
        copy = layer_transfer_s(decision.transfers, strategy.context.cluster.inter_node_bandwidth, costs.moved_bytes_per_param / 4.0)
        return fixed + copy, (("fixed", fixed), ("state_copy", copy))
    if kind is Kind.RESTART or (kind is Kind.START and restarting):
        restart = costs.restart_s(profile)
        if decision.checkpoint_first:
            checkpoint = costs.checkpoint_s(profile)
            return checkpoint + restart, (("checkpoint", checkpoint), ("restart", restart))
        return restart, (("restart", restart),)
    return 0.0, ()

BREAKDOWN = ("useful", "redundant", "checkpoint", "restart", "reconfiguration", "lost", "idle")
EPS = 1e-9


@dataclass
class SimResult:
    """Tidy rows of one simulation: ``segments`` (throughput over time), ``events``, ``summary``."""

    segments: list[dict[str, Any]]
    events: list[dict[str, Any]]
    summary: dict[str, Any]


@dataclass
class _Run:
    """Mutable simulation state."""

    layout: Layout | None = None
    recovery_until: float = 0.0
    recovery_kind: str = "restart"
    iters_since_checkpoint: int = 0
    in_checkpoint: bool = False
    inflight_s: float = 0.0  # time spent on the current iteration or checkpoint
    uncommitted_iters: int = 0
    uncommitted_samples: float = 0.0
    uncommitted_busy: float = 0.0  # node-seconds of those iterations
    uncommitted_redundant: float = 0.0
    committed_samples: float = 0.0
    committed_iters: int = 0
    lost_samples: float = 0.0
    started: bool = False
    checkpointed: bool = False  # a checkpoint has completed (committed_iters is durable)
    node_seconds: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in BREAKDOWN})


class Simulator:
    """Replays ``trace`` for ``strategy``; ``labels`` are copied into every output row."""

    def __init__(
        self,
        strategy: Strategy,
        trace: Trace,
        *,
        duration_s: float | None = None,
        labels: Mapping[str, Any] | None = None,
    ) -> None:
        self.strategy = strategy
        self.trace = trace
        self.labels = dict(labels or {})
        self.labels.setdefault("strategy", strategy.name)
        self.labels.setdefault("trace", trace.name)
        changes = trace.changes()
        self.start_s = changes[0].time_s
        self.end_s = self.start_s + duration_s if duration_s is not None else trace.end_ms / 1000.0
        self.changes = [c for c in changes if c.time_s < self.end_s or c is changes[0]]
        # Every arrival is a fresh node id (a name may leave and come back as a new instance).
        self.ids: dict[str, int] = {}
        self.next_id = 0
        self.run = _Run()
        self.alive: set[int] = set()
        self.segments: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.counts: dict[str, int] = {}

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
            self._segment(t, t_to, "stopped", 0.0)
            return
        if run.recovery_until > t:
            end = min(run.recovery_until, t_to)
            ns[run.recovery_kind] += alive * (end - t)
            self._segment(t, end, "recovering", 0.0)
            t = end
        if t_to - t <= EPS:
            return
        self._run_layout(t, t_to)

    def _run_layout(self, t0: float, t1: float) -> None:
        run = self.run
        layout = run.layout
        assert layout is not None
        ns = run.node_seconds
        used = len(layout.nodes)
        ns["idle"] += (len(self.alive) - used) * (t1 - t0)
        period = layout.iteration_s
        interval = self.strategy.checkpoint_every_steps
        checkpoint = self.strategy.config.costs.checkpoint_s(self.strategy.context.profile) if interval else 0.0
        busy_per_iter = used * period
        rate = layout.samples_per_iteration / period
        if interval:
            rate = interval * layout.samples_per_iteration / (interval * period + checkpoint)
        self._segment(t0, t1, "running", rate)

        def complete(count: int) -> None:
            run.uncommitted_iters += count
            run.iters_since_checkpoint += count
            run.uncommitted_samples += count * layout.samples_per_iteration
            run.uncommitted_busy += count * busy_per_iter
            run.uncommitted_redundant += count * busy_per_iter * layout.redundant_fraction
            # Without periodic checkpoints nothing is ever durable: a rollback loses everything.

        remaining = t1 - t0
        checkpoints_done: list[float] = []
        while remaining > EPS:
            now = t1 - remaining
            if run.in_checkpoint:
                need = checkpoint - run.inflight_s
                if remaining < need:
                    run.inflight_s += remaining
                    ns["checkpoint"] += used * remaining
                    remaining = 0.0
                    break
                ns["checkpoint"] += used * need
                remaining -= need
                run.in_checkpoint, run.inflight_s, run.iters_since_checkpoint = False, 0.0, 0
                run.checkpointed = True
                self._commit()
                checkpoints_done.append(now + need)
                # Whole cycles of (interval iterations + one checkpoint) in closed form.
                cycle = interval * period + checkpoint
                cycles = int(remaining // cycle) if cycle > 0 else 0
                if cycles:
                    start = t1 - remaining
                    complete(cycles * interval)
                    ns["checkpoint"] += used * cycles * checkpoint
                    run.iters_since_checkpoint = 0
                    self._commit()
                    checkpoints_done.extend(start + (j + 1) * cycle for j in range(cycles))
                    remaining -= cycles * cycle
                continue
            need = period - run.inflight_s
            if remaining < need:
                run.inflight_s += remaining
                remaining = 0.0
                break
            remaining -= need
            run.inflight_s = 0.0
            complete(1)
            # Whole iterations up to the next checkpoint (or all of them without checkpoints).
            todo = interval - run.iters_since_checkpoint if interval else math.inf
            if todo > 0:
                count = int(min(todo, remaining // period))
                if count:
                    complete(count)
                    remaining -= count * period
            if interval and run.iters_since_checkpoint >= interval:
                run.in_checkpoint = True
        if checkpoints_done:
            # One row per running period (a long trace has tens of thousands of checkpoints):
            # ``count`` checkpoints completed, the first at ``first_time_s``, the last at ``time_s``.
            self._event(
                checkpoints_done[-1], "checkpoint", count=len(checkpoints_done),
                first_time_s=checkpoints_done[0], downtime_s=checkpoint,
            )

    def _commit(self) -> None:
        run, ns = self.run, self.run.node_seconds
        ns["useful"] += run.uncommitted_busy - run.uncommitted_redundant
        ns["redundant"] += run.uncommitted_redundant
        run.committed_samples += run.uncommitted_samples
        run.committed_iters += run.uncommitted_iters
        run.uncommitted_busy = run.uncommitted_redundant = run.uncommitted_samples = 0.0
        run.uncommitted_iters = 0

    # ----- decisions -------------------------------------------------------------------------
    def _apply(self, time_s: float, decision: Decision, cause: str = "", restarting: bool = False) -> None:
        run, ns = self.run, self.run.node_seconds
        lost_samples = 0.0
        if decision.kind is Kind.CONTINUE:
            run.layout = decision.layout if decision.layout is not None else run.layout
            return
        downtime, breakdown = decision_downtime(decision, self.strategy, restarting=restarting)
        old = run.layout
        if old is not None and run.recovery_until <= time_s + EPS:
            # The iteration in flight is abandoned (a checkpoint in flight just has to be redone).
            if not run.in_checkpoint:
                ns["lost"] += len(old.nodes) * run.inflight_s
            run.inflight_s = 0.0
        if decision.checkpoint_first and run.uncommitted_iters:
            self._commit()
            run.iters_since_checkpoint = 0
            run.in_checkpoint = False
            run.checkpointed = True
        if decision.kind is Kind.RESTART and not decision.checkpoint_first:
            ns["lost"] += run.uncommitted_busy
            lost_samples = run.uncommitted_samples
            run.lost_samples += lost_samples
            run.uncommitted_busy = run.uncommitted_redundant = run.uncommitted_samples = 0.0
            run.uncommitted_iters = run.iters_since_checkpoint = 0
            run.in_checkpoint, run.inflight_s = False, 0.0
        run.layout = decision.layout
        restart_like = decision.kind is Kind.RESTART or (decision.kind is Kind.START and restarting)
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
        event = "restart" if restart_like else ("oom" if decision.out_of_memory else EVENT_KIND[decision.kind])
        self._event(
            time_s,
            event,
            cause=cause,
            downtime_s=downtime,
            bytes_moved=decision.bytes_moved * self.strategy.config.costs.moved_bytes_per_param / 4.0,
            lost_samples=lost_samples,
            nodes_used=len(layout.nodes) if layout is not None else 0,
            samples_per_s=layout.samples_per_s if layout is not None else 0.0,
            layout=layout.description if layout is not None else "",
            breakdown=";".join(f"{k}={v:.3f}" for k, v in breakdown),
            reason=decision.reason,
        )

    def _state(self, removed: list[int], joined: list[int]) -> RunState:
        run = self.run
        assert run.layout is not None
        return RunState(
            layout=run.layout,
            alive=tuple(sorted(self.alive)),
            removed=tuple(removed),
            joined=tuple(joined),
            step=run.committed_iters + run.uncommitted_iters,
            checkpoint_step=run.committed_iters if run.checkpointed else None,
        )

    # ----- main loop -------------------------------------------------------------------------
    def _arrive(self, name: str) -> int:
        self.ids[name] = self.next_id
        self.next_id += 1
        return self.ids[name]

    def simulate(self) -> SimResult:
        first, rest = self.changes[0], self.changes[1:]
        self.alive = {self._arrive(n) for n in first.added}
        decision = self.strategy.start(sorted(self.alive))
        self.run.started = decision.layout is not None
        self._apply(self.start_s, decision, cause="start")
        now = self.start_s
        for change in rest:
            self._advance(now, change.time_s)
            now = change.time_s
            removed = sorted(self.ids.pop(n) for n in change.removed)
            joined = sorted(self._arrive(n) for n in change.added)
            self.alive.difference_update(removed)
            self.alive.update(joined)
            for node in removed:
                self._event(now, "failure", node=node)
            for node in joined:
                self._event(now, "join", node=node)
            cause = f"-{len(removed)}+{len(joined)}"
            if self.run.layout is None:
                decision = self.strategy.start(sorted(self.alive))
                kind = "oom" if decision.out_of_memory else EVENT_KIND[decision.kind]
                if decision.layout is None and self.counts.get(kind):
                    continue  # still cannot run: already recorded
                restarting = self.run.started
                self.run.started = self.run.started or decision.layout is not None
                self._apply(now, decision, cause=cause, restarting=restarting)
            else:
                self._apply(now, self.strategy.on_change(self._state(removed, joined)), cause=cause)
        self._advance(now, self.end_s)
        self._finish_run()
        return SimResult(self.segments, self.events, self._summary())

    def _finish_run(self) -> None:
        run, ns = self.run, self.run.node_seconds
        # Training simply ends here: completed iterations count, the one in flight does not.
        self._commit()
        if run.layout is not None and run.recovery_until <= self.end_s and not run.in_checkpoint:
            ns["lost"] += len(run.layout.nodes) * run.inflight_s

    def _summary(self) -> dict[str, Any]:
        run, ns = self.run, self.run.node_seconds
        duration = self.end_s - self.start_s
        total = sum(ns.values())
        summary: dict[str, Any] = {
            **self.labels,
            "duration_s": duration,
            "samples": run.committed_samples,
            "iterations": run.committed_iters,
            "throughput": run.committed_samples / duration if duration > 0 else 0.0,
            "lost_samples": run.lost_samples,
            "node_seconds": total,
        }
        for kind in ("reconfiguration", "failover", "restart", "checkpoint", "stop", "oom", "failure", "join"):
            summary[f"n_{kind}"] = self.counts.get(kind, 0)
        for key in BREAKDOWN:
            summary[f"{key}_node_s"] = ns[key]
            summary[f"{key}_fraction"] = ns[key] / total if total > 0 else 0.0
        summary["oom"] = self.counts.get("oom", 0) > 0
        return summary


def simulate(
    strategy: Strategy, trace: Trace, *, duration_s: float | None = None, labels: Mapping[str, Any] | None = None
) -> SimResult:
    """Replay ``trace`` (until ``duration_s`` after its first event, default its last event) for ``strategy``."""
    return Simulator(strategy, trace, duration_s=duration_s, labels=labels).simulate()

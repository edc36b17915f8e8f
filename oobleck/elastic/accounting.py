"""What a real run's outputs say about it: recoveries, fault tolerance, and summary.json's totals.

Observers of the controller (``oobleck.elastic.events``), so a recovery metric changes here and
never in the controller's core:

- ``RecoveryAccounting``: one ``Recovery`` per decision carried out after a membership change,
  filled in as its phases complete: detection and planning on the controller; process groups,
  state copy and checkpoint loading as the workers report them when the generation is
  established; the first step, once it commits. It then becomes a row of ``Outcome.recoveries``
  and an event (``reconfiguration``, ``failover``, ``restart`` or ``continue``) with its
  breakdown. A recovery overtaken by a newer change is recorded as superseded and its causes are
  carried into the newer one;
- ``ToleranceReport``: a plan that survives fewer than ``job.fault_tolerance`` failures in place
  is said so (event, summary, a warning line), for strategies whose plans promise it;
- ``ScheduleReport``: at the end, joins not absorbed, nodes left standing by, scheduled events
  never applied;
- ``HostReport``: the host's cores and load at the start and the end, and the run's own processes
  on it at most at once (summary.json's ``host`` object, ``oobleck.metrics.host``).

``summarize`` turns the run's ``Outcome`` into summary.json's totals; ``earlier_attempts`` reads
what a resumed run's earlier attempts did back from its run dir's rows (metrics.csv and
events.csv), so that summary.json covers the whole run: every step it committed (each once, the
last commit of a step redone after a rollback), every recovery and checkpoint, and each
attempt's boundaries (``attempts``: the steps it committed, where it resumed, how it ended).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from oobleck.elastic.events import RECOVERY_EVENTS, Continuation, EventKind, Execution, RunObserver
from oobleck.elastic.ledger import Outcome, StepLedger
from oobleck.elastic.membership import Changes, Membership
from oobleck.metrics.host import HostSnapshot, host_record, run_processes
from oobleck.planning.outputs import tolerated_failures
from oobleck.runtime.plan_document import PlanDocument
from oobleck.strategy import Layout

Emit = Callable[..., None]  # (EventKind, **fields): the controller's event log


@dataclass
class Recovery:
    """One decision carried out after a membership change, filled in as its phases complete."""

    kind: EventKind  # reconfiguration | failover | restart | continue
    generation: int
    reason: str  # what caused it: failure | join | notice
    decision: str  # the strategy's reason for what it decided
    removed: tuple[int, ...]
    joined: tuple[int, ...]
    failure_time: float  # wall clock of the earliest cause (kill, or join ready)
    detect_s: float
    plan_s: float
    started: float  # wall clock when the controller began acting
    resume_step: int
    bytes_moved: int
    rolled_back_steps: int = 0
    restart_nodes: tuple[int, ...] = ()
    note: str = ""


def _cause(removed: set[int], joined: set[int], leaving: tuple[int, ...]) -> str:
    """What a recovery answers: a failure, a join, or a preemption notice (nothing lost yet)."""
    if removed:
        return "failure"
    if leaving and not joined:
        return "notice"
    return "join"


class RecoveryAccounting(RunObserver):
    """Recoveries and their breakdown (see the module docstring)."""

    def __init__(self, outcome: Outcome, ledger: StepLedger, membership: Membership, emit: Emit) -> None:
        self.outcome = outcome
        self.ledger = ledger
        self.membership = membership
        self.emit = emit
        self.open: Recovery | None = None
        self.causes: list[float] = []  # cause times of the changes the next recovery absorbs
        self.detects: list[float] = []

    def changes_taken(self, changes: Changes, started: float) -> None:
        self.causes += [cause for cause, _ in changes.removed.values()] + list(changes.joined.values())
        self.detects += [detect for _, detect in changes.removed.values()]

    def executing(self, execution: Execution) -> None:
        carried = 0
        removed, joined = set(execution.state.removed), set(execution.state.joined)
        if self.open is not None:
            self.emit(self.open.kind.superseded(), superseded_generation=self.open.generation, by=execution.generation)
            self.causes.append(self.open.failure_time)
            carried = self.open.rolled_back_steps  # steps the superseded restart already rolled back
            # This recovery absorbs the superseded one's changes too (its generation may have been
            # established, so they are no longer in the state's difference from the base layout).
            removed |= set(self.open.removed)
            joined |= set(self.open.joined) - removed
        self.open = Recovery(
            kind=RECOVERY_EVENTS[execution.kind],
            generation=execution.generation,
            reason=_cause(removed, joined, execution.state.leaving),
            decision=execution.decision.reason,
            removed=tuple(sorted(removed)),
            joined=tuple(sorted(joined)),
            failure_time=min(self.causes) if self.causes else execution.started,
            detect_s=max(self.detects) if self.detects else 0.0,
            plan_s=execution.plan_s,
            started=execution.started,
            resume_step=execution.resume_step,
            bytes_moved=execution.decision.bytes_moved,
            rolled_back_steps=carried + execution.rolled_back_steps,
            restart_nodes=execution.restart_nodes,
            note=execution.note,
        )
        self.causes.clear()
        self.detects.clear()

    def continued(self, continuation: Continuation) -> None:
        lost = continuation.lost
        if lost and self.open is not None:  # lost before the workers recovered from the last loss
            self.open.removed = tuple(sorted({*self.open.removed, *lost}))
        elif lost:
            # A node doing work was lost and the strategy's own workers carry on (they heal in
            # place, e.g. torchft): the recovery lasts until the next committed step.
            self.open = Recovery(
                kind=EventKind.CONTINUE,
                generation=continuation.generation,
                reason="failure",
                decision=continuation.decision.reason,
                removed=lost,
                joined=(),
                failure_time=min(self.causes, default=continuation.started),
                detect_s=max(self.detects, default=0.0),
                plan_s=time.time() - continuation.started,
                started=continuation.started,
                resume_step=continuation.resume_step,
                bytes_moved=0,
            )
        self.causes.clear()
        self.detects.clear()

    def absorbed(self, generation: int) -> None:
        r = self.open
        if r is None:
            return
        self.open = None
        row = self.breakdown(r, time.time())
        self.outcome.recoveries.append({"kind": r.kind.value, **row})
        self.emit(r.kind, **row)

    def breakdown(self, r: Recovery, now: float) -> dict[str, Any]:
        """The recovery's row: its phases in seconds, what it moved, and how it ended."""
        generation = self.ledger.generations[r.generation]
        established = generation.established_at or now
        timings: list[dict[str, Any]] = generation.timings  # each rank's report (oobleck.runtime.worker)
        if r.kind is EventKind.CONTINUE:  # no new generation was established: nothing was rebuilt
            established, timings = r.started, []
        row: dict[str, Any] = {
            "generation": r.generation,
            "reason": r.reason,
            "decision": r.decision,
            "removed": list(r.removed),
            "joined": list(r.joined),
            "resume_step": r.resume_step,
            "detect_s": round(r.detect_s, 4),
            "plan_s": round(r.plan_s, 4),
            "groups_s": round(max((t["groups_s"] for t in timings), default=0.0), 4),
            "state_copy_s": round(max((t["state_copy_s"] for t in timings), default=0.0), 4),
            "bytes_moved": r.bytes_moved,
            "first_step_s": round(now - established, 4),
            "total_s": round(now - r.failure_time, 4),
            "replicas_identical": generation.replicas_identical,
        }
        if r.note:
            row["note"] = r.note
        # How fast the busiest receiver took its layers in, and (runtime.link_probe_mb > 0) the
        # raw gloo send/recv rate of the same channels just before, into the same memory again and
        # into fresh memory like the copy's (oobleck.runtime.transfer.probe_links).
        rates = [t["bytes_in"] / t["state_copy_s"] for t in timings if t.get("bytes_in") and t["state_copy_s"] > 0]
        if rates:
            row["copy_bytes_per_s"] = round(max(rates))
            # The receivers' own copy time: a source's clock starts when its own link probes end,
            # so state_copy_s (the max over every rank) also counts a source waiting for its
            # receiver to finish probing other channels.
            row["receiver_copy_s"] = round(max(t["state_copy_s"] for t in timings if t.get("bytes_in")), 4)
            # runtime.prefault_copies: the receivers' background allocation of their incoming
            # state (seconds on that thread), and the part of it the copy still waited for.
            row["prefault_s"] = round(max(t.get("prefault_s", 0.0) for t in timings if t.get("bytes_in")), 4)
            row["prefault_wait_s"] = round(max(t.get("prefault_wait_s", 0.0) for t in timings if t.get("bytes_in")), 4)
        for key in ("link_probe_bytes_per_s", "link_probe_cold_bytes_per_s"):
            probes = [rate for t in timings for rate in (t.get(key) or {}).values()]
            if probes:
                row[key] = round(statistics.median(probes))
        if r.kind is EventKind.RESTART:
            nodes = [self.membership.nodes[n] for n in r.restart_nodes]
            row["rolled_back_steps"] = r.rolled_back_steps
            row["stop_s"] = round(max((s.old_exited_at - r.started for s in nodes if s.old_exited_at), default=0.0), 4)
            row["spawn_s"] = round(max((s.registered_at - r.started for s in nodes if s.registered_at), default=0.0), 4)
            row["load_s"] = round(max((t.get("load_s", 0.0) for t in timings), default=0.0), 4)
            row["restarted_nodes"] = list(r.restart_nodes)
        return row


class ToleranceReport(RunObserver):
    """Says so whenever the published plan survives fewer failures in place than the job asks for
    (only for strategies whose plans promise it: ``Strategy.tolerates_in_place``)."""

    def __init__(self, outcome: Outcome, wanted: int, emit: Emit) -> None:
        self.outcome = outcome
        self.wanted = wanted
        self.emit = emit
        self.tolerated: int | None = None

    def published(self, document: PlanDocument, layout: Layout) -> None:
        plan = document.plan
        tolerated = tolerated_failures(plan)
        if tolerated < self.wanted and tolerated != self.tolerated:
            self.emit(
                EventKind.FAULT_TOLERANCE_REDUCED,
                tolerated=tolerated,
                wanted=self.wanted,
                pipelines=len(plan.pipelines),
            )
            self.outcome.fault_tolerance.append(
                {"step": document.resume_step, "tolerated": tolerated, "wanted": self.wanted}
            )
            print(
                f"oobleck: warning: the plan now survives only {tolerated} simultaneous node failure(s), "
                f"not job.fault_tolerance={self.wanted}",
                flush=True,
            )
        self.tolerated = tolerated


class ScheduleReport(RunObserver):
    """At the end of a run, what it did not get to: nodes still joining, nodes standing by, and
    scheduled events not yet due or armed and never struck."""

    def __init__(self, outcome: Outcome, ledger: StepLedger, membership: Membership, firing: Any, emit: Emit) -> None:
        self.outcome = outcome
        self.ledger = ledger
        self.membership = membership
        self.firing = firing
        self.emit = emit

    def finished(self) -> None:
        waiting = sorted(n for n, s in self.membership.nodes.items() if not s.failed and not s.up)
        if waiting:
            self.outcome.joins_not_absorbed = waiting
            self.emit(
                EventKind.JOIN_NOT_ABSORBED,
                nodes=waiting,
                reason="the run ended before these nodes were up (a worker takes seconds to start); join earlier or run more steps",
            )
        layout = self.ledger.layout
        if layout.standby:
            self.emit(EventKind.STANDBY_AT_END, nodes=list(layout.standby))
        unfired = self.firing.unfired()
        if self.firing.remaining or unfired:
            self.outcome.events_not_applied = self.firing.remaining + len(unfired)
            self.emit(
                EventKind.SCHEDULE_NOT_FINISHED,
                remaining_events=self.firing.remaining,
                armed_not_fired="; ".join(f"{e.origin} (phase {e.phase})" for e in unfired),
            )


def earlier_attempts(metrics: list[dict[str, Any]], events: list[dict[str, Any]], resume_step: int) -> Outcome:
    """What the attempts recorded in a run dir's ``metrics`` and ``events`` rows did, as the
    ``Outcome`` a resume from the checkpoint of ``resume_step`` continues: the steps before it
    (the last commit of each), the commits lost (rolled back, or after the checkpoint), the
    recoveries, checkpoints, failed checkpoints and fault-tolerance drops, the generations, and one
    row per attempt. Its ``attempt`` is the next attempt's number. Rows of a run dir written before
    attempts were numbered count as attempt 0."""
    outcome = Outcome()
    if not metrics and not events:
        return outcome
    last: dict[int, dict[str, Any]] = {}
    for row in metrics:
        last[int(row["step"])] = row
    outcome.steps = [dict(last[step]) for step in sorted(last) if step < resume_step]
    outcome.rolled_back_steps = len(metrics) - len(outcome.steps)
    recovery_kinds = {kind.value for kind in RECOVERY_EVENTS.values()}
    for row in events:
        kind, fields = row.get("kind"), {k: v for k, v in row.items() if k not in ("kind", "time_s", "attempt")}
        if kind in recovery_kinds:
            outcome.recoveries.append({"kind": kind, **fields})
        elif kind == EventKind.CHECKPOINT.value:
            outcome.checkpoints.append(fields)
        elif kind == EventKind.CHECKPOINT_FAILED.value:
            outcome.checkpoint_failures.append(
                {"checkpoint_step": fields.get("checkpoint_step"), "cause": fields.get("cause")}
            )
        elif kind == EventKind.FAULT_TOLERANCE_REDUCED.value:
            outcome.fault_tolerance.append(
                {"step": fields.get("step"), "tolerated": fields.get("tolerated"), "wanted": fields.get("wanted")}
            )
    numbers = sorted({int(row.get("attempt", 0) or 0) for row in [*metrics, *events]})
    for number in numbers:
        steps = [int(r["step"]) for r in metrics if int(r.get("attempt", 0) or 0) == number]
        rows = [r for r in events if int(r.get("attempt", 0) or 0) == number]
        times = [
            float(r["time_s"])
            for r in [*rows, *(r for r in metrics if int(r.get("attempt", 0) or 0) == number)]
            if "time_s" in r
        ]
        resumed = [r for r in rows if r.get("kind") == EventKind.RESUME.value]
        stops = [r for r in rows if r.get("kind") == EventKind.STOP.value]
        generations = [
            int(r["generation"])
            for r in [*rows, *metrics]
            if int(r.get("attempt", 0) or 0) == number and "generation" in r
        ]
        outcome.earlier_generations += max(generations) + 1 if generations else 0
        outcome.attempts.append(
            {
                "attempt": number,
                "resume_step": int(resumed[0]["resume_step"]) if resumed else 0,
                "first_step": min(steps) if steps else None,
                "last_step": max(steps) if steps else None,
                "started_time_s": min(times) if times else None,
                "ended_time_s": max(times) if times else None,
                "ended": str(stops[-1].get("reason")) if stops else "ended without a stop event (killed?)",
            }
        )
    outcome.attempt = numbers[-1] + 1 if numbers else 0
    outcome.generations = outcome.earlier_generations
    return outcome


class HostReport(RunObserver):
    """summary.json's ``host`` object: the snapshot taken before any process started, another at the
    end, and the most nodes the run's plans used (working) and kept (working or standing by) at once."""

    def __init__(self, cfg: Any, start: HostSnapshot) -> None:
        self.start = start
        self.gpus = int(cfg.cluster.gpus_per_node)
        self.local = str(cfg.cluster.kind) == "local"  # every node on this host; on Slurm only one
        self.fork_server = self.local and bool(cfg.cluster.fork_workers)
        self.kept = int(cfg.cluster.nodes) if self.local else 1  # every node started has its processes
        self.working = 0 if self.local else 1

    def published(self, document: PlanDocument, layout: Layout) -> None:
        if self.local:
            self.working = max(self.working, len(document.plan.nodes))
            self.kept = max(self.kept, len(document.plan.nodes) + len(layout.standby))

    def record(self) -> dict[str, Any]:
        """The host object, with the load as it is now."""
        return host_record(
            self.start,
            HostSnapshot.now(),
            run_processes=run_processes(nodes_on_host=self.kept, gpus_per_node=self.gpus, fork_server=self.fork_server),
            training_processes=(self.working or self.kept) * self.gpus,
        )


def summarize(outcome: Outcome, cfg: Any) -> dict[str, Any]:
    """Totals for summary.json: steps, samples, throughput, recoveries and their breakdown."""
    steps = outcome.steps
    rates = [s["samples_per_s"] for s in steps[1:]] or [s["samples_per_s"] for s in steps]
    recoveries = outcome.recoveries
    first = steps[0]["step"] if steps else None
    summary: dict[str, Any] = {
        "steps": len(steps),
        "first_step": first,
        "last_step": steps[-1]["step"] if steps else None,
        "consecutive_steps": [s["step"] for s in steps] == list(range(first or 0, (first or 0) + len(steps))),
        "samples": sum(s["samples"] for s in steps),
        "median_samples_per_s": round(statistics.median(rates), 3) if rates else 0.0,
        "final_loss": round(steps[-1]["loss"], 5) if steps else None,
        "generations": outcome.generations,
        "recoveries": len(recoveries),
        "retried_steps": sum(1 for s in steps if s["attempts"] > 1),
    }
    for kind in RECOVERY_EVENTS.values():
        chosen = [r for r in recoveries if r["kind"] == kind.value]
        if chosen:
            summary[f"{kind.value}s"] = len(chosen)
            for key in ("detect_s", "plan_s", "groups_s", "state_copy_s", "first_step_s", "total_s"):
                summary[f"{kind.value}_median_{key}"] = round(statistics.median(r[key] for r in chosen), 4)
    if recoveries:
        summary["recovery_median_total_s"] = round(statistics.median(r["total_s"] for r in recoveries), 4)
        summary["recovery_bytes_moved"] = sum(r["bytes_moved"] for r in recoveries)
        summary["resumed_at_steps"] = [r["resume_step"] for r in recoveries]
    if outcome.rolled_back_steps:
        summary["rolled_back_steps"] = outcome.rolled_back_steps
        summary["samples_rolled_back"] = outcome.rolled_back_steps * int(cfg.job.global_batch_size)
    if outcome.checkpoints:
        summary["checkpoints"] = len(outcome.checkpoints)
        summary["checkpoint_bytes"] = outcome.checkpoints[-1]["bytes"]
        summary["checkpoint_median_snapshot_s"] = round(
            statistics.median(c["snapshot_s"] for c in outcome.checkpoints), 4
        )
        summary["checkpoint_median_write_s"] = round(statistics.median(c["write_s"] for c in outcome.checkpoints), 4)
    if outcome.fault_tolerance:
        summary["fault_tolerance_min"] = min(f["tolerated"] for f in outcome.fault_tolerance)
        summary["fault_tolerance_wanted"] = outcome.fault_tolerance[0]["wanted"]
    if outcome.joins_not_absorbed:
        summary["joins_not_absorbed"] = outcome.joins_not_absorbed
    if outcome.events_not_applied:
        summary["events_not_applied"] = outcome.events_not_applied
    if outcome.stopped:
        summary["stopped"] = outcome.stopped.splitlines()[0]
    if outcome.checkpoint_failures:
        summary["checkpoints_failed"] = len(outcome.checkpoint_failures)
        summary["checkpoint_failures"] = [
            f"step {f['checkpoint_step']}: {f['cause']}" for f in outcome.checkpoint_failures
        ]
    if outcome.attempts:
        current = [s["step"] for s in steps if s.get("attempt", outcome.attempt) == outcome.attempt]
        summary["attempts"] = [
            *outcome.attempts,
            {
                "attempt": outcome.attempt,
                "resume_step": outcome.resume_step,
                "first_step": min(current) if current else None,
                "last_step": max(current) if current else None,
                "ended": (outcome.stopped or "finished").splitlines()[0],
            },
        ]
    if outcome.phase_seconds:
        # Where each surviving worker's step time went ("node:rank" -> phase -> seconds, summed
        # over the steps its last incarnation ran): the simulator's validation reads it.
        summary["phase_seconds"] = outcome.phase_seconds
    return summary

"""The step ledger: which steps committed, with which loss and time, in which generation.

The workers decide each step's commit among themselves in the store (``keys.decision``); the
ledger reads those decisions in step order, records one row per committed step (the mean loss
over the global batch, the step's own time as the deciding rank measured it, the attempts it
took; or what the worker's own ``step_report`` of it says), and keeps the generations'
bookkeeping: which plan each generation ran, when it was established, and whether every replica
of every layer was bit-identical then. A restart rolls the ledger back to the checkpoint's step:
the rows after it are dropped from the run's record (metrics.csv keeps them, appended as they
happened) and those steps are committed again.

``DecisionWatch`` tells the controller's loop the moment the step the ledger waits for is decided,
so the loop reads the store for commits only when there is one to read.

Every value is read through the run's key space (``oobleck.runtime.sealed_store``) and validated;
one the run did not write, or that does not parse, is dropped with one log line and never acted
on: a report becomes an empty one, a loss NaN, and a decision that cannot be read makes its step
*undecidable* (``undecidable``): the controller ends the generation and has the step redone
(``DecisionExecutor.redo``). That a value of a key the run already wrote can be overwritten at
all needs a client that lists the store's keys (``keys.KeySpace``): a commit decision overwritten
between two workers' reads may leave them a step apart, which the next generation's checksums
show (the run then stops saying so).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from oobleck.errors import RunError
from oobleck.runtime import keys
from oobleck.runtime.sealed_store import ForeignValue, SealedStore
from oobleck.strategy import Layout


@dataclass
class Generation:
    """One published generation: its layout, the step it resumes at, and what establishing it took."""

    number: int
    layout: Layout
    resume_step: int
    published_at: float
    established_at: float | None = None
    timings: list[dict[str, float]] = field(default_factory=list)
    replicas_identical: bool | None = None


@dataclass
class Outcome:
    """What the run did (for tests and the summary)."""

    steps: list[dict[str, Any]] = field(default_factory=list)  # the committed steps, in order, once each
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # reconfigurations, failovers, restarts
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    checkpoint_failures: list[dict[str, Any]] = field(default_factory=list)  # storage faults, with their cause
    probes: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)  # generation -> rank -> probe
    checksums: dict[int, dict[str, int]] = field(default_factory=dict)  # generation -> layer -> crc
    generations: int = 0
    stopped: str | None = None
    phase_seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # "node:rank" -> phase -> s
    joins_not_absorbed: list[int] = field(default_factory=list)  # joining nodes still booting at the end
    events_not_applied: int = 0  # scheduled events never due before the last step, or armed and never struck
    rolled_back_steps: int = 0  # steps committed, then lost to restarts from checkpoints
    fault_tolerance: list[dict[str, Any]] = field(default_factory=list)  # drops below the job's f
    # The run's earlier attempts (a resume continues their run dir): each one's boundaries
    # (``oobleck.elastic.accounting.earlier_attempts``); this attempt is the next.
    attempts: list[dict[str, Any]] = field(default_factory=list)
    earlier_generations: int = 0  # generations the earlier attempts published
    attempt: int = 0  # this attempt's number (0: the run's first)
    resume_step: int = 0  # the step this attempt started at


class StepLedger:
    """Commits and generations of one run (see the module docstring)."""

    def __init__(
        self,
        store: SealedStore,
        steps: int,
        global_batch: int,
        *,
        on_step: Callable[[dict[str, Any]], None],
        outcome: Outcome | None = None,
    ) -> None:
        """``outcome``: what the run did before (a resume's earlier attempts), continued here."""
        self.store = store
        self.steps = steps
        self.global_batch = global_batch
        self.on_step = on_step
        self.outcome = outcome if outcome is not None else Outcome()
        self.generations: dict[int, Generation] = {}
        self.generation = -1  # the newest published generation
        self.base = -1  # the newest established generation (its workers hold the committed state)
        self.next_step = 0
        self.attempts: dict[int, int] = {}
        self.last_commit_time = 0.0
        self.checkpoint_boundaries: list[tuple[int, int]] = []  # (generation, committed steps) to checkpoint
        self.undecidable: int | None = None  # a step of the newest generation whose decision cannot be read

    # ------------------------------------------------------------------ generations
    def publish(self, number: int, layout: Layout, resume_step: int) -> Generation:
        generation = Generation(number, layout, resume_step, published_at=time.time())
        self.generations[number] = generation
        self.generation = number
        self.outcome.generations = self.outcome.earlier_generations + number + 1
        return generation

    def establishing(self) -> bool:
        """Whether the newest generation's establishment (and its ranks' reports) is still awaited."""
        return self.generation >= 0 and self.generation not in self.outcome.checksums

    @property
    def layout(self) -> Layout:
        """The layout of the newest established generation (what holds the committed state)."""
        return self.generations[self.base if self.base >= 0 else self.generation].layout

    def check_established(self) -> Generation | None:
        """The newest generation, once it is established and every rank's report (timings,
        checksums, resource probe) is in; raises when replicas of a layer differ. Reads only keys
        that exist, so a rank that dies right after the barrier cannot stall the controller."""
        number = self.generation
        if number < 0 or number in self.outcome.checksums:
            return None
        generation = self.generations[number]
        if generation.established_at is None:
            if self.store.read(keys.established(number)) != keys.YES.encode():
                return None
            generation.established_at = time.time()
            self.base = number
        ranks = [a.rank for a in generation.layout.plan.assignments()]
        reports = (
            [keys.timing(number, r) for r in ranks]
            + [keys.checksums(number, r) for r in ranks]
            + [keys.probe(number, r) for r in ranks]
        )
        if not self.store.check(reports):
            return None
        # A report the run did not write, or that does not parse, is dropped (one log line): the
        # rank's timings count as zero, its layers are not compared, its probe is empty.
        timings = self.store.read_present([keys.timing(number, r) for r in ranks], parse_timing)
        generation.timings = [t if isinstance(t, dict) else dict(EMPTY_TIMING) for t in timings.values()]
        merged: dict[str, int] = {}
        identical = True
        for crcs in self.store.read_present([keys.checksums(number, r) for r in ranks], parse_checksums).values():
            for layer, crc in (crcs if isinstance(crcs, dict) else {}).items():
                if merged.setdefault(layer, crc) != crc:
                    identical = False
        self.outcome.checksums[number] = merged if identical else {}
        probes = self.store.read_present([keys.probe(number, r) for r in ranks], parse_object)
        self.outcome.probes[number] = {
            r: probe if isinstance(probe, dict) else {} for r, probe in zip(ranks, probes.values())
        }
        generation.replicas_identical = identical
        if not identical:
            raise RunError(f"generation {number}: replicas of some layer differ after establishing (checksum mismatch)")
        return generation

    def abandon(self, number: int) -> None:
        """End generation ``number``: it is marked never established unless it already was (then
        its workers hold the committed state and it becomes the base)."""
        try:
            established = self.store.compare_set(keys.established(number), "", keys.NO).decode()
        except ForeignValue:  # dropped: the generation counts as never established
            established = keys.NO
        if established == keys.YES:
            self.base = number
            generation = self.generations[number]
            if generation.established_at is None:
                generation.established_at = time.time()
        self.store.set(keys.abort(number), "1")

    # ------------------------------------------------------------------ steps
    def awaited(self) -> str | None:
        """The decision key of the next step to commit (None: none is awaited)."""
        if self.generation < 0 or self.next_step >= self.steps:
            return None
        return keys.decision(self.generation, self.next_step)

    def check_commits(self) -> None:
        """Record the steps the workers committed since the last look; a decision that cannot be
        read marks its step ``undecidable``."""
        while self.generation >= 0 and self.next_step < self.steps:
            key = keys.decision(self.generation, self.next_step)
            if not self.store.check([key]):
                return
            decision = self.store.read(key, keys.parse_decision)
            if decision is None:
                self.undecidable = self.next_step
                return
            if decision[0] == keys.ABORT:
                return
            self.record_commit(self.generation, self.next_step, decision)

    def take_in_flight(self) -> int:
        """Decide the step in flight of the newest generation now: committed ones are recorded,
        the first undecided one is aborted. Returns the first step not committed."""
        generation = self.generation
        self.undecidable = None
        while self.next_step < self.steps:
            key = keys.decision(generation, self.next_step)
            try:
                decision = keys.parse_decision(self.store.compare_set(key, "", keys.ABORT))
            except (ForeignValue, ValueError) as error:  # cannot be read: the step is redone
                self.store.dropped(key, str(error))
                break
            if decision[0] == keys.ABORT:
                break
            self.record_commit(generation, self.next_step, decision)
        return self.next_step

    def record_commit(self, generation: int, step: int, decision: tuple[str, float | None]) -> None:
        plan = self.generations[generation].layout.plan
        # A worker whose replicas change within a generation reports the step itself (keys.step_report).
        report = self.store.read(keys.step_report(generation, step), parse_step_report)
        report = dict(report) if isinstance(report, dict) else {}
        samples = int(report.pop("samples", self.global_batch))
        if "loss_sum" in report:
            loss_sum = float(report.pop("loss_sum"))
        else:
            last = [a.rank for a in plan.assignments() if a.stage == plan.pipelines[a.pipeline].template.num_stages - 1]
            losses = self.store.read_present([keys.loss(generation, step, r) for r in last], parse_loss)
            # A loss that is missing or was dropped makes the step's loss unknown (NaN), not wrong.
            known = [v for v in losses.values() if isinstance(v, float)]
            loss_sum = sum(known) if len(known) == len(last) else math.nan
        now = time.time()
        observed = now - self.last_commit_time
        self.last_commit_time = now
        kind, seconds = decision
        step_time = seconds or observed
        attempts = self.attempts.get(step, 0) + 1
        self.attempts[step] = attempts
        row = {
            "step": step,
            "samples": samples,
            "samples_per_s": samples / step_time if step_time > 0 else 0.0,
            "loss": loss_sum / samples if samples else 0.0,
            "generation": generation,
            "pipelines": len(plan.pipelines),
            "attempts": attempts,
            "step_time_s": step_time,
            "nodes": len(plan.nodes),
            "attempt": self.outcome.attempt,
        }
        row.update({k: v for k, v in report.items() if k not in ("step", "generation")})
        self.outcome.steps.append(row)
        self.on_step(row)
        self.next_step = step + 1
        if kind == keys.COMMIT_CHECKPOINT:
            self.checkpoint_boundaries.append((generation, step + 1))

    def count_attempt(self, step: int) -> None:
        """A step interrupted before it committed will be attempted again."""
        self.attempts[step] = self.attempts.get(step, 0) + 1

    def roll_back(self, to_step: int) -> int:
        """Forget the commits of steps ``to_step`` and later (a restart from a checkpoint); returns
        how many were rolled back."""
        kept = [row for row in self.outcome.steps if row["step"] < to_step]
        lost = len(self.outcome.steps) - len(kept)
        self.outcome.steps = kept
        self.outcome.rolled_back_steps += lost
        self.next_step = to_step
        # Checkpoints of the steps rolled back are not this run's any more, even where their
        # commit was read but not yet handed to the checkpoint coordinator.
        self.checkpoint_boundaries = [(g, b) for g, b in self.checkpoint_boundaries if b <= to_step]
        return lost


EMPTY_TIMING = {"groups_s": 0.0, "state_copy_s": 0.0, "load_s": 0.0, "bytes_in": 0, "bytes_out": 0}


def parse_object(value: bytes) -> dict[str, Any]:
    data = json.loads(value)
    if not isinstance(data, dict):
        raise ValueError(f"not a JSON object: {value[:80]!r}")
    return data


def parse_timing(value: bytes) -> dict[str, Any]:
    """A rank's establishment timings (``oobleck.runtime.worker``): numbers in seconds and bytes."""
    data = parse_object(value)
    for name in EMPTY_TIMING:
        if name in data and not _finite(data[name]):
            raise ValueError(f"{name}={data[name]!r} is not a number")
    return {**EMPTY_TIMING, **data}


def parse_checksums(value: bytes) -> dict[str, int]:
    data = parse_object(value)
    if not all(isinstance(crc, int) and not isinstance(crc, bool) for crc in data.values()):
        raise ValueError("a checksum is not an integer")
    return data


def parse_loss(value: bytes) -> float:
    loss = float(value)
    if not _finite(loss):
        raise ValueError(f"loss {loss} is not finite")
    return loss


def parse_step_report(value: bytes) -> dict[str, Any]:
    """A worker's own account of a step (``keys.step_report``): ``loss_sum`` and ``samples`` numbers."""
    data = parse_object(value)
    if "loss_sum" in data and not _finite(data["loss_sum"]):
        raise ValueError(f"loss_sum={data['loss_sum']!r} is not a number")
    if "samples" in data and not (isinstance(data["samples"], int) and data["samples"] >= 0):
        raise ValueError(f"samples={data['samples']!r} is not a count")
    return data


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# A TCPStore wait needs a timeout, and c10d logs two lines for each one that expires; the slice
# bounds nothing (the key the watch waits for is always set: see DecisionWatch).
DECISION_WATCH_SLICE_S = 3600.0


class DecisionWatch:
    """A thread, on its own store connection, that waits for the decision key the ledger awaits
    (``follow``) and calls ``wake`` when it is set.

    Without it the controller's loop polled the store for commits every tick (500 round trips a
    second, most of the controller's CPU, taken from the workers on a small machine). The awaited
    key changes only once it is set: by the workers' commit, or by the controller's own abort of
    the step in flight (``StepLedger.take_in_flight`` and the stop message), which come before
    every new generation and the end of a run; so the thread never waits on a key nobody sets.
    """

    def __init__(self, store: Any, wake: Callable[[], None], timed_out: type[BaseException]) -> None:
        self._store = store  # this thread's own connection
        self._wake = wake
        self._timed_out = timed_out  # what the store raises when a wait's slice ends
        self._key: str | None = None
        self._changed = threading.Event()
        self._closed = False
        self._decided = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="decision-watch")
        self._thread.start()

    def follow(self, key: str | None) -> None:
        """Wait for ``key`` from now on (None: for nothing)."""
        if key != self._key:
            self._key = key
            self._changed.set()

    def take(self) -> bool:
        """Whether a followed key was set since the last call."""
        decided = self._decided.is_set()
        if decided:
            self._decided.clear()
        return decided

    def _run(self) -> None:
        slice_ = timedelta(seconds=DECISION_WATCH_SLICE_S)
        decided: str | None = None
        while not self._closed:
            key = self._key
            if key is None or key == decided:
                self._changed.wait()
                self._changed.clear()
                continue
            try:
                self._store.wait([key], slice_)
            except self._timed_out:
                continue  # a slice ended: keep waiting
            except Exception:
                return  # the store is gone: the run is over
            decided = key
            self._decided.set()
            self._wake()

    def close(self, timeout_s: float = 2.0) -> None:
        """End the thread. Call it after the controller's stop message, which sets the key it
        waits on (else it would still wait when the store goes, and c10d logs a trace then)."""
        self._closed = True
        self._changed.set()
        self._thread.join(timeout=timeout_s)

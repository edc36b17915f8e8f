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
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from oobleck.errors import RunError
from oobleck.runtime import keys
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
    probes: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)  # generation -> rank -> probe
    checksums: dict[int, dict[str, int]] = field(default_factory=dict)  # generation -> layer -> crc
    generations: int = 0
    stopped: str | None = None
    phase_seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # "node:rank" -> phase -> s
    joins_not_absorbed: list[int] = field(default_factory=list)  # joining nodes still booting at the end
    events_not_applied: int = 0  # scheduled events never due before the last step, or armed and never struck
    rolled_back_steps: int = 0  # steps committed, then lost to restarts from checkpoints
    fault_tolerance: list[dict[str, Any]] = field(default_factory=list)  # drops below the job's f


class StepLedger:
    """Commits and generations of one run (see the module docstring)."""

    def __init__(self, store: Any, steps: int, global_batch: int, *, on_step: Callable[[dict[str, Any]], None]) -> None:
        self.store = store
        self.steps = steps
        self.global_batch = global_batch
        self.on_step = on_step
        self.outcome = Outcome()
        self.generations: dict[int, Generation] = {}
        self.generation = -1  # the newest published generation
        self.base = -1  # the newest established generation (its workers hold the committed state)
        self.next_step = 0
        self.attempts: dict[int, int] = {}
        self.last_commit_time = 0.0
        self.checkpoint_boundaries: list[tuple[int, int]] = []  # (generation, committed steps) to checkpoint

    # ------------------------------------------------------------------ generations
    def publish(self, number: int, layout: Layout, resume_step: int) -> Generation:
        generation = Generation(number, layout, resume_step, published_at=time.time())
        self.generations[number] = generation
        self.generation = number
        self.outcome.generations = number + 1
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
            key = keys.established(number)
            if not self.store.check([key]) or self.store.get(key).decode() != keys.YES:
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
        generation.timings = [json.loads(self.store.get(keys.timing(number, r))) for r in ranks]
        merged: dict[str, int] = {}
        identical = True
        for r in ranks:
            for layer, crc in json.loads(self.store.get(keys.checksums(number, r))).items():
                if merged.setdefault(layer, crc) != crc:
                    identical = False
        self.outcome.checksums[number] = merged if identical else {}
        self.outcome.probes[number] = {r: json.loads(self.store.get(keys.probe(number, r))) for r in ranks}
        generation.replicas_identical = identical
        if not identical:
            raise RunError(f"generation {number}: replicas of some layer differ after establishing (checksum mismatch)")
        return generation

    def abandon(self, number: int) -> None:
        """End generation ``number``: it is marked never established unless it already was (then
        its workers hold the committed state and it becomes the base)."""
        if self.store.compare_set(keys.established(number), "", keys.NO).decode() == keys.YES:
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
        while self.generation >= 0 and self.next_step < self.steps:
            key = keys.decision(self.generation, self.next_step)
            if not self.store.check([key]):
                return
            value = self.store.get(key).decode()
            if not keys.is_commit(value):
                return
            self.record_commit(self.generation, self.next_step, value)

    def take_in_flight(self) -> int:
        """Decide the step in flight of the newest generation now: committed ones are recorded,
        the first undecided one is aborted. Returns the first step not committed."""
        generation = self.generation
        while self.next_step < self.steps:
            value = self.store.compare_set(keys.decision(generation, self.next_step), "", keys.ABORT).decode()
            if not keys.is_commit(value):
                break
            self.record_commit(generation, self.next_step, value)
        return self.next_step

    def record_commit(self, generation: int, step: int, value: str) -> None:
        plan = self.generations[generation].layout.plan
        report_key = keys.step_report(generation, step)
        # A worker whose replicas change within a generation reports the step itself (keys.step_report).
        report = json.loads(self.store.get(report_key)) if self.store.check([report_key]) else {}
        samples = int(report.pop("samples", self.global_batch))
        if "loss_sum" in report:
            loss_sum = float(report.pop("loss_sum"))
        else:
            last = [a.rank for a in plan.assignments() if a.stage == plan.pipelines[a.pipeline].template.num_stages - 1]
            loss_sum = sum(
                float(value.decode()) for value in self.store.multi_get([keys.loss(generation, step, r) for r in last])
            )
        now = time.time()
        observed = now - self.last_commit_time
        self.last_commit_time = now
        step_time = keys.decision_step_time(value) or observed
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
        }
        row.update({k: v for k, v in report.items() if k not in ("step", "generation")})
        self.outcome.steps.append(row)
        self.on_step(row)
        self.next_step = step + 1
        if keys.decision_kind(value) == keys.COMMIT_CHECKPOINT:
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
        return lost


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

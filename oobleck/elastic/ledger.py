"""The step ledger: which steps committed, with which loss and time, in which generation.

The workers decide each step's commit among themselves in the store (``keys.decision``); the
ledger reads those decisions in step order, records one row per committed step (the mean loss
over the global batch, the step's own time as the deciding rank measured it, the attempts it
took; or what the worker's own ``step_report`` of it says), and keeps the generations'
bookkeeping: which plan each generation ran, when it was established, and whether every replica
of every layer was bit-identical then. A restart rolls the ledger back to the checkpoint's step:
the rows after it are dropped from the run's record (metrics.csv keeps them, appended as they
happened) and those steps are committed again.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

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
    established_at: Optional[float] = None
    timings: list[dict[str, float]] = field(default_factory=list)
    replicas_identical: Optional[bool] = None


@dataclass
class Outcome:
    """What the run did (for tests and the summary)."""

    steps: list[dict[str, Any]] = field(default_factory=list)  # the committed steps, in order, once each
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # reconfigurations, failovers, restarts
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    probes: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)  # generation -> rank -> probe
    checksums: dict[int, dict[str, int]] = field(default_factory=dict)  # generation -> layer -> crc
    generations: int = 0
    stopped: Optional[str] = None
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

    @property
    def layout(self) -> Layout:
        """The layout of the newest established generation (what holds the committed state)."""
        return self.generations[self.base if self.base >= 0 else self.generation].layout

    def check_established(self) -> Optional[Generation]:
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
        reports = [keys.timing(number, r) for r in ranks] + [keys.checksums(number, r) for r in ranks] + [keys.probe(number, r) for r in ranks]
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
            loss_sum = sum(float(self.store.get(keys.loss(generation, step, r)).decode()) for r in last)
        now = time.time()
        observed = now - self.last_commit_time
        self.last_commit_time = now
        step_time = observed
        if self.store.check([keys.step_time(generation, step)]):
            step_time = float(self.store.get(keys.step_time(generation, step)).decode())
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
        if value == keys.COMMIT_CHECKPOINT:
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

"""The controller's side of checkpoints: which are in progress, completing them, failures, retention.

Workers decide *when* among themselves (the rank that commits a step marks it ``commit+checkpoint``
every ``checkpoint.every_steps`` committed steps, or at the first boundary after a request the
controller puts in the store: ``checkpoint.every_s``, a planned restart, Slurm's warning signal);
each layer's designated writer (``assign_checkpoint_writers``, published with the generation)
snapshots it and writes its shard in the background, then reports the shard's record in the
store. This coordinator notices every layer's record, writes the manifest last (the commit point),
applies retention, records a ``checkpoint`` event, and abandons a checkpoint whose writer died
before reporting. ``latest_step`` is what restarts roll back to.

Storage faults are the checkpoint's, not the run's: a writer that could not write its shards
reports the cause in their records (a full or read-only file system, a write that outlasted
``checkpoint.write_timeout_s``), a shard record that is not valid is dropped, and a
manifest write that fails (``OSError``) fails its checkpoint; each is a ``checkpoint_failed``
event with the cause, one warning line, and a row of ``Outcome.checkpoint_failures``
(summary.json). Training goes on; a restart uses the newest checkpoint that completed.

Retention never removes a checkpoint that a live or pending decision refers to (``pin``): the one
a restart is loading until its workers hold the state, and the one the run resumed from until its
first generation is established.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oobleck.checkpoint import Manifest, ShardRecord, checkpoint_root, fingerprint, prune, step_dir, write_manifest
from oobleck.checkpoint.assignment import assign_checkpoint_writers
from oobleck.checkpoint.durable import describe_cause
from oobleck.elastic.events import EventKind
from oobleck.elastic.ledger import parse_object
from oobleck.errors import CheckpointError
from oobleck.planning.outputs import ExecutionPlan, Worker
from oobleck.runtime import keys
from oobleck.runtime.plan_document import CheckpointPlan
from oobleck.runtime.sealed_store import SealedStore


@dataclass
class Pending:
    boundary: int  # committed steps the checkpoint holds
    generation: int
    writers: dict[int, Worker]  # layer -> the worker writing it
    noticed: float
    train_time_s: float = 0.0  # the run's training time at the boundary (earlier attempts included)
    records: dict[int, ShardRecord] = field(default_factory=dict)


def parse_shard_report(value: bytes) -> ShardRecord | str:
    """What a writer reported for one layer (``keys.checkpoint_shard``): its shard's record, or
    why it could not write it (``{"layer": l, "failed": cause}``)."""
    data = parse_object(value)
    if "failed" in data:
        if not isinstance(data["failed"], str):
            raise ValueError(f"not a failure report: {value[:80]!r}")
        return data["failed"]
    try:
        return ShardRecord.from_dict(data)
    except CheckpointError as error:
        raise ValueError(str(error)) from None


class CheckpointCoordinator:
    def __init__(
        self,
        cfg: Any,
        run_dir: Path,
        store: SealedStore,
        every_steps: int,
        *,
        event: Callable[..., None],
        extra: dict[str, Any],
        clock: Callable[[], float] = lambda: 0.0,
    ) -> None:
        """``clock``: the run's training time so far (written in each manifest: a resume continues
        the failure schedule's clock from there)."""
        self.cfg = cfg
        self.store = store
        self.every_steps = every_steps
        self.every_s = cfg.checkpoint.every_s
        self.keep = int(cfg.checkpoint.keep)
        self.root = checkpoint_root(cfg.checkpoint.dir, run_dir).resolve()
        self.event = event
        self.extra = extra
        self.clock = clock
        self.fingerprint = fingerprint(cfg)
        self.num_layers = 0
        self.pending: dict[int, Pending] = {}
        self.completed: dict[int, Path] = {}  # boundary -> step dir of a complete checkpoint
        self.failed: dict[int, str] = {}  # boundary -> why it failed
        self.pinned: set[int] = set()  # boundaries a live or pending decision refers to
        self.last_completed_at = time.time()
        self.requested: int | None = None
        self.completed_rows: list[dict[str, Any]] = []  # one per completed checkpoint (events.csv's)
        self.failure_rows: list[dict[str, Any]] = []  # one per failed checkpoint

    def adopt(self, step: int, path: Path) -> None:
        """A checkpoint that exists already (the one a run resumes from)."""
        self.completed[step] = path

    def latest_step(self) -> int | None:
        return max(self.completed) if self.completed else None

    def path(self, step: int) -> Path:
        return self.completed[step]

    def pin(self, step: int | None) -> None:
        """Keep ``step``'s checkpoint from retention until ``unpin`` (a decision refers to it)."""
        if step is not None and step > 0:
            self.pinned.add(step)

    def unpin(self, step: int | None) -> None:
        if step is not None:
            self.pinned.discard(step)

    # ------------------------------------------------------------------ generations
    def writers(self, plan: ExecutionPlan, layer_bytes: list[int]) -> dict[int, Worker]:
        """Who writes each layer's shard in a generation of ``plan``: layer -> (node, local rank)."""
        self.num_layers = plan.num_layers
        holders = {layer: [w for w in workers] for layer, workers in plan.layer_holders().items()}
        assigned = assign_checkpoint_writers(holders, dict(enumerate(layer_bytes)))
        return {layer: (int(worker[0]), int(worker[1])) for layer, worker in sorted(assigned.items())}

    def document(self, plan: ExecutionPlan, layer_bytes: list[int]) -> CheckpointPlan:
        """What a generation's plan document says about checkpoints (every worker reads it)."""
        # Writers are named even without periodic checkpoints: a checkpoint may be asked for at
        # any boundary of this generation (a signal before a time limit, a planned restart).
        return CheckpointPlan(str(self.root), self.every_steps, self.writers(plan, layer_bytes))

    # ------------------------------------------------------------------ progress
    def request(self, at_least: int) -> None:
        """Ask for a checkpoint at the first step boundary at or after ``at_least`` committed steps."""
        self.requested = at_least
        self.store.set(keys.CHECKPOINT_REQUEST, str(at_least))

    def maybe_request_by_time(self, next_step: int) -> None:
        if self.every_s is not None and self.requested is None and not self.pending:
            if time.time() - self.last_completed_at >= float(self.every_s):
                self.request(next_step + 1)

    def noticed(self, generation: int, boundary: int, writers: Mapping[int, Worker]) -> None:
        """A step committed with a checkpoint after it: its shards are being written."""
        if boundary in self.completed:
            return
        self.failed.pop(boundary, None)  # the step is checkpointed again (after a rollback)
        self.pending[boundary] = Pending(boundary, generation, dict(writers), time.time(), self.clock())
        if self.requested is not None and boundary >= self.requested:
            self.requested = None

    def writer_lost(self, node: int) -> None:
        """A node died: a checkpoint still waiting for one of its shards will never complete."""
        for boundary, pending in list(self.pending.items()):
            waiting = {
                layer for layer, worker in pending.writers.items() if worker[0] == node and layer not in pending.records
            }
            if waiting and self._collect(pending) is False:
                del self.pending[boundary]
                self.event(
                    EventKind.CHECKPOINT_ABANDONED,
                    checkpoint_step=boundary,
                    reason=f"node {node} died before writing layers {sorted(waiting)}",
                )

    def poll(self) -> list[int]:
        """Complete every checkpoint whose shards have all been reported, and fail those a writer
        could not write; returns the boundaries completed."""
        done = []
        for boundary, pending in sorted(self.pending.items()):
            collected = self._collect(pending)
            if isinstance(collected, str):
                del self.pending[boundary]
                self._fail(boundary, collected)
            elif collected:
                del self.pending[boundary]
                if self._complete(pending):
                    done.append(boundary)
        return done

    def _collect(self, pending: Pending) -> bool | str:
        """True once every layer's record is in; False while some are awaited; the cause when a
        writer reported that it could not write a layer, or a report is not valid."""
        for layer in pending.writers:
            if layer in pending.records:
                continue
            key = keys.checkpoint_shard(pending.boundary, layer)
            if not self.store.check([key]):
                return False
            report = self.store.read(key, parse_shard_report)
            if isinstance(report, str):
                node = pending.writers[layer][0]
                return f"node {node} could not write layer {layer}: {report}"
            if not isinstance(report, ShardRecord) or report.layer != layer:
                return f"the report of layer {layer}'s shard is not valid (dropped)"
            pending.records[layer] = report
        return True

    def _complete(self, pending: Pending) -> bool:
        started = time.time()
        path = step_dir(self.root, pending.boundary)
        try:
            manifest = Manifest.build(
                pending.boundary,
                self.fingerprint,
                pending.records.values(),
                len(pending.writers),
                extra={**self.extra, "train_time_s": round(pending.train_time_s, 4)},
            )
            write_manifest(path, manifest)
        except OSError as error:
            self._fail(pending.boundary, f"the manifest could not be written: {describe_cause(error)}")
            return False
        except CheckpointError as error:
            self._fail(pending.boundary, str(error))
            return False
        timings = []
        ranks = {tuple(w) for w in pending.writers.values()}
        for node, local_rank in ranks:
            timing = self.store.read(keys.checkpoint_timing(pending.boundary, node, local_rank), parse_object)
            if isinstance(timing, dict):
                timings.append(timing)
        self.completed[pending.boundary] = path
        self.last_completed_at = time.time()
        self._retain()
        row = {
            "checkpoint_step": pending.boundary,
            "bytes": manifest.total_bytes,
            "snapshot_s": round(max((_seconds(t, "snapshot_s") for t in timings), default=0.0), 4),
            "write_s": round(max((_seconds(t, "write_s") for t in timings), default=0.0), 4),
            "manifest_s": round(time.time() - started, 4),
            "total_s": round(time.time() - pending.noticed, 4),
            "writers": len(ranks),
            "path": str(path),
        }
        self.event(EventKind.CHECKPOINT, **row)
        self.completed_rows.append(row)
        return True

    def _retain(self) -> None:
        try:
            removed = prune(self.root, self.keep, protect=self.pinned)
        except OSError as error:  # a read-only or failing file system: old checkpoints stay
            print(f"oobleck: warning: checkpoint retention failed: {describe_cause(error)}", flush=True)
            return
        for gone in removed:
            for step, kept in list(self.completed.items()):
                if kept == gone:
                    del self.completed[step]

    def _fail(self, boundary: int, cause: str) -> None:
        self.failed[boundary] = cause
        latest = self.latest_step()
        fallback = (
            f"the newest complete checkpoint is step {latest}" if latest is not None else "no checkpoint is complete"
        )
        self.event(EventKind.CHECKPOINT_FAILED, checkpoint_step=boundary, cause=cause, newest_complete=latest)
        self.failure_rows.append({"checkpoint_step": boundary, "cause": cause})
        print(f"oobleck: warning: the checkpoint of step {boundary} failed: {cause}; {fallback}", flush=True)

    def finish(self, deadline: float, drain: Callable[[], None], exited: Callable[[Worker], bool]) -> None:
        """At the end of the run: let checkpoints in progress complete while any of their writers
        may still report (until ``deadline``), then abandon what cannot complete any more."""
        while self.pending and time.monotonic() < deadline:
            self.poll()
            waiting = {w for p in self.pending.values() for layer, w in p.writers.items() if layer not in p.records}
            if all(exited(w) for w in waiting):
                self.poll()  # a writer reports before it exits
                break
            drain()
        for boundary in list(self.pending):
            del self.pending[boundary]
            self.event(
                EventKind.CHECKPOINT_ABANDONED,
                checkpoint_step=boundary,
                reason="the run ended before every shard was reported",
            )

    def discard_after(self, step: int) -> None:
        """A restart rolls back to ``step``: checkpoints in progress of later steps will not complete."""
        for boundary in [b for b in self.pending if b > step]:
            del self.pending[boundary]


def _seconds(timing: Mapping[str, Any], name: str) -> float:
    value = timing.get(name, 0.0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0

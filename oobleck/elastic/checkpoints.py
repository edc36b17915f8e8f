"""The controller's side of checkpoints: which are in progress, completing them, retention.

Workers decide *when* among themselves (the rank that commits a step marks it ``commit+checkpoint``
every ``checkpoint.every_steps`` committed steps, or at the first boundary after a request the
controller puts in the store: ``checkpoint.every_s``, a planned restart, Slurm's warning signal);
each layer's designated writer (``assign_checkpoint_writers``, published with the generation)
snapshots it and writes its shard in the background, then reports the shard's record in the
store. This coordinator notices every layer's record, writes the manifest last (the commit point),
applies retention, records a ``checkpoint`` event, and abandons a checkpoint whose writer died
before reporting. ``latest_step`` is what restarts roll back to.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oobleck.checkpoint import Manifest, ShardRecord, checkpoint_root, fingerprint, prune, step_dir, write_manifest
from oobleck.checkpoint.assignment import assign_checkpoint_writers
from oobleck.elastic.events import EventKind
from oobleck.planning.outputs import ExecutionPlan, Worker
from oobleck.runtime import keys
from oobleck.runtime.plan_document import CheckpointPlan


@dataclass
class Pending:
    boundary: int  # committed steps the checkpoint holds
    generation: int
    writers: dict[int, Worker]  # layer -> the worker writing it
    noticed: float
    records: dict[int, ShardRecord] = field(default_factory=dict)


class CheckpointCoordinator:
    def __init__(
        self,
        cfg: Any,
        run_dir: Path,
        store: Any,
        every_steps: int,
        *,
        event: Callable[..., None],
        extra: dict[str, Any],
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.every_steps = every_steps
        self.every_s = cfg.checkpoint.every_s
        self.keep = int(cfg.checkpoint.keep)
        self.root = checkpoint_root(cfg.checkpoint.dir, run_dir).resolve()
        self.event = event
        self.extra = extra
        self.fingerprint = fingerprint(cfg)
        self.num_layers = 0
        self.pending: dict[int, Pending] = {}
        self.completed: dict[int, Path] = {}  # boundary -> step dir of a complete checkpoint
        self.last_completed_at = time.time()
        self.requested: int | None = None
        self.completed_rows: list[dict[str, Any]] = []  # one per completed checkpoint (events.csv's)

    def adopt(self, step: int, path: Path) -> None:
        """A checkpoint that exists already (the one a run resumes from)."""
        self.completed[step] = path

    def latest_step(self) -> int | None:
        return max(self.completed) if self.completed else None

    def path(self, step: int) -> Path:
        return self.completed[step]

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
        self.pending[boundary] = Pending(boundary, generation, dict(writers), time.time())
        if self.requested is not None and boundary >= self.requested:
            self.requested = None

    def writer_lost(self, node: int) -> None:
        """A node died: a checkpoint still waiting for one of its shards will never complete."""
        for boundary, pending in list(self.pending.items()):
            waiting = {
                layer for layer, worker in pending.writers.items() if worker[0] == node and layer not in pending.records
            }
            if waiting and not self._collect(pending):
                del self.pending[boundary]
                self.event(
                    EventKind.CHECKPOINT_ABANDONED,
                    checkpoint_step=boundary,
                    reason=f"node {node} died before writing layers {sorted(waiting)}",
                )

    def poll(self) -> list[int]:
        """Complete every checkpoint whose shards have all been reported; returns their boundaries."""
        done = []
        for boundary, pending in sorted(self.pending.items()):
            if self._collect(pending):
                self._complete(pending)
                del self.pending[boundary]
                done.append(boundary)
        return done

    def _collect(self, pending: Pending) -> bool:
        for layer in pending.writers:
            if layer in pending.records:
                continue
            key = keys.checkpoint_shard(pending.boundary, layer)
            if not self.store.check([key]):
                return False
            data = json.loads(self.store.get(key))
            pending.records[layer] = ShardRecord(**data)
        return True

    def _complete(self, pending: Pending) -> None:
        started = time.time()
        path = step_dir(self.root, pending.boundary)
        manifest = Manifest.build(
            pending.boundary, self.fingerprint, pending.records.values(), len(pending.writers), extra=self.extra
        )
        write_manifest(path, manifest)
        timings = []
        ranks = {tuple(w) for w in pending.writers.values()}
        for node, local_rank in ranks:
            key = keys.checkpoint_timing(pending.boundary, node, local_rank)
            if self.store.check([key]):
                timings.append(json.loads(self.store.get(key)))
        self.completed[pending.boundary] = path
        self.last_completed_at = time.time()
        removed = prune(self.root, self.keep)
        for gone in removed:
            for step, kept in list(self.completed.items()):
                if kept == gone:
                    del self.completed[step]
        row = {
            "checkpoint_step": pending.boundary,
            "bytes": manifest.total_bytes,
            "snapshot_s": round(max((t["snapshot_s"] for t in timings), default=0.0), 4),
            "write_s": round(max((t["write_s"] for t in timings), default=0.0), 4),
            "manifest_s": round(time.time() - started, 4),
            "total_s": round(time.time() - pending.noticed, 4),
            "writers": len(ranks),
            "path": str(path),
        }
        self.event(EventKind.CHECKPOINT, **row)
        self.completed_rows.append(row)

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

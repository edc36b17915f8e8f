"""A worker's part in checkpoints: writing the layers it is the writer of, and loading layers.

When a step commits with ``commit+checkpoint``, each worker snapshots the layers the generation
names it the writer of (``PlanDocument.checkpoint``) into host memory and hands
them to its background writer (``oobleck.checkpoint.AsyncCheckpointWriter``); training goes on.
When the shards are on disk, a reporter (its own store connection) publishes each shard's record
and the writer's timings for the controller, which writes the manifest. A write that fails (a full
or read-only file system, a write that outlasts ``checkpoint.write_timeout_s``) is a storage
fault, not the worker's end: the reporter publishes, as those layers' records, that it could not
write them and why (``keys.checkpoint_shard``), the controller marks that checkpoint failed and says why, and
training goes on. ``restore_layers`` loads a checkpoint's layers into fresh layer states (a start,
resume or restart).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from oobleck.checkpoint import AsyncCheckpointWriter, WriteHandle, read_manifest, restore_layer, step_dir
from oobleck.checkpoint.durable import describe_cause, make_dirs
from oobleck.errors import CheckpointError
from oobleck.layer_state import LayerState
from oobleck.planning.outputs import Worker
from oobleck.runtime import keys
from oobleck.runtime.plan_document import CheckpointPlan
from oobleck.runtime.store_client import connect


class CheckpointWriter:
    """One worker's checkpoint writes (see the module docstring)."""

    def __init__(self, host: str, port: int, worker: Worker, checkpoint_cfg: Any, space: keys.KeySpace) -> None:
        self.host, self.port = host, port
        self.space = space
        self.worker = worker
        self.writer = AsyncCheckpointWriter.from_config(checkpoint_cfg)
        self.timeout_s = float(checkpoint_cfg.write_timeout_s)
        self._store: Any = None
        self._lock = threading.Lock()
        self._reporters: list[threading.Thread] = []

    def write(self, boundary: int, checkpoint: CheckpointPlan, layers: Mapping[int, LayerState]) -> None:
        """Snapshot and submit this worker's layers of the checkpoint of ``boundary`` committed steps;
        a storage fault is reported in the shards' records, never raised."""
        mine = checkpoint.layers_written_by(self.worker)
        if not mine:
            return
        path = step_dir(checkpoint.dir, boundary)
        try:
            make_dirs(path)
            snap = self.writer.snapshot(layers[layer] for layer in mine)
            handle = self.writer.submit(path, snap)
        except (OSError, CheckpointError) as error:
            self._start_reporter(boundary, None, (mine, describe_cause(error)))
            return
        self._start_reporter(boundary, handle, None)

    def _start_reporter(self, boundary: int, handle: WriteHandle | None, failed: tuple[list[int], str] | None) -> None:
        reporter = threading.Thread(
            target=self._report, args=(boundary, handle, failed), daemon=True, name=f"checkpoint-report-{boundary}"
        )
        reporter.start()
        self._reporters = [r for r in self._reporters if r.is_alive()] + [reporter]

    def _report(self, boundary: int, handle: WriteHandle | None, failed: tuple[list[int], str] | None) -> None:
        if handle is not None and not handle.wait(self.timeout_s):
            failed = (list(handle.layers), f"not written after checkpoint.write_timeout_s={self.timeout_s:g} s")
        elif handle is not None and handle.error is not None:
            failed = (list(handle.layers), describe_cause(handle.error))
        with self._lock:  # one reporter at a time on the shared store connection
            try:
                if self._store is None:
                    self._store = connect(self.host, self.port, 60.0, self.space)
                if failed is not None:
                    layers, cause = failed
                    print(
                        f"oobleck worker {self.worker}: checkpoint of step {boundary} failed: {cause}",
                        file=sys.stderr,
                        flush=True,
                    )
                    for layer in layers:
                        report = {"layer": layer, "failed": cause}
                        self._store.set(keys.checkpoint_shard(boundary, layer), json.dumps(report))
                    return
                assert handle is not None
                for layer, record in handle.records.items():
                    self._store.set(keys.checkpoint_shard(boundary, layer), json.dumps(record.to_dict()))
                timing = {"snapshot_s": handle.snapshot_s, "write_s": handle.write_s or 0.0, "bytes": handle.bytes}
                self._store.set(keys.checkpoint_timing(boundary, *self.worker), json.dumps(timing))
            except Exception as error:  # the controller is gone or the run stopped: nothing to report to
                print(
                    f"oobleck worker {self.worker}: could not report checkpoint {boundary}: {error}",
                    file=sys.stderr,
                    flush=True,
                )

    def close(self, timeout_s: float) -> bool:
        """Let the writes in flight finish and be reported (bounded); True when they all were."""
        deadline = time.monotonic() + timeout_s
        finished = self.writer.close(timeout_s)
        for reporter in self._reporters:
            reporter.join(max(0.0, deadline - time.monotonic()))
        return finished and not any(r.is_alive() for r in self._reporters)


def restore_layers(
    path: str | Path, layers: Iterable[int], new_layer: Callable[[int, int], LayerState], committed: int
) -> dict[int, LayerState]:
    """Fresh layer states of ``layers`` loaded from the checkpoint at ``path`` (checksums verified)."""
    manifest = read_manifest(path)
    restored = {}
    for index in layers:
        layer = new_layer(index, committed)
        restore_layer(path, manifest.record(index), layer, committed)
        restored[index] = layer
    return restored

"""Taking a checkpoint on one worker: a snapshot at a step boundary, then a write in the background.

``writer.snapshot(layers)`` copies each layer's flat state into host buffers the writer reuses
(pinned, for CUDA layers); it is the only part on the training path. ``writer.submit(step_dir,
snapshot)`` hands the shards to background threads and returns a ``WriteHandle`` at once;
training goes on while they are written, and the buffers return to the pool when the write is
done. At most ``max_pending`` submissions are in flight: a further ``submit`` waits for one to
finish (bounded by its timeout), which throttles checkpoints that come faster than the storage
writes them instead of piling snapshots up in memory. With ``async_write=False`` the write
happens inside ``submit``. Every write is durable and atomic (``durable_write``), so a failure or
a kill mid-write leaves earlier checkpoints untouched.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from oobleck.checkpoint.catalog import prepare_step_dir
from oobleck.checkpoint.manifest import Manifest, ShardRecord, write_manifest
from oobleck.checkpoint.shard import Shard, shard_meta, write_shard
from oobleck.errors import CheckpointError
from oobleck.layer_state import LayerState, flat_state_into


class HostBufferPool:
    """Host buffers for snapshots, reused from one checkpoint to the next (pinned for CUDA layers).

    Fresh host memory is slow to touch the first time (page faults) and pinned memory slow to
    allocate: for gpt2_small here, copying every layer's state into fresh buffers took seconds,
    into reused ones a fraction of a second (benchmarks/bench_checkpoint.py prints both). A
    buffer is lent to one snapshot and comes back when that snapshot's write has finished, so the
    pool holds at most ``max_pending + 1`` snapshots' worth of memory.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[tuple[int, ...], torch.dtype, bool], list[torch.Tensor]] = {}

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        key = (tuple(shape), dtype, pinned)
        with self._lock:
            free = self._free.get(key)
            if free:
                return free.pop()
        return torch.empty(shape, dtype=dtype, pin_memory=pinned)

    def give_back(self, tensors: Iterable[torch.Tensor]) -> None:
        with self._lock:
            for tensor in tensors:
                self._free.setdefault((tuple(tensor.shape), tensor.dtype, tensor.is_pinned()), []).append(tensor)

    def nbytes(self) -> int:
        """Bytes held for reuse (not lent out)."""
        with self._lock:
            return sum(t.numel() * t.element_size() for free in self._free.values() for t in free)


@dataclass(frozen=True)
class Snapshot:
    """Host copies of some layers' states, and the seconds the copy took.

    Its tensors may be borrowed from a ``HostBufferPool``: once submitted, a snapshot belongs to
    the writer, which hands the buffers back when the write is done.
    """

    shards: Mapping[int, Shard]
    seconds: float
    pool: HostBufferPool | None = None

    @property
    def nbytes(self) -> int:
        return sum(shard.nbytes for shard in self.shards.values())

    def release(self) -> None:
        if self.pool is not None:
            self.pool.give_back(shard.tensor for shard in self.shards.values())


def snapshot(layers: Iterable[LayerState], pool: HostBufferPool | None = None) -> Snapshot:
    """Copy ``layers``' flat states to host memory; call it at a step boundary (after the commit).

    One copy per tensor into a host buffer (from ``pool`` when given). For CUDA layers the buffer
    is pinned and the copies do not block; the devices are synchronised once at the end.
    """
    started = time.perf_counter()
    shards: dict[int, Shard] = {}
    devices = set()
    for layer in layers:
        device = layer.params[0].device
        meta = shard_meta(layer, layer.params[0].dtype)
        pinned = device.type == "cuda"
        shape, dtype = meta.shape, layer.params[0].dtype
        host = (
            pool.take(shape, dtype, pinned) if pool is not None else torch.empty(shape, dtype=dtype, pin_memory=pinned)
        )
        flat_state_into(layer, host, non_blocking=pinned)
        if pinned:
            devices.add(device)
        shards[layer.index] = Shard(meta=meta, tensor=host)
    for device in devices:
        torch.cuda.synchronize(device)
    return Snapshot(shards=shards, seconds=time.perf_counter() - started, pool=pool)


class WriteHandle:
    """One submitted snapshot: its progress, its records once written, or its error."""

    def __init__(self, step_dir: Path, snapshot: Snapshot) -> None:
        self.step_dir = step_dir
        self.layers = tuple(sorted(snapshot.shards))
        self.snapshot_s = snapshot.seconds
        self.bytes = snapshot.nbytes
        self.write_s: float | None = None  # first shard started -> last shard finished
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._records: dict[int, ShardRecord] = {}
        self._error: BaseException | None = None
        self._failed_layer: int | None = None
        self._outstanding = len(self.layers)
        self._started: float | None = None
        self._on_finish: list[Callable[[], None]] = []

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True when the write has finished (well or not)."""
        return self._finished.wait(timeout)

    @property
    def records(self) -> dict[int, ShardRecord]:
        """The shards written so far, by layer (all of them once ``done()`` without ``error``)."""
        with self._lock:
            return dict(self._records)

    @property
    def error(self) -> BaseException | None:
        return self._error

    def result(self, timeout: float) -> dict[int, ShardRecord]:
        """The records, once every shard is written; ``CheckpointError`` on a failure or after ``timeout``."""
        if not self.wait(timeout):
            raise CheckpointError(
                f"checkpoint write to {self.step_dir} not finished after {timeout:g} s "
                f"({len(self.records)} of {len(self.layers)} shards written); the storage is slower than expected, "
                "raise checkpoint.write_timeout_s or check the file system"
            )
        if self._error is not None:
            raise CheckpointError(
                f"writing layer {self._failed_layer} to {self.step_dir} failed: {self._error!r}"
            ) from self._error
        return self.records

    # -- called by the writer ------------------------------------------------------------------
    def _begin_shard(self) -> None:
        with self._lock:
            if self._started is None:
                self._started = time.perf_counter()

    def _end_shard(self, layer: int, record: ShardRecord | None, error: BaseException | None) -> None:
        with self._lock:
            if record is not None:
                self._records[layer] = record
            if error is not None and self._error is None:
                self._error, self._failed_layer = error, layer
            self._outstanding -= 1
            last = self._outstanding == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        self.write_s = 0.0 if self._started is None else time.perf_counter() - self._started
        for callback in self._on_finish:
            callback()
        self._finished.set()


_STOP = None  # queue sentinel: a worker thread exits when it takes it


class AsyncCheckpointWriter:
    """Background writer of snapshots for one worker (see the module docstring).

    ``write_shard_fn`` writes one shard; it is ``write_shard`` except in tests that hold a write in
    flight to check the bounded queue.
    """

    def __init__(
        self,
        *,
        async_write: bool = True,
        threads: int = 1,
        max_pending: int = 1,
        timeout_s: float = 600.0,
        write_shard_fn: Callable[[Path, Shard], ShardRecord] = write_shard,
    ) -> None:
        if threads < 1 or max_pending < 1 or timeout_s <= 0:
            raise CheckpointError(
                f"checkpoint writer needs threads >= 1, max_pending >= 1 and timeout_s > 0; got {threads}, {max_pending}, {timeout_s}"
            )
        self.async_write = async_write
        self.timeout_s = timeout_s
        self._write = write_shard_fn
        self._slots = threading.BoundedSemaphore(max_pending)
        self._tasks: queue.Queue[Any] = queue.Queue()
        self._inflight: set[WriteHandle] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.pool = HostBufferPool()
        self._threads = []
        if async_write:
            for index in range(threads):
                thread = threading.Thread(target=self._run, name=f"checkpoint-writer-{index}", daemon=True)
                thread.start()
                self._threads.append(thread)

    @classmethod
    def from_config(cls, checkpoint_cfg: Any) -> AsyncCheckpointWriter:
        """From the ``checkpoint:`` config block (``oobleck.config.CheckpointConfig``)."""
        return cls(
            async_write=bool(checkpoint_cfg.async_write),
            threads=int(checkpoint_cfg.io_threads),
            max_pending=int(checkpoint_cfg.max_pending),
            timeout_s=float(checkpoint_cfg.write_timeout_s),
        )

    def snapshot(self, layers: Iterable[LayerState]) -> Snapshot:
        """``snapshot(layers)`` into this writer's reused host buffers (the usual way to take one)."""
        return snapshot(layers, self.pool)

    def submit(self, step_dir: Path | str, snapshot: Snapshot, *, timeout: float | None = None) -> WriteHandle:
        """Write ``snapshot``'s shards into ``step_dir``; returns at once unless ``max_pending`` writes
        are in flight (then waits up to ``timeout``, default ``timeout_s``, for one to finish)."""
        if self._closed:
            raise CheckpointError("the checkpoint writer is closed")
        handle = WriteHandle(Path(step_dir), snapshot)
        handle._on_finish.append(snapshot.release)
        if not self.async_write:
            for layer in handle.layers:
                self._write_one(handle, layer, snapshot.shards[layer])
            if not handle.layers:
                handle._finish()
            return handle
        wait = self.timeout_s if timeout is None else timeout
        if not self._slots.acquire(timeout=wait):
            raise CheckpointError(
                f"checkpoint of {step_dir}: the previous checkpoint writes are still in flight after {wait:g} s; "
                "checkpoints come faster than storage writes them: raise checkpoint.every_steps (or every_s) "
                "or checkpoint.max_pending"
            )
        with self._lock:
            self._inflight.add(handle)
        handle._on_finish.append(lambda: self._release(handle))
        if not handle.layers:
            handle._finish()
        for layer in handle.layers:
            self._tasks.put((handle, layer, snapshot.shards[layer]))
        return handle

    def pending(self) -> int:
        """Submissions not finished yet."""
        with self._lock:
            return len(self._inflight)

    def close(self, timeout: float) -> bool:
        """Stop accepting work and wait up to ``timeout`` for what is in flight; True when all finished.

        Writes still running after that are abandoned (their threads are daemons): a write cut off
        leaves only a temporary file, never a damaged checkpoint.
        """
        self._closed = True
        deadline = time.monotonic() + timeout
        with self._lock:
            handles = list(self._inflight)
        finished = all(handle.wait(max(0.0, deadline - time.monotonic())) for handle in handles)
        for _ in self._threads:
            self._tasks.put(_STOP)
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return finished

    def __enter__(self) -> AsyncCheckpointWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(self.timeout_s)

    # -- internals -----------------------------------------------------------------------------
    def _release(self, handle: WriteHandle) -> None:
        with self._lock:
            self._inflight.discard(handle)
        self._slots.release()

    def _write_one(self, handle: WriteHandle, layer: int, shard: Shard) -> None:
        handle._begin_shard()
        try:
            record = self._write(handle.step_dir, shard)
        except Exception as error:  # reported through the handle; the thread keeps serving
            handle._end_shard(layer, None, error)
        else:
            handle._end_shard(layer, record, None)

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            if task is _STOP:
                return
            self._write_one(*task)


def save_checkpoint(
    checkpoint_dir: Path | str,
    step: int,
    layers: Iterable[LayerState],
    fingerprint: Mapping[str, Any],
    num_layers: int,
    *,
    writer: AsyncCheckpointWriter,
    extra: Mapping[str, Any] | None = None,
) -> WriteHandle:
    """A whole checkpoint from one process that holds every layer: snapshot, shards, manifest.

    The single-process path (tests, benchmarks, reference runs); a distributed run splits these
    steps between the controller and the writers (see the package docstring). Waits for the
    write (bounded by ``writer.timeout_s``) and returns its handle.
    """
    path = prepare_step_dir(checkpoint_dir, step)
    handle = writer.submit(path, writer.snapshot(layers))
    records = handle.result(writer.timeout_s)
    write_manifest(path, Manifest.build(step, fingerprint, records.values(), num_layers, extra))
    return handle

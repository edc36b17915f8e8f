"""All-reduce timing by group size on the current backend (gloo on CPU, NCCL on CUDA).

Starts ``max(group_sizes)`` worker processes on this machine (one per device), rendezvoused over
a TCPStore the caller hosts. For every group size k, ranks 0..k-1 form a group and time a SUM
all-reduce of each message size: warm-up, then the median of ``repeats``. All workers run on one
machine, so the samples are ``scope="in_node"``. Every wait is bounded by ``timeout_s``; workers
still alive after it are terminated and a ``ProfileError`` says which sizes did not finish.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import queue
import statistics
import time
from collections.abc import Sequence

from oobleck.errors import ProfileError
from oobleck.planning.inputs import AllReduceSample

FP32_BYTES = 4


def _worker(
    rank: int,
    world: int,
    port: int,
    backend: str,
    group_sizes: Sequence[int],
    sizes_bytes: Sequence[int],
    warmup: int,
    repeats: int,
    timeout_s: float,
    results: mp.Queue,
) -> None:
    import signal

    import torch
    import torch.distributed as dist

    # Ctrl-C reaches the whole terminal's process group: the parent stops these workers itself
    # (terminate, below), so they ignore it rather than each printing a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    try:
        for k in group_sizes:
            group = dist.new_group(list(range(k)))  # every rank must take part in new_group
            if rank < k:
                for nbytes in sizes_bytes:
                    tensor = torch.ones(max(1, nbytes // FP32_BYTES), dtype=torch.float32, device=device)
                    times = []
                    for attempt in range(warmup + repeats):
                        dist.barrier(group=group)
                        if device.type == "cuda":
                            torch.cuda.synchronize(device)
                        start = time.perf_counter()
                        dist.all_reduce(tensor, group=group)
                        if device.type == "cuda":
                            torch.cuda.synchronize(device)
                        if attempt >= warmup:
                            times.append(time.perf_counter() - start)
                    if rank == 0:
                        results.put((k, nbytes, statistics.median(times)))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_allreduce(
    group_sizes: Sequence[int],
    sizes_bytes: Sequence[int],
    *,
    backend: str = "gloo",
    warmup: int = 2,
    repeats: int = 5,
    timeout_s: float = 120.0,
) -> tuple[AllReduceSample, ...]:
    """Median seconds of a SUM all-reduce of each size over each group size, on ``backend``."""
    import torch
    import torch.distributed as dist

    group_sizes = sorted({int(k) for k in group_sizes})
    sizes_bytes = sorted({int(n) for n in sizes_bytes})
    if not group_sizes or not sizes_bytes:
        return ()
    if group_sizes[0] < 2 or sizes_bytes[0] <= 0:
        raise ProfileError(
            f"profile.allreduce_group_sizes={group_sizes} must be >= 2 and profile.allreduce_bytes={sizes_bytes} > 0"
        )
    world = group_sizes[-1]
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ProfileError(
            f"all-reduce over {world} ranks needs {world} CUDA devices, found {torch.cuda.device_count()}"
        )
    store = dist.TCPStore(
        "127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    context = mp.get_context("spawn")
    results: mp.Queue = context.Queue()
    workers = [
        context.Process(
            target=_worker,
            args=(rank, world, store.port, backend, group_sizes, sizes_bytes, warmup, repeats, timeout_s, results),
            daemon=True,
        )
        for rank in range(world)
    ]
    for worker in workers:
        worker.start()
    expected = len(group_sizes) * len(sizes_bytes)
    samples: dict[tuple[int, int], float] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(samples) < expected and time.monotonic() < deadline:
            try:
                k, nbytes, seconds = results.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
                samples[(k, nbytes)] = seconds
            except queue.Empty:
                if any(w.exitcode not in (None, 0) for w in workers):
                    break  # a worker died: stop waiting, report below
        for worker in workers:
            worker.join(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
                worker.join(timeout=5)
        del store
    if len(samples) < expected:
        missing = sorted(set((k, n) for k in group_sizes for n in sizes_bytes) - samples.keys())
        codes = [w.exitcode for w in workers]
        raise ProfileError(
            f"all-reduce profiling on {backend} did not finish (group size, bytes) {missing} within "
            f"profile.allreduce_timeout_s={timeout_s} (worker exit codes {codes}); raise the timeout "
            "or set profile.allreduce_group_sizes=[] to skip it"
        )
    return tuple(
        AllReduceSample(group_size=k, nbytes=n, seconds=samples[(k, n)], scope="in_node") for (k, n) in sorted(samples)
    )

"""Checkpoint storage speed for one model's layers on this machine, against the raw disk.

    python benchmarks/bench_checkpoint.py [--model gpt2_small] [--dir DIR] [--repeats 3]
                                          [--threads 1 2] [--matmul 512] [--json out.json]

Builds every layer of the model (``new_layer_state``, on the CPU) and measures, per repeat:
1. snapshot: ``writer.snapshot(layers)`` (host copies of every layer's state): with ``async_write``
   the only part of a checkpoint on the training path (besides ``submit``); the first into fresh
   buffers, the later ones into the writer's reused buffers;
2. write: shards + manifest with ``AsyncCheckpointWriter`` (for each ``--threads``), submitted
   and waited for; its bandwidth as a ratio of the raw peer measured in the same repeat: the same
   number of bytes with plain ``os.write`` (same chunk size) and one ``fsync`` into one file on
   the same file system;
3. verify / read: the written files are evicted from the page cache (``posix_fadvise
   DONTNEED``, these files only), then ``latest_valid`` (every CRC32, on as many threads as the
   writer) and ``restore_layer`` of every layer (one thread, CRC32 checked again) are timed, each
   cold, against a cold raw read of the raw peer's file;
4. compute under a background write: a single-threaded matmul loop (the worker's
   ``cluster.torch_threads=1``), its rate while an async write runs over its rate alone. A proxy
   for the steady-state throughput cost until checkpoints are wired into real training.

Medians over repeats are printed as a table; ``--json`` writes every sample as well.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
WAIT_S = 3600.0  # bound on any one write here (gigabytes on a slow disk)


def build_layers(model: str):
    from oobleck.config import compose_config
    from oobleck.models import num_layers
    from oobleck.runtime.state import new_layer_state

    cfg = compose_config(f"model={model}")
    return cfg, [new_layer_state(cfg.model, cfg.job, index, 0, "cpu") for index in range(num_layers(cfg.model))]


def evict(path: Path) -> None:
    """Drop one file's pages from the page cache (they are clean after fsync), so reads hit the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_write(path: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` with os.write in IO_CHUNK_BYTES pieces and one fsync."""
    from oobleck.checkpoint.durable import IO_CHUNK_BYTES

    chunk = memoryview(os.urandom(IO_CHUNK_BYTES))
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, chunk[: min(left, len(chunk))])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def raw_read(path: Path) -> float:
    from oobleck.checkpoint.durable import IO_CHUNK_BYTES

    evict(path)
    buffer = bytearray(IO_CHUNK_BYTES)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    return time.perf_counter() - started


def matmul_rate(size: int, until) -> float:
    """Matmuls per second of ``size`` x ``size`` fp32 until ``until()`` is true (at least 3)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm-up, outside the timing
    count, started = 0, time.perf_counter()
    while count < 3 or not until():
        torch.mm(a, b)
        count += 1
    return count / (time.perf_counter() - started)


def one_repeat(cfg, layers, root: Path, writers: dict, matmul: int) -> dict:
    """One sample of everything; ``writers`` (threads -> writer) persist so their buffer pools warm up."""
    from oobleck.checkpoint import Manifest, fingerprint, latest_valid, prepare_step_dir, restore_layer, write_manifest
    from oobleck.checkpoint.durable import remove_tree_durably

    result: dict = {"bytes": sum(3 * layer.numel * 4 for layer in layers)}
    raw = root / "raw.bin"
    result["raw_write_s"] = raw_write(raw, result["bytes"])
    result["raw_read_s"] = raw_read(raw)
    raw.unlink()

    fp = fingerprint(cfg)
    for threads, writer in writers.items():
        key = f"t{threads}"
        fresh = writer.pool.nbytes() == 0
        snap = writer.snapshot(layers)
        result[f"{key}_snapshot_{'fresh' if fresh else 'reused'}_s"] = snap.seconds
        started = time.perf_counter()
        step_dir = prepare_step_dir(root, 1)
        records = writer.submit(step_dir, snap).result(writer.timeout_s)
        write_manifest(step_dir, Manifest.build(1, fp, records.values(), len(layers)))
        result[f"{key}_write_s"] = time.perf_counter() - started  # shards + manifest, all durable

        for path in step_dir.iterdir():
            evict(path)
        started = time.perf_counter()
        found = latest_valid(root, threads=threads)
        result[f"{key}_verify_s"] = time.perf_counter() - started
        assert found is not None and found.step == 1
        for path in step_dir.iterdir():
            evict(path)
        started = time.perf_counter()
        for layer in layers:
            restore_layer(found.step_dir, found.manifest.record(layer.index), layer, found.step)
        result[f"{key}_read_s"] = time.perf_counter() - started

        # compute alone for as long as a write takes, then while an async write of a new checkpoint runs
        alone_until = time.perf_counter() + result[f"{key}_write_s"]
        result[f"{key}_compute_alone"] = matmul_rate(matmul, lambda: time.perf_counter() >= alone_until)
        snap = writer.snapshot(layers)
        result[f"{key}_snapshot_reused_s"] = snap.seconds
        started = time.perf_counter()
        handle = writer.submit(prepare_step_dir(root, 2), snap)
        result[f"{key}_submit_s"] = time.perf_counter() - started
        result[f"{key}_compute_during"] = matmul_rate(matmul, handle.done)
        handle.result(writer.timeout_s)
        for path in list(root.iterdir()):
            remove_tree_durably(path)
    return result


def summarise(samples: list[dict], threads_list: list[int]) -> dict:
    def median(key: str) -> float:
        return statistics.median(s[key] for s in samples if key in s)

    def median_ratio(num: str, den: str) -> float:
        return statistics.median(s[num] / s[den] for s in samples)

    gb = samples[0]["bytes"] / 1e9
    rows: dict = {
        "size_gb": gb,
        "raw_write_gbps": gb / median("raw_write_s"),
        "raw_read_gbps": gb / median("raw_read_s"),
    }
    for threads in threads_list:
        key = f"t{threads}"
        rows[key] = {
            "snapshot_fresh_s": median(f"{key}_snapshot_fresh_s"),
            "snapshot_s": median(f"{key}_snapshot_reused_s"),
            "write_s": median(f"{key}_write_s"),
            "write_gbps": gb / median(f"{key}_write_s"),
            "write_vs_raw": median_ratio("raw_write_s", f"{key}_write_s"),
            "verify_s": median(f"{key}_verify_s"),
            "read_restore_s": median(f"{key}_read_s"),
            "read_vs_raw": median_ratio("raw_read_s", f"{key}_read_s"),
            "submit_s": median(f"{key}_submit_s"),
            "training_path_s": median(f"{key}_snapshot_reused_s") + median(f"{key}_submit_s"),
            "compute_during_write_vs_alone": median_ratio(f"{key}_compute_during", f"{key}_compute_alone"),
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2_small")
    parser.add_argument(
        "--dir", default=None, help="where to write (default: a temporary dir under benchmarks/results/)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="writer thread counts to measure")
    parser.add_argument("--matmul", type=int, default=512, help="size of the compute loop's square matmuls")
    parser.add_argument("--json", default=None, help="also write the medians and every sample here")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))
    base = Path(args.dir) if args.dir else REPO / "benchmarks" / "results"
    base.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    cfg, layers = build_layers(args.model)
    print(f"{args.model}: {len(layers)} layers built in {time.perf_counter() - started:.1f} s; writing under {base}")
    import torch

    from oobleck.checkpoint import AsyncCheckpointWriter

    torch.set_num_threads(1)
    writers = {threads: AsyncCheckpointWriter(threads=threads, timeout_s=WAIT_S) for threads in args.threads}
    samples = []
    with tempfile.TemporaryDirectory(dir=base, prefix="bench-checkpoint-") as tmp:
        for repeat in range(args.repeats):
            samples.append(one_repeat(cfg, layers, Path(tmp), writers, args.matmul))
            print(f"  repeat {repeat + 1}/{args.repeats} done")
    for writer in writers.values():
        writer.close(WAIT_S)
    rows = summarise(samples, args.threads)

    print(
        f"\ncheckpoint of {args.model} ({len(layers)} layers, params + AdamW moments, fp32), medians of {args.repeats}"
    )
    print(
        f"  size {rows['size_gb']:.3f} GB; raw disk: write {rows['raw_write_gbps']:.3f} GB/s (os.write + fsync), cold read {rows['raw_read_gbps']:.3f} GB/s"
    )
    columns = (
        ("threads", None),
        ("snapshot 1st s", "snapshot_fresh_s"),
        ("snapshot s", "snapshot_s"),
        ("submit s", "submit_s"),
        ("write s", "write_s"),
        ("write GB/s", "write_gbps"),
        ("write/raw", "write_vs_raw"),
        ("verify s", "verify_s"),
        ("read+restore s", "read_restore_s"),
        ("read/raw", "read_vs_raw"),
        ("compute w/ write", "compute_during_write_vs_alone"),
    )
    print("  " + " ".join(f"{title:>16}" for title, _ in columns))
    for threads in args.threads:
        r = rows[f"t{threads}"]
        print("  " + f"{threads:>16} " + " ".join(f"{r[key]:>16.3f}" for _, key in columns[1:]))
    print(
        "  snapshot 1st: into fresh host buffers; snapshot: into the writer's reused ones (the training-path\n"
        "  cost with async_write, with submit); write: shards + manifest, durable; verify: every CRC32, cold;\n"
        "  compute w/ write: 1-thread matmul rate while an async write runs / alone"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"model": args.model, "repeats": args.repeats, "medians": rows, "samples": samples}, indent=1)
        )
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

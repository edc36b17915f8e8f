"""What checkpoints cost real training, and how long a resume takes (issue 11).

    python benchmarks/bench_checkpoint_training.py [--model gpt2_small] [--steps 20] [--pairs 2]

On a local cluster (2 nodes by default) of real ``python -m oobleck.run`` processes:

1. steady-state throughput with checkpoints every 10 steps (asynchronous writes) as a ratio of
   the same run without checkpoints, measured in pairs (one without, one with, alternately, so
   machine load drifts both ways) — the target is >= 0.95 with ``checkpoint.async_write=true``;
   the checkpoints' size, snapshot seconds (the only part on the training path) and background
   write seconds come from the runs' events.csv;
2. resume time: a run checkpointing every 5 steps has its controller SIGKILLed mid-run, then
   ``job.resume=auto`` restarts it; measured from the kill to the first redone step committed
   (process start, profile cache, worker boot, loading the checkpoint, the first step).

The storage-level figures (write bandwidth against the raw disk, verify and read times) are
``benchmarks/bench_checkpoint.py``'s.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]


def command(run_dir: Path, args: argparse.Namespace, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "oobleck.run",
        f"hydra.run.dir={run_dir}",
        f"model={args.model}",
        f"model.seq_len={args.seq_len}",
        f"cluster.nodes={args.nodes}",
        "job.fault_tolerance=1",
        f"job.global_batch_size={args.batch}",
        "job.microbatch_size=2",
        "failures=none",
        "logger.wandb.mode=disabled",
        "logger.progress_bar=false",
        *extra,
    ]


def steady_rate(run_dir: Path) -> float:
    """Samples/s over the run's steps after the first (which pays the start)."""
    metrics = pd.read_csv(run_dir / "metrics.csv")
    span = float(metrics["time_s"].iloc[-1] - metrics["time_s"].iloc[0])
    return float(metrics["samples"].iloc[1:].sum()) / span


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2_small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_ckpt_training-"))
    env = dict(os.environ, WANDB_MODE="disabled")
    print(
        f"{args.model} seq_len={args.seq_len} batch={args.batch} on {args.nodes} nodes; run dirs under {out}; load {os.getloadavg()[0]:.2f}"
    )

    ratios, rows = [], []
    for pair in range(args.pairs):
        rates = {}
        for label, every in (("none", 0), (f"every {args.every}", args.every)):
            run_dir = out / f"pair{pair}-{every}"
            subprocess.run(
                command(run_dir, args, f"job.steps={args.steps}", f"checkpoint.every_steps={every}"),
                cwd=REPO,
                env=env,
                check=True,
                capture_output=True,
            )
            rates[label] = steady_rate(run_dir)
            events = pd.read_csv(run_dir / "events.csv")
            for row in events[events["kind"] == "checkpoint"].to_dict(orient="records"):
                rows.append(row)
        ratio = rates[f"every {args.every}"] / rates["none"]
        ratios.append(ratio)
        print(
            f"pair {pair}: {rates['none']:.3f} samples/s without, {rates[f'every {args.every}']:.3f} with checkpoints: ratio {ratio:.3f} (load {os.getloadavg()[0]:.2f})"
        )
    if rows:
        table = pd.DataFrame(rows)
        print(
            f"checkpoints: {len(table)}, {table['bytes'].median() / 1e9:.3f} GB each; snapshot median {table['snapshot_s'].median():.3f} s "
            f"(first {table['snapshot_s'].iloc[0]:.3f} s); background write median {table['write_s'].median():.2f} s"
        )
    print(
        f"throughput ratio with checkpoints every {args.every} steps: median {statistics.median(ratios):.3f} over {len(ratios)} pairs (target >= 0.95)"
    )

    run_dir = out / "resume"
    kill_after = max(8, args.every)
    first = subprocess.Popen(
        command(run_dir, args, f"job.steps={kill_after + 10}", "checkpoint.every_steps=5"),
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while first.poll() is None:
        try:
            if len(pd.read_csv(run_dir / "metrics.csv")) >= kill_after:
                break
        except (OSError, pd.errors.EmptyDataError):
            pass
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    first.wait()
    done_rows = len(pd.read_csv(run_dir / "metrics.csv"))
    second = subprocess.Popen(
        command(run_dir, args, f"job.steps={kill_after + 10}", "checkpoint.every_steps=5", "job.resume=auto"),
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while second.poll() is None:
        try:
            if len(pd.read_csv(run_dir / "metrics.csv")) > done_rows:
                break
        except (OSError, pd.errors.EmptyDataError):
            pass
        time.sleep(0.05)
    resumed = time.monotonic() - killed
    second.wait()
    events = pd.read_csv(run_dir / "events.csv")
    step = int(events[events["kind"] == "resume"]["resume_step"].iloc[-1])
    print(
        f"resume: killed after {done_rows} committed steps, resumed at step {step}; kill to first redone step {resumed:.1f} s"
    )


if __name__ == "__main__":
    main()

"""Benchmark: how long measuring a profile takes on this machine, how big the result is, and how the
backward splits into its input and weight passes.

    python benchmarks/bench_profiler.py                      # gpt3_tiny, llama_tiny and gpt2_small on CPU
    python benchmarks/bench_profiler.py --models llama_tiny --warmup 1 --repeats 3 --threads 1

Measures with ``measure_profile`` (no cache, no all-reduce; each run with a fused and with a split
backward), prints wall time, the per-layer table, each layer's input and weight passes against its
fused backward, the model's parameter count and the JSON size, and writes each profile to
``benchmarks/results/profile-<model>-mb<b>-cpu.json``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from oobleck.config import load_model_config
from oobleck.profile import format_profile
from oobleck.profiling import measure_profile

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gpt3_tiny", "llama_tiny", "gpt2_small"])
    parser.add_argument("--microbatch", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (workers use cluster.torch_threads=1)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    print(f"host load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    for name in args.models:
        cfg = load_model_config(name)
        start = time.perf_counter()
        profile = measure_profile(
            cfg, args.microbatch, args.device, warmup=args.warmup, repeats=args.repeats, seed=0, threads=args.threads
        )
        seconds = time.perf_counter() - start
        path = profile.save(RESULTS / f"profile-{name}-mb{args.microbatch}-{args.device}.json")
        print(format_profile(profile))
        for layer in profile.layers:
            split = (layer.backward_input_s or 0.0) + (layer.backward_weight_s or 0.0)
            print(
                f"    {layer.name:<10} input {layer.backward_input_s * 1e3:8.3f} ms  weight "
                f"{layer.backward_weight_s * 1e3:8.3f} ms  split / fused {split / layer.backward_s:5.2f}"
            )
        print(
            f"RESULT model={name} microbatch={args.microbatch} device={args.device} threads={args.threads} "
            f"warmup={args.warmup} repeats={args.repeats} wall_s={seconds:.2f} "
            f"params={profile.param_bytes // 4} json_bytes={path.stat().st_size} torch={torch.__version__}\n"
        )


if __name__ == "__main__":
    main()

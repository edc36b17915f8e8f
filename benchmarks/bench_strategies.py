"""Oobleck, Varuna, Bamboo, torchft and ReCycle on the same real cluster, model, batches and failure
schedules.

    python benchmarks/bench_strategies.py [--steps 60] [--repeats 3] [--nodes 6] [--out DIR]
                                          [--faults crash hang none] [--validate]

Local nodes, gpt3_tiny, f=2, each strategy in its faithful default (conf/strategy/<name>.yaml: Bamboo
lazy, torchft's asynchronous quorum, ReCycle's re-routes through peer pipelines) with its own
checkpoint interval (Oobleck and torchft none, Varuna every 10 steps, Bamboo and ReCycle every 100),
measured under the protocol of
``benchmarks/protocol.py``: ``--repeats`` interleaved rounds with the order of the strategies rotated
per round; per round two failure steps drawn at seeded random offsets (never on a checkpoint
boundary of any strategy), the same for every strategy; each round once with crashes (SIGKILL),
once with hangs (SIGSTOP, seen after ``--heartbeat-timeout-s``, the same for every strategy) and
once without failures (the steady-state cost of each strategy's machinery). Every run records its
host (summary.json ``host``). Printed at the end (``analysis.comparison.protocol_table``): per
fault type and strategy the median goodput and recovery time with min-max over the rounds, and
Oobleck's ratio over each strategy paired round by round, with the host's load and a warning
where the load exceeded the cores or the training processes outnumbered them.

``--validate`` also runs benchmarks/bench_validation.py's calibration runs first and prints the
simulator's prediction of each crash run of round 0 beside the measurement (``oobleck.sim.validate``).

The machine is shared and small: compare within one run of the benchmark, never across runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from protocol import Variant, add_protocol_arguments, protocol_out, run_tiny_protocol  # noqa: E402

STRATEGIES = ("oobleck", "varuna", "bamboo", "torchft", "recycle")
# The strategies whose runs the simulator predicts (``--validate``): the calibrated ones.
VALIDATED = ("oobleck", "varuna", "bamboo")


def validate(out: Path, crash_runs: list[Path], profile_repeats: int) -> None:
    """The simulator's prediction of each run beside the measurement (calibrated on this host)."""
    import pandas as pd
    from bench_validation import CALIBRATION
    from bench_validation import run as run_calibration

    from oobleck.sim.validate import calibrate_runs, validate_run

    for name, (_, overrides) in CALIBRATION.items():
        run_calibration(out, name, overrides, profile_repeats)
    runtime = calibrate_runs([out / name for name in CALIBRATION])
    print("\n== the simulator's prediction of each run (simulated / measured; targets: throughput 15%, recovery 50%)")
    print(f"calibrated on {', '.join(CALIBRATION)}: {runtime}")
    rows = []
    for run_dir in crash_runs:
        try:
            validation = validate_run(run_dir, runtime=runtime)
        except Exception as error:  # report, and go on with the other strategies
            print(f"{run_dir.name}: validation failed: {error}")
            continue
        frame = validation.table[validation.table["model"].isin(["predicted", "planner"])]
        rows.append(frame.assign(strategy=run_dir.name))
    if rows:
        print(pd.concat(rows).to_string(index=False, float_format=lambda v: f"{v:.4g}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_protocol_arguments(parser, steps=60, nodes=6, failures=2)
    parser.add_argument("--faults", nargs="+", default=["crash", "hang", "none"], choices=["crash", "hang", "none"])
    parser.add_argument("--validate", action="store_true", help="also check the simulator against the crash runs")
    parser.add_argument("--profile-repeats", type=int, default=21, help="with --validate: timed repeats per layer")
    args = parser.parse_args()

    from analysis.comparison import print_protocol

    out = protocol_out(args.out, "bench_strategies")
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; run dirs under {out}")
    run_tiny_protocol([Variant(name, name) for name in STRATEGIES], args, out, faults=args.faults)
    print(f"load average {os.getloadavg()[0]:.2f}")
    print_protocol(out)
    if args.validate and "crash" in args.faults:
        validate(out, [out / "r0-crash" / name for name in VALIDATED], args.profile_repeats)


if __name__ == "__main__":
    main()

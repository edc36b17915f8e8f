"""Oobleck, Varuna and Bamboo on the same real cluster, model, batches and failure schedule.

    python benchmarks/bench_strategies.py [--steps 160] [--out DIR]

Six local nodes, gpt3_tiny, f=2, the same schedule for every strategy: a node lost at step 30,
another at step 70, a node joining at step 100. Each strategy runs with its own checkpoint
interval (conf/strategy/<name>.yaml: Oobleck none, Varuna every 10 steps, Bamboo every 100).
Printed, from this one run of the benchmark:

1. the comparison table (``analysis.comparison.strategy_table``): goodput, time lost, recovery /
   failover / restart times, steps rolled back, and Oobleck's goodput over each strategy's;
2. the simulator's prediction of each run beside the measurement (``oobleck.sim.validate``,
   the run's own strategy, nodes and schedule), with the ratio simulated / measured: the
   ``predicted`` model, whose runtime terms (step overhead, the machine's load, reconfiguration,
   failover and restart times, checkpoint bandwidths, Bamboo's exposed redundant forward) are
   measured by ``calibrate_runs`` on benchmarks/bench_validation.py's calibration runs (C1, C2,
   C3, VC, BC), run first in this benchmark under the same load and with the same measured profile;
   the paper-constant ``planner`` model beside it for contrast (a 78 s restart, a 2 s
   reconfiguration: it misses these local runs by far);
3. the steady-state cost of each strategy's machinery without failures (Varuna's checkpoints,
   Bamboo's redundant forward): each strategy's throughput as a fraction of Oobleck's, measured
   in the same run.

The machine is shared and small: compare within one run of the benchmark, never across runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

STRATEGIES = ("oobleck", "varuna", "bamboo")


def schedule(steps: int) -> list[dict]:
    return [
        {"action": "remove", "step": int(steps * 0.19), "count": 1},
        {"action": "remove", "step": int(steps * 0.44), "count": 1},
        {"action": "join", "step": int(steps * 0.62), "count": 1},
    ]


def run(strategy: str, steps: int, run_dir: Path, failures: bool, profiles: Path) -> Path:
    from oobleck.elastic.job import launch
    from testing import tiny_config

    cfg = tiny_config(
        f"strategy={strategy}",
        **{
            "profile.cache_dir": str(profiles),  # the calibration runs' profile (measured by the first)
            "cluster.nodes": 6,
            "job.fault_tolerance": 2,
            "job.steps": steps,
            "job.global_batch_size": 48,
            "runtime.save_final_params": False,
            "failures.kind": "explicit" if failures else "none",
            "failures.events": schedule(steps) if failures else [],
        },
    )
    launch(cfg, run_dir)
    return run_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--steady-steps", type=int, default=60)
    parser.add_argument("--out", default=None, help="keep the run dirs here (default: a temporary dir)")
    parser.add_argument(
        "--profile-repeats",
        type=int,
        default=21,
        help="timed repeats per layer of the shared measured profile (median)",
    )
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")

    import pandas as pd
    from bench_validation import CALIBRATION
    from bench_validation import run as run_calibration

    from analysis.comparison import strategy_table
    from analysis.load import load_run_set
    from oobleck.sim.validate import calibrate_runs, validate_run

    out = (Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_strategies-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"load average {os.getloadavg()[0]:.2f}; run dirs under {out}")
    # Calibration first: its first run measures the profile every run here plans with.
    for name, (_, overrides) in CALIBRATION.items():
        run_calibration(out, name, overrides, args.profile_repeats)
    failed = {name: run(name, args.steps, out / f"{name}-failures", True, out / "profiles") for name in STRATEGIES}
    steady = {
        name: run(name, args.steady_steps, out / f"{name}-steady", False, out / "profiles") for name in STRATEGIES
    }
    print(f"load average {os.getloadavg()[0]:.2f}")
    runtime = calibrate_runs([out / name for name in CALIBRATION])

    print("\n== the same schedule (a node lost at two steps, one joining), measured")
    table = strategy_table(load_run_set(list(failed.values())))
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))

    print("\n== the simulator's prediction of each run (simulated / measured; targets: throughput 15%, recovery 50%)")
    print(f"calibrated on {', '.join(CALIBRATION)}: {runtime}")
    rows = []
    for name, run_dir in failed.items():
        try:
            validation = validate_run(run_dir, runtime=runtime)
        except Exception as error:  # report, and go on with the other strategies
            print(f"{name}: validation failed: {error}")
            continue
        frame = validation.table[validation.table["model"].isin(["predicted", "planner"])]
        rows.append(
            frame.assign(strategy=name)[
                ["strategy", "model", "metric", "measured", "simulated", "ratio", "within_target"]
            ]
        )
    if rows:
        table = pd.concat(rows)
        print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        predicted = table[table["model"] == "predicted"]
        print(f"predicted rows within target: {int(predicted['within_target'].sum())} of {len(predicted)}")

    print("\n== steady state, no failures: throughput as a fraction of Oobleck's (same run)")
    steady_table = strategy_table(load_run_set(list(steady.values())))
    base = float(steady_table.loc[steady_table["strategy"] == "oobleck", "goodput"].iloc[0])
    for row in steady_table.to_dict(orient="records"):
        print(f"{row['strategy']:8s} {row['goodput']:8.1f} samples/s  {row['goodput'] / base:5.3f} of oobleck")


if __name__ == "__main__":
    main()

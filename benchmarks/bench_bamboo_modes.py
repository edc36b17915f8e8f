"""Bamboo's redundancy modes in steady state, each against Oobleck, measured in one run.

    python benchmarks/bench_bamboo_modes.py [--steps 40] [--repeats 3] [--nodes 4] [--seed 0] [--out DIR]
                                            [--warmup 5] [--heartbeat-timeout-s 5]

gpt3_tiny on ``--nodes`` local nodes, no failures: Oobleck (its planner's plan) and Bamboo with
``strategy.redundancy`` = lazy (Bamboo's default: no redundant forward), eager (the successor's
forward before each wait for gradients) and inline (right after the stage's own forward, on the
critical path), Bamboo at depth 2. The four configurations run under the protocol of
``benchmarks/protocol.py`` (its steady-state rows: ``--repeats`` interleaved rounds, the order
rotated per round, so drifting load falls on all alike). Printed:

- per configuration, the median samples/s over the steps after the first ``--warmup`` (time
  between consecutive commits) with its min-max over the repeats, and its ratio to Oobleck's and
  to Bamboo lazy's in the same repeat (median and min-max; against lazy, the same layout: what
  the mode's redundant forward costs);
- for Bamboo's modes, the redundant forward's share of the workers' schedule time (``phase_seconds``)
  and the operation-level model's step time relative to lazy (``oobleck.schedules.cost`` on the
  run's plan and measured profile: what the mode's lists cost where every rank has its own core);
- the host's cores and load average at the start and end of every run; a ratio measured while
  the run's processes outnumbered the cores says how the modes share a CPU, not how they fill
  bubbles on devices of their own (eager's point), and is flagged.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from protocol import (  # noqa: E402
    RunResult,
    Variant,
    add_protocol_arguments,
    protocol_out,
    run_tiny_protocol,
    runs_by_repeat,
)

BAMBOO_DEPTH = (("strategy.pipeline_depth", 2),)
VARIANTS = (
    Variant("oobleck", "oobleck"),
    *(
        Variant(f"bamboo-{mode}", "bamboo", (("strategy.redundancy", mode), *BAMBOO_DEPTH))
        for mode in ("lazy", "eager", "inline")
    ),
)
NAMES = tuple(v.name for v in VARIANTS)


def steady_rate(outcome, warmup: int) -> float:
    rates = [row["samples_per_s"] for row in outcome.steps[warmup:]]
    return statistics.median(rates)


def redundant_share(outcome) -> float:
    phases = outcome.phase_seconds.values()
    pipeline = sum(p.get("pipeline_1f1b", 0.0) for p in phases)
    return sum(p.get("redundant_forward", 0.0) for p in phases) / pipeline if pipeline else 0.0


def model_ratio(result: RunResult) -> float:
    """The operation-level cost of the run's schedule relative to the same plan run lazily."""
    from dataclasses import replace

    from oobleck.planning.inputs import ClusterSpec
    from oobleck.planning.outputs import ExecutionPlan
    from oobleck.profiling import get_profile
    from oobleck.schedules import build_schedule
    from oobleck.schedules.cost import schedule_cost

    cfg = result.cfg
    data = json.loads((result.run_dir / "plan.json").read_text())
    plan = ExecutionPlan.from_dict(data.get("plan", data))
    profile, cluster = get_profile(cfg), ClusterSpec.from_config(cfg.cluster)
    lazy = replace(plan, redundancy="lazy")
    mine = schedule_cost(plan, build_schedule(plan), profile, cluster).makespan_s
    return mine / schedule_cost(lazy, build_schedule(lazy), profile, cluster).makespan_s


def spread(values: list[float]) -> str:
    if not values:
        return "-"  # every run of it failed (protocol.json has the errors)
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_protocol_arguments(parser, steps=40, nodes=4, failures=1)  # failures: drawn, unused without faults
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    out = protocol_out(args.out, "bench_bamboo_modes")
    cores = os.cpu_count() or 1
    print(
        f"{cores} cores, load average {os.getloadavg()[0]:.2f}; gpt3_tiny on {args.nodes} nodes; run dirs under {out}"
    )
    results: dict[Path, RunResult] = {}
    manifest = run_tiny_protocol(VARIANTS, args, out, faults=["none"], fault_tolerance=1, results=results)
    rates: dict[str, list[float]] = {name: [] for name in NAMES}
    ratios: dict[str, list[float]] = {name: [] for name in NAMES}
    against_lazy: dict[str, list[float]] = {name: [] for name in NAMES}
    shares: dict[str, list[float]] = {name: [] for name in NAMES}
    modelled: dict[str, float] = {}
    loaded = False
    for repeat, runs in enumerate(runs_by_repeat(manifest, out, "none", results)):
        rate = {name: steady_rate(result.outcome, args.warmup) for name, result in runs.items()}
        for name, result in runs.items():
            rates[name].append(rate[name])
            shares[name].append(redundant_share(result.outcome))
            loaded |= max(result.load) > cores
            print(
                f"repeat {repeat} {name:14s} {rate[name]:8.1f} samples/s  load {result.load[0]:.2f} -> {result.load[1]:.2f}"
            )
            if name.startswith("bamboo") and name not in modelled:
                modelled[name] = model_ratio(result)
            if "oobleck" in rate:
                ratios[name].append(rate[name] / rate["oobleck"])
            if "bamboo-lazy" in rate:
                against_lazy[name].append(rate[name] / rate["bamboo-lazy"])
    print(
        f"\nsteady state, median [min-max] over {args.repeats} interleaved repeats (load at end {os.getloadavg()[0]:.2f})"
    )
    print(
        f"{'config':14s} {'samples/s':>26s} {'/ oobleck':>22s} {'/ bamboo-lazy':>22s} {'redundant share':>22s}"
        f" {'model / lazy':>12s}"
    )
    for name in NAMES:
        model = f"{modelled[name]:.3f}" if name in modelled else ""
        lazy = spread(against_lazy[name]) if name.startswith("bamboo") else ""
        print(
            f"{name:14s} {spread(rates[name]):>26s} {spread(ratios[name]):>22s} {lazy:>22s}"
            f" {spread(shares[name]):>22s} {model:>12s}"
        )
    if loaded:
        print(
            f"warning: the load average exceeded the {cores} cores during some runs: the ratios say how the modes "
            "share a CPU, not how they fill pipeline bubbles on devices of their own"
        )


if __name__ == "__main__":
    main()

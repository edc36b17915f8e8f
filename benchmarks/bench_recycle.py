"""ReCycle against Oobleck: steady-state cost of its machinery, and a re-route's recovery against a
reconfiguration's on the same failure, measured in one run.

    python benchmarks/bench_recycle.py [--steps 40] [--repeats 3] [--nodes 4] [--seed 0] [--out DIR]
                                       [--warmup 5] [--heartbeat-timeout-s 5]

gpt3_tiny on ``--nodes`` local nodes (ReCycle at depth 2: D=2 x P=2 on 4 nodes; Oobleck on its
planner's plan, f=1), under the protocol of ``benchmarks/protocol.py``: ``--repeats`` interleaved
rounds, each running both strategies without failures and then both with the same failure, one
node SIGKILLed at a step the protocol draws per round from ``--seed`` (the same step for both
strategies in a round; the injector picks the node). ``bench_strategies.py`` compares ReCycle's
goodput with the others'; this benchmark looks inside a re-route. Printed:

- steady state: median samples/s over the steps after ``--warmup`` and ReCycle's over Oobleck's
  in the same repeat (median [min-max]); ReCycle's intact plan is plain 1F1B, so this says what a
  D x P layout costs against Oobleck's plan here, not any re-route machinery;
- recovery: each recovery's total seconds (kill to the first step after it committed: detection,
  planning, process groups, state copy, first step) and its state copy, re-route vs
  reconfiguration; and the median step rate after the failure over the rate before;
- the operation-level model (``oobleck.schedules.cost`` on the measured profile): the re-routed
  plan's makespan over the intact one's, and what a staggered optimizer step could at most save
  per step (``baselines.recycle.policy.staggering_bound_s``) beside the measured share of the
  step spent in the gradient reduction and the optimizer (staggering hides at most that);
- the host's cores and load at the start and end of every run (a ratio measured while the run's
  processes outnumbered the cores says how the layouts share a CPU, and is flagged).
"""

from __future__ import annotations

import argparse
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

STRATEGIES = ("oobleck", "recycle")
VARIANTS = (Variant("oobleck", "oobleck"), Variant("recycle", "recycle", (("strategy.pipeline_depth", 2),)))


def rate(steps: list[dict]) -> float:
    return statistics.median(row["samples_per_s"] for row in steps) if steps else float("nan")


def spread(values: list[float]) -> str:
    if not values:
        return "-"  # every run of it failed (protocol.json has the errors)
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def sync_share(outcome) -> float:
    """The share of the workers' step time in the gradient reduction and the optimizer step."""
    phases = list(outcome.phase_seconds.values())
    total = sum(sum(p.values()) for p in phases)
    synced = sum(p.get("grad_allreduce", 0.0) + p.get("optimizer", 0.0) for p in phases)
    return synced / total if total else 0.0


def model(cfg, failed_node: int) -> tuple[float, float, float]:
    """(re-routed makespan / intact makespan, staggering bound intact, re-routed) by the op-level cost."""
    from baselines.recycle.policy import staggering_bound_s
    from oobleck.elastic.job import make_strategy
    from oobleck.schedules import build_schedule
    from oobleck.schedules.cost import schedule_cost
    from oobleck.strategy import RunState

    strategy = make_strategy(cfg)
    ctx = strategy.context
    nodes = int(cfg.cluster.nodes)
    intact = strategy.start(list(range(nodes))).layout
    alive = tuple(n for n in range(nodes) if n != failed_node)
    rerouted = strategy.on_change(RunState(intact, alive, (failed_node,), (), 1)).layout
    spans = [
        schedule_cost(layout.plan, build_schedule(layout.plan), ctx.profile, ctx.cluster).makespan_s
        for layout in (intact, rerouted)
    ]
    bounds = [staggering_bound_s(layout.plan, ctx.profile, ctx.cluster) for layout in (intact, rerouted)]
    return spans[1] / spans[0], bounds[0] / spans[0], bounds[1] / spans[1]


def failure_step(result: RunResult) -> int:
    """The step of the run's one scheduled failure."""
    (event,) = result.cfg.failures.events
    return int(event.step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_protocol_arguments(parser, steps=40, nodes=4, failures=1)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if args.failures != 1:
        parser.error("--failures: this benchmark looks at one failure per run")
    out = protocol_out(args.out, "bench_recycle")
    cores = os.cpu_count() or 1
    print(f"{cores} cores, load average {os.getloadavg()[0]:.2f}; gpt3_tiny on {args.nodes} nodes; runs under {out}")
    results: dict[Path, RunResult] = {}
    manifest = run_tiny_protocol(VARIANTS, args, out, faults=["none", "crash"], fault_tolerance=1, results=results)
    steady: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    ratio: list[float] = []
    recovery: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    copied: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    after: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    shares: list[float] = []
    loaded = False
    modelled = None
    for repeat, runs in enumerate(runs_by_repeat(manifest, out, "none", results)):
        for strategy, result in runs.items():
            steady[strategy].append(rate(result.outcome.steps[args.warmup :]))
            loaded |= max(result.load) > cores
            if strategy == "recycle":
                shares.append(sync_share(result.outcome))
            print(
                f"repeat {repeat} {strategy:8s} steady  {steady[strategy][-1]:8.1f} samples/s"
                f"  load {result.load[0]:.2f} -> {result.load[1]:.2f}"
            )
        if len(runs) == len(STRATEGIES):
            ratio.append(steady["recycle"][-1] / steady["oobleck"][-1])
    paired: list[float] = []
    for repeat, runs in enumerate(runs_by_repeat(manifest, out, "crash", results)):
        for strategy, result in runs.items():
            outcome, step = result.outcome, failure_step(result)
            loaded |= max(result.load) > cores
            (row,) = outcome.recoveries
            recovery[strategy].append(row["total_s"])
            copied[strategy].append(row["state_copy_s"])
            before = rate([s for s in outcome.steps[args.warmup :] if s["step"] < step])
            later = rate([s for s in outcome.steps if s["step"] > step + 1])
            after[strategy].append(later / before)
            (node,) = row["removed"]
            if strategy == "recycle" and modelled is None:
                modelled = model(result.cfg, node)
            print(
                f"repeat {repeat} {strategy:8s} node {node} killed at step {step}: {row['kind']} "
                f"{row['total_s']:.3f} s (copy {row['state_copy_s']:.3f} s), after/before {after[strategy][-1]:.3f}"
                f"  load {result.load[0]:.2f} -> {result.load[1]:.2f}"
            )
        if len(runs) == len(STRATEGIES):
            paired.append(recovery["recycle"][-1] / recovery["oobleck"][-1])
    print(f"\nmedian [min-max] over {args.repeats} interleaved repeats (load at end {os.getloadavg()[0]:.2f})")
    print(f"steady samples/s   oobleck {spread(steady['oobleck'])}   recycle {spread(steady['recycle'])}")
    print(f"steady recycle / oobleck (same repeat): {spread(ratio)}")
    for strategy in STRATEGIES:
        print(
            f"{strategy:8s} recovery total_s {spread(recovery[strategy])}  state copy {spread(copied[strategy])}"
            f"  rate after / before {spread(after[strategy])}"
        )
    print(f"re-route / reconfiguration recovery time (same repeat): {spread(paired)}")
    if modelled is not None:
        print(
            f"op-level model: re-routed / intact makespan {modelled[0]:.3f}; a staggered optimizer step could hide at "
            f"most {modelled[1]:.1%} (intact) / {modelled[2]:.1%} (re-routed) of the makespan; measured reduction + "
            f"optimizer share of ReCycle's steady step {spread(shares)}"
        )
    if loaded:
        print(
            f"warning: the load average exceeded the {cores} cores during some runs: the ratios say how the layouts "
            "share a CPU, not how re-routed work fills bubbles on devices of their own"
        )


if __name__ == "__main__":
    main()

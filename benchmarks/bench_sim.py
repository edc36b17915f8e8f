"""Simulator speed: one model and strategy over the 11-hour EC2 spot trace (target < 10 s each).

    python benchmarks/bench_sim.py [--models gpt3_2_7b gpt3_6_7b] [--trace spot/ec2_p3_scaled]

Prints one row per (model, strategy): wall seconds of the simulation itself (templates are
generated once per model beforehand and reported separately, as a simulation sweep shares them),
the number of membership changes replayed and the resulting throughput. Uses the
``experiment=paper_spot`` configuration (analytic A100 profiles, 1 GPU per node).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from hydra import compose, initialize_config_dir



def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["gpt3_medium", "gpt3_2_7b", "gpt3_6_7b"])
    parser.add_argument("--trace", default="spot/ec2_p3_scaled")
    parser.add_argument("--strategies", nargs="+", default=["oobleck", "varuna", "bamboo"])
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from oobleck.config import CONF_DIR  # also registers the schema
    from oobleck.faults.trace import load_trace
    from oobleck.sim.engine import simulate
    from oobleck.sim.experiment import build_context, model_profile, simulated_strategy

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=paper_spot"])
    trace = load_trace(args.trace)
    hours = (trace.end_ms - trace.start_ms) / 3.6e6
    print(f"trace {trace.name}: {hours:.1f} h, {len(trace.changes())} changes, up to {trace.max_nodes()} nodes")
    print(f"{'model':<12} {'strategy':<8} {'templates_s':>11} {'sim_s':>7} {'events':>7} {'samples/s':>10}")
    worst = 0.0
    for model in args.models:
        profile = model_profile(cfg, model)
        base = build_context(cfg, profile, trace.max_nodes())
        clock = time.perf_counter()
        try:
            base.templates()
        except Exception:  # the model may not admit f+1 pipelines; strategies report that themselves
            pass
        base.templates(0)
        templates_s = time.perf_counter() - clock
        for name in args.strategies:
            strategy = simulated_strategy(cfg, name, base)
            clock = time.perf_counter()
            result = simulate(strategy, trace, labels={"model": model})
            seconds = time.perf_counter() - clock
            worst = max(worst, seconds)
            print(
                f"{model:<12} {name:<8} {templates_s:>11.2f} {seconds:>7.2f} {len(result.events):>7} "
                f"{result.summary['throughput']:>10.2f}"
            )
    print(f"slowest simulation: {worst:.2f} s (target < 10 s) -> {'OK' if worst < 10 else 'TOO SLOW'}")
    sys.exit(0 if worst < 10 else 1)


if __name__ == "__main__":
    main()

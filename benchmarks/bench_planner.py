"""Planner speed on one core, and the quality of its reconfigurations.

    python benchmarks/bench_planner.py [--nodes 16 64 256] [--layers 100] [--gpus 8] [--timeout 600]
                                       [--quality-cases 1000] [--skip-quality]

Speed targets (issue 12), each printed beside the figure before issue 12 (README, commit 3648fed,
measured on this machine) and as a ratio to the target: templates for 100 layers, N=64, G=8, f=3
at about 1 s (1.0 s before); instantiation at N=256 under 0.5 s (2.2 s before); reconfiguration
of 64 nodes losing 3, including the regroup-or-re-plan decision and the node placement, under
50 ms (2.6 ms before, without either). Times are the best of several runs, wall clock and CPU
(the CPU time is the steadier figure on a shared machine); the first instantiation of a template
set also computes exact 1F1B makespans that later calls find cached. Each template case runs in
its own process with a time limit (reported as "> limit" when it is exceeded). Profiles are the
seeded synthetic ones (``oobleck.planning.synthetic``) on an A100-class cluster description.

Quality (issue 12): over seeded random reconfigurations, how often the new plan is slower than a
fresh instantiation on the same nodes (before: 46% slower, 210 of about 11,000 over 1.5x), and
how many of those the extra copying of the fresh plan over planner.replan_horizon_steps
justifies; and the paper's 30-node cluster losing one node at a time (experiment
paper_failure_frequency), where the reconfigured GPT-3 medium plan ran 16% below a fresh one at
about 22 nodes before (gpt2_small 25%).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

INTRA, INTER, MEMORY = 150e9, 12.5e9, 40e9  # NVLink-class, 100 Gb/s, A100-40GB (as conf/cluster/slurm.yaml)


def _cluster(nodes: int, gpus: int):
    from oobleck.planning.inputs import ClusterSpec

    return ClusterSpec(
        nodes=nodes,
        gpus_per_node=gpus,
        device_memory_bytes=MEMORY,
        intra_node_bandwidth=INTRA,
        inter_node_bandwidth=INTER,
    )


def _best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def templates_case(layers: int, nodes: int, gpus: int, f: int) -> dict:
    """Run in a child process: one template generation, timed."""
    from oobleck.planning.synthetic import synthetic_profile
    from oobleck.planning.templates import generate_templates

    profile = synthetic_profile(layers, seed=0)
    started = time.perf_counter()
    templates = generate_templates(profile, _cluster(nodes, gpus), f)
    return {"seconds": time.perf_counter() - started, "templates": len(templates.templates), "n0": templates.min_nodes}


def run_templates(layers: int, nodes: int, gpus: int, f: int, timeout: float) -> str:
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); import bench_planner as b; "
        f"print(json.dumps(b.templates_case({layers}, {nodes}, {gpus}, {f})))"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
        return f"> {timeout:.0f} s"
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return f"{result['seconds']:.3f} s ({result['templates']} templates, n0={result['n0']})"


def distribution_case(pipelines: int, microbatches: int) -> float:
    import numpy as np

    from oobleck.planning.instantiate import distribute_microbatches

    rng = np.random.default_rng(0)
    stages = [list(rng.uniform(0.05, 0.2, size=int(rng.integers(2, 9)))) for _ in range(pipelines)]
    return _best_of(lambda: distribute_microbatches(stages, microbatches), 20)


def _best_times(fn, repeats: int) -> tuple[float, float]:
    """Best wall-clock and best CPU seconds of ``repeats`` calls."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        started, started_cpu = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - started)
        cpu = min(cpu, time.process_time() - started_cpu)
    return wall, cpu


def reconfiguration_case(layers: int, nodes: int, gpus: int, f: int, param_bytes: int = 50_000_000) -> dict:
    from oobleck.planning.instantiate import instantiate
    from oobleck.planning.reconfigure import reconfigure
    from oobleck.planning.synthetic import synthetic_profile
    from oobleck.planning.templates import generate_templates

    profile = synthetic_profile(layers, seed=0, param_bytes=param_bytes)
    templates = generate_templates(profile, _cluster(nodes, gpus), f)
    batch = 16 * nodes
    started = time.perf_counter()
    plan = instantiate(templates, range(nodes), batch, 1, f)
    first = time.perf_counter() - started
    inst_wall, inst_cpu = _best_times(lambda: instantiate(templates, range(nodes), batch, 1, f), 3)
    lost = [p.nodes[-1] for p in plan.pipelines[:f]]  # one node from each of f pipelines
    reconfigure(plan, templates, removed=lost)  # warm: scipy's import and the makespan cache
    wall, cpu = _best_times(lambda: reconfigure(plan, templates, removed=lost), 5)
    result = reconfigure(plan, templates, removed=lost)
    shape = (
        f"{len(plan.pipelines)} -> {len(result.new.pipelines)} pipelines, {result.bytes_moved / 1e9:.2f} GB moved, "
        f"{'re-planned' if result.replanned else 'regrouped'}"
    )
    return {"first": first, "inst_wall": inst_wall, "inst_cpu": inst_cpu, "wall": wall, "cpu": cpu, "shape": shape}


def _random_reconfigurations(cases: int, seed: int = 0) -> dict:
    """Seeded random small jobs, each losing up to f nodes and gaining up to 2 (a node may fail
    and come back): the new plan against a fresh instantiation on the same nodes."""
    import random

    from oobleck.errors import PlanningError
    from oobleck.planning.inputs import ClusterSpec
    from oobleck.planning.instantiate import instantiate
    from oobleck.planning.pipeline_cost import copy_seconds
    from oobleck.planning.reconfigure import reconfigure
    from oobleck.planning.synthetic import synthetic_profile
    from oobleck.planning.templates import generate_templates

    rng = random.Random(seed)
    tally = {
        "cases": 0,
        "slower": 0,
        "over_3pct": 0,
        "over_3pct_justified": 0,
        "over_1_5x": 0,
        "replanned": 0,
        "worst": 1.0,
    }
    horizon = 100
    while tally["cases"] < cases:
        layers, nodes, f = rng.randint(2, 12), rng.randint(2, 12), rng.randint(0, 3)
        profile = synthetic_profile(
            layers,
            seed=rng.randint(0, 10**6),
            jitter=0.6,
            param_bytes=rng.choice([4_000_000, 400_000_000]),
            output_bytes=rng.choice([0, 4_000_000, 1_000_000_000]),
        )
        cluster = ClusterSpec(nodes + 2, rng.choice([1, 2, 4]), 8e9, 150e9, rng.choice([1e9, 12.5e9]))
        M = rng.choice([2, 4, 8, 16, 64])
        try:
            templates = generate_templates(profile, cluster, f)
            plan = instantiate(templates, range(nodes), M, 1, f)
            removed = rng.sample(plan.nodes, rng.randint(0, f))
            joined = [100 + i for i in range(rng.randint(0, 2))] + (removed[:1] if rng.random() < 0.2 else [])
            if not removed and not joined:
                continue
            result = reconfigure(
                plan, templates, removed=removed, joined=joined, replan_horizon_steps=horizon, fault_tolerance=f
            )
            eager = reconfigure(
                plan, templates, removed=removed, joined=joined, replan_horizon_steps=10**12, fault_tolerance=f
            )
        except PlanningError:
            continue  # no plan to start from, or a layer lost every replica
        # A fresh plan on the same nodes keeping as many failures as the reconfigured one could.
        fresh = instantiate(templates, result.new.nodes, M, 1, eager.new.fault_tolerance)
        ratio = result.new.predicted_iteration_s / min(fresh.predicted_iteration_s, eager.new.predicted_iteration_s)

        def copy(r, cluster=cluster):
            return copy_seconds(
                ((t.source[0], t.target[0], t.nbytes) for t in r.transfers), cluster.inter_node_bandwidth
            )

        tally["cases"] += 1
        tally["replanned"] += result.replanned
        tally["slower"] += ratio > 1 + 1e-12
        tally["over_1_5x"] += ratio > 1.5
        tally["worst"] = max(tally["worst"], ratio)
        if ratio > 1.03:
            tally["over_3pct"] += 1
            slower = horizon * (result.new.predicted_iteration_s - eager.new.predicted_iteration_s)
            tally["over_3pct_justified"] += slower <= copy(eager) - copy(result) + 1e-9
    return tally


def _paper_shrink(model: str, stop: int) -> list[tuple[int, float, float]]:
    """experiment=paper_failure_frequency: 30 nodes losing one node at a time (the lowest id of the
    largest pipeline, seeded order otherwise irrelevant) down to ``stop``; per node count the
    reconfigured plan's predicted iteration time and a fresh instantiation's on the same nodes."""
    from oobleck.config import compose_config
    from oobleck.planning.inputs import ClusterSpec
    from oobleck.planning.instantiate import instantiate
    from oobleck.planning.reconfigure import reconfigure
    from oobleck.planning.templates import generate_templates
    from oobleck.profiling.analytic import analytic_profile

    cfg = compose_config("experiment=paper_failure_frequency", f"model={model}", "cluster.nodes=30")
    profile = analytic_profile(cfg.model, cfg.cluster.gpu, int(cfg.job.microbatch_size))
    f, B, b = int(cfg.job.fault_tolerance), int(cfg.job.global_batch_size), int(cfg.job.microbatch_size)
    templates = generate_templates(profile, ClusterSpec.from_config(cfg.cluster), f)
    plan, rows, standby = instantiate(templates, range(30), B, b, f), [], ()
    while len(plan.nodes) > stop:
        victim = min(max(plan.pipelines, key=lambda p: (len(p.nodes), -p.index)).nodes)
        result = reconfigure(
            plan,
            templates,
            removed=[victim],
            standby=standby,
            replan_horizon_steps=int(cfg.planner.replan_horizon_steps),
            fault_tolerance=f,
        )
        plan, standby = result.new, result.standby
        fresh = instantiate(templates, plan.nodes, B, b, plan.fault_tolerance)
        rows.append((len(plan.nodes), plan.predicted_iteration_s, fresh.predicted_iteration_s))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", nargs="+", type=int, default=[16, 64, 256])
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--faults", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="limit per template case, seconds")
    parser.add_argument("--reconfig-gpus", type=int, default=1, help="GPUs per node of the reconfiguration cases")
    parser.add_argument(
        "--reconfig-param-bytes",
        type=int,
        nargs="+",
        default=[50_000_000, 200_000_000],
        help="parameter bytes per layer: 50 MB: the model fits on one node; 200 MB: it needs three",
    )
    parser.add_argument(
        "--quality-cases", type=int, default=1000, help="random reconfigurations to compare with fresh plans"
    )
    parser.add_argument("--skip-quality", action="store_true")
    args = parser.parse_args()

    print(f"templates: {args.layers} layers, f={args.faults}")
    print(f"{'N':>5}  {'G':>3}  time")
    for gpus in sorted({1, args.gpus}):
        for nodes in args.nodes:
            print(
                f"{nodes:>5}  {gpus:>3}  {run_templates(args.layers, nodes, gpus, args.faults, args.timeout)}",
                flush=True,
            )

    print("\nbatch distribution (best of 20)")
    print(f"{'pipelines':>9}  {'microbatches':>12}  time")
    for nodes in args.nodes:
        pipelines = max(1, nodes // 2)
        print(f"{pipelines:>9}  {8192:>12}  {distribution_case(pipelines, 8192) * 1e3:.2f} ms", flush=True)

    print(
        f"\ninstantiation and reconfiguration (losing f={args.faults} nodes): {args.layers} layers, G={args.reconfig_gpus}"
    )
    print(
        f"{'MB/layer':>8}  {'N':>5}  {'instantiate: first':>18}  {'best wall':>9}  {'CPU':>7}  {'reconfigure: wall':>17}  {'CPU':>8}  result"
    )
    results = {}
    for param_bytes in args.reconfig_param_bytes:
        for nodes in args.nodes:
            r = reconfiguration_case(args.layers, nodes, args.reconfig_gpus, args.faults, param_bytes)
            results[(param_bytes, nodes)] = r
            print(
                f"{param_bytes / 1e6:>8.0f}  {nodes:>5}  {r['first']:>16.3f} s  {r['inst_wall']:>7.3f} s  {r['inst_cpu']:>5.3f} s  "
                f"{r['wall'] * 1e3:>14.2f} ms  {r['cpu'] * 1e3:>5.2f} ms  {r['shape']}",
                flush=True,
            )
    print("\ntargets (issue 12), best CPU time; before: README at commit 3648fed, same machine")
    for label, key, figure, before, target in (
        ("instantiation, N=256, 50 MB/layer", (50_000_000, 256), "inst_cpu", 2.2, 0.5),
        ("reconfiguration, 64 nodes losing 3, 50 MB/layer", (50_000_000, 64), "cpu", 2.6e-3, 50e-3),
    ):
        if key in results:
            now = results[key][figure]
            print(
                f"  {label}: {now * 1e3:.1f} ms (before {before * 1e3:.1f} ms, target {target * 1e3:.0f} ms: {now / target:.2f} of it)"
            )
    print("  templates, N=64, G=8: the table above (before 1.0 s, target about 1 s)")

    if args.skip_quality:
        return
    tally = _random_reconfigurations(args.quality_cases)
    n = tally["cases"]
    print(f"\nreconfiguration quality: {n} seeded random reconfigurations, planner.replan_horizon_steps=100")
    print(
        f"  slower than a fresh plan: {tally['slower']} ({tally['slower'] / n:.1%}; before 46%); more than 3% slower: "
        f"{tally['over_3pct']}, of which the fresh plan's extra copying over the horizon justifies "
        f"{tally['over_3pct_justified']}; more than 1.5x: {tally['over_1_5x']} (before 210 of ~11,000); "
        f"worst {tally['worst']:.3f}x; re-planned from scratch: {tally['replanned']}"
    )
    for model in ("gpt3_medium", "gpt2_small"):
        rows = _paper_shrink(model, 15)
        worst = max(rows, key=lambda row: row[1] / row[2])
        at22 = [row for row in rows if row[0] == 22]
        print(
            f"  paper_failure_frequency, {model}, 30 -> 15 nodes one at a time: worst reconfigured/fresh "
            f"{worst[1] / worst[2]:.3f} at {worst[0]} nodes"
            + (f"; at 22 nodes {at22[0][1] / at22[0][2]:.3f}" if at22 else "")
            + " (before: 16% below fresh at about 22 nodes for gpt3_medium, 25% for gpt2_small)"
        )


if __name__ == "__main__":
    main()

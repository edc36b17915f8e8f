"""Planner speed on one core: templates, batch distribution, instantiation, reconfiguration.

    python benchmarks/bench_planner.py [--nodes 16 64 256] [--layers 100] [--gpus 8] [--timeout 600]

Targets (issue 2): templates for 100 layers, N=64, G=8, f=3 under 2 s; 8192 microbatches over 32
pipelines under 10 ms; reconfiguration of 64 nodes losing 3 under 50 ms. Each template case runs
in its own process with a time limit (reported as "> limit" when it is exceeded). Profiles are
the seeded synthetic ones (``oobleck.planning.synthetic``) on an A100-class cluster description.
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
    from oobleck.planning.profile import ClusterSpec

    return ClusterSpec(nodes=nodes, gpus_per_node=gpus, device_memory_bytes=MEMORY, intra_node_bandwidth=INTRA, inter_node_bandwidth=INTER)


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


def reconfiguration_case(layers: int, nodes: int, gpus: int, f: int, param_bytes: int = 50_000_000) -> tuple[float, float, str]:
    from oobleck.planning.instantiate import instantiate
    from oobleck.planning.reconfigure import reconfigure
    from oobleck.planning.synthetic import synthetic_profile
    from oobleck.planning.templates import generate_templates

    profile = synthetic_profile(layers, seed=0, param_bytes=param_bytes)
    templates = generate_templates(profile, _cluster(nodes, gpus), f)
    batch = 16 * nodes
    started = time.perf_counter()
    plan = instantiate(templates, range(nodes), batch, 1, f)
    instantiate_s = time.perf_counter() - started
    lost = [p.nodes[-1] for p in plan.pipelines[:f]]  # one node from each of f pipelines
    seconds = _best_of(lambda: reconfigure(plan, templates, removed=lost), 5)
    result = reconfigure(plan, templates, removed=lost)
    shape = f"{len(plan.pipelines)} -> {len(result.new.pipelines)} pipelines, {result.bytes_moved / 1e9:.2f} GB moved"
    return instantiate_s, seconds, shape


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
    args = parser.parse_args()

    print(f"templates: {args.layers} layers, f={args.faults}")
    print(f"{'N':>5}  {'G':>3}  time")
    for gpus in sorted({1, args.gpus}):
        for nodes in args.nodes:
            print(f"{nodes:>5}  {gpus:>3}  {run_templates(args.layers, nodes, gpus, args.faults, args.timeout)}", flush=True)

    print("\nbatch distribution (best of 20)")
    print(f"{'pipelines':>9}  {'microbatches':>12}  time")
    for nodes in args.nodes:
        pipelines = max(1, nodes // 2)
        print(f"{pipelines:>9}  {8192:>12}  {distribution_case(pipelines, 8192) * 1e3:.2f} ms", flush=True)

    print(f"\ninstantiation and reconfiguration (losing f={args.faults} nodes): {args.layers} layers, G={args.reconfig_gpus}")
    print(f"{'MB/layer':>8}  {'N':>5}  {'instantiate':>11}  {'reconfigure':>11}  result")
    for param_bytes in args.reconfig_param_bytes:
        for nodes in args.nodes:
            inst, seconds, shape = reconfiguration_case(args.layers, nodes, args.reconfig_gpus, args.faults, param_bytes)
            print(f"{param_bytes / 1e6:>8.0f}  {nodes:>5}  {inst:>9.3f} s  {seconds * 1e3:>8.2f} ms  {shape}", flush=True)


if __name__ == "__main__":
    main()

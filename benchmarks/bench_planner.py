"""Planner speed, cold and warm, against a peer planner in the same run; and reconfiguration quality.

    python benchmarks/bench_planner.py [--peer DIR] [--only templates plans quality]
                                       [--repeats 5] [--timeout 600] [--quality-cases 1000]

Every figure is CPU seconds of one core (``OMP_NUM_THREADS=1``), measured two ways:

- cold: templates in a fresh process (the figure a user of ``oobleck-plan`` waits for, imports
  excluded); instantiation and reconfiguration with every cache cleared (the template set's
  memo and the makespan cache), best of ``--repeats``;
- warm: the same call again in the same process (templates: a second generation; instantiation and
  reconfiguration: the memoised answer a simulation gets when it asks the same question again).

``--peer DIR``: a checkout of the planner to compare with (e.g. ``git archive 96f8f34 | tar -x -C
DIR``, the planner before issue 30); each template case runs in a fresh process of each, alternated,
and every line gives the ratio. The load average is printed with every section: on this shared
2-core machine a ratio measured while processes outnumbered cores moves by tens of percent.

Profiles (``--only templates``):

- ``synthetic``: ``oobleck.planning.synthetic.synthetic_profile(100, seed=0)`` on an A100-40GB
  cluster (150 GB/s in a node, 12.5 GB/s between nodes): forward 7-13 ms, 35-65 MB per layer;
- ``realistic``: ``realistic_profile.json`` beside this file, made by ``realistic_profile()``
  below: 100 layers of forward 8-12 ms (backward twice that), 40-60 MB of parameters, the
  activations a GPT layer of width 2048 keeps for a sequence of 2048 with selective
  recomputation (34 T C bytes: Korthikanti et al., MLSys'23, eq. 1, +-10%) and a 16-bit boundary
  tensor (T C 2 bytes), on the same cluster;
- ``gptNNN``: the issue's command, ``oobleck-plan model=gpt3_6_7b model.n_layer=NNN-2
  profile.source=analytic cluster.device_memory_gb=80 job.microbatch_size=1`` on 64 nodes of 8
  GPUs, f=3 (NNN identical decoder layers plus the embedding and the head; the local cluster's
  10 GB/s and 1 GB/s links): 48, 80 (Llama-3 70B's depth), 100 and 128 layers.

Targets (issue 30; printed as the share of the target each figure is): templates for 100 layers
on 64 nodes of 8 GPUs with f=3 within 1 s cold (realistic, gpt100), 128 identical layers within
2 s, 256 nodes within 2 s, 1,024 within 10 s; instantiation at N=1,024 within 0.5 s; a
reconfiguration of 64 nodes of 8 GPUs losing 3, cold, within 50 ms.

Instantiation and reconfiguration (``--only plans``) run in this tree and, with ``--peer``, in the
peer's, alternated case by case. Quality (``--only quality``): over seeded random
reconfigurations, how often the new plan is slower than a fresh instantiation on the same nodes
and how many of those the extra copying justifies; and the paper's 30-node cluster losing one
node at a time (experiment paper_failure_frequency).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
REALISTIC = HERE / "realistic_profile.json"
INTRA, INTER, MEMORY = 150e9, 12.5e9, 40e9  # NVLink-class, 100 Gb/s, A100-40GB (as conf/cluster/slurm.yaml)
FAULTS = 3
TARGETS = {  # (case, nodes, gpus) -> target seconds, cold
    ("realistic", 64, 8): 1.0,
    ("gpt100", 64, 8): 1.0,
    ("gpt128", 64, 8): 2.0,
    ("realistic", 256, 8): 2.0,
    ("synthetic", 256, 8): 2.0,
    ("realistic", 1024, 8): 10.0,
}


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} {five:.2f} on {os.cpu_count()} cores"


def realistic_profile():
    """The realistic profile (``realistic_profile.json`` is this, saved)."""
    import numpy as np

    from oobleck.planning.inputs import LayerProfile, ModelProfile

    rng = np.random.default_rng(2026)
    layers, sequence, width = 100, 2048, 2048
    made = []
    for index in range(layers):
        forward = float(rng.uniform(0.008, 0.012))
        params = int(rng.uniform(40e6, 60e6)) // 4 * 4
        activations = int(34 * sequence * width * rng.uniform(0.9, 1.1))
        output = sequence * width * 2 if index < layers - 1 else 0
        made.append(LayerProfile(f"layer{index}", forward, 2 * forward, params, activations, output))
    return ModelProfile(
        "realistic-100",
        1,
        "analytic:A100-40GB",
        tuple(made),
        source="synthetic",
        metadata={"generator": "benchmarks/bench_planner.py (realistic_profile docstring)", "seed": 2026},
    )


def profile_and_cluster(case: str, nodes: int, gpus: int):
    """The profile and cluster of a case (see the module docstring); runs in the measured tree."""
    from oobleck.planning.inputs import ClusterSpec, ModelProfile

    if case.startswith("gpt"):
        profile = ModelProfile.load(os.environ["BENCH_PLANNER_PROFILES"] + f"/{case}.json")
        return profile, ClusterSpec(nodes, gpus, 80e9, 10e9, 1e9)
    if case == "realistic":
        profile = ModelProfile.load(REALISTIC)
    else:
        from oobleck.planning.synthetic import synthetic_profile

        profile = synthetic_profile(100, seed=0)
    return profile, ClusterSpec(nodes, gpus, MEMORY, INTRA, INTER)


def templates_case(case: str, nodes: int, gpus: int) -> dict:
    """In a fresh process: one template generation (cold), then another (warm)."""
    from oobleck.planning.templates import generate_templates

    profile, cluster = profile_and_cluster(case, nodes, gpus)
    times = []
    for _ in range(2):
        started = time.process_time()
        templates = generate_templates(profile, cluster, FAULTS)
        times.append(time.process_time() - started)
    values = {str(n): t.reference_iteration_s for n, t in templates.templates.items()}
    # Every stage of every template: equal-cost layouts may differ where the figures agree.
    layouts = {
        str(n): [[s.start, s.end, s.node, s.gpu_offset, s.gpus] for s in t.stages]
        for n, t in templates.templates.items()
    }
    return {
        "cold": times[0],
        "warm": times[1],
        "templates": len(templates.templates),
        "values": values,
        "layouts": layouts,
    }


def gpt_profiles(where: Path) -> None:
    """The gptNNN profiles, written once by this tree (the peer only loads them)."""
    from oobleck.config import compose_config
    from oobleck.profiling.analytic import analytic_profile

    for layers in (48, 80, 100, 128):
        cfg = compose_config(
            "model=gpt3_6_7b",
            f"model.n_layer={layers - 2}",
            "profile.source=analytic",
            "cluster.device_memory_gb=80",
            "job.microbatch_size=1",
        )
        analytic_profile(cfg.model, cfg.cluster.gpu, 1).save(where / f"gpt{layers}.json")


def run_child(tree: Path, function: str, args: tuple, timeout: float) -> dict | None:
    code = (
        f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import bench_planner as b; "
        f"print(json.dumps(b.{function}(*{args!r})))"
    )
    env = {**os.environ, "PYTHONPATH": str(tree)}
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=True, env=env, cwd=tree
        )
    except subprocess.TimeoutExpired:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def section_templates(trees: dict[str, Path], timeout: float) -> None:
    print(f"\ntemplates, f={FAULTS}: CPU seconds, cold (fresh process) / warm (second call) ({load()})")
    cases = [
        ("synthetic", 64, 1),
        ("synthetic", 64, 8),
        ("realistic", 64, 8),
        ("synthetic", 256, 8),
        ("realistic", 256, 8),
        ("realistic", 1024, 8),
        ("gpt48", 64, 8),
        ("gpt80", 64, 8),
        ("gpt100", 64, 8),
        ("gpt128", 64, 8),
    ]
    print(f"{'profile':>10} {'N':>5} {'G':>2}  " + "  ".join(f"{name:>22}" for name in trees) + "  target")
    for case, nodes, gpus in cases:
        row, results = [], {}
        for name, tree in trees.items():
            result = run_child(tree, "templates_case", (case, nodes, gpus), timeout)
            results[name] = result
            row.append(
                f"{f'> {timeout:.0f} s':>22}"
                if result is None
                else f"{result['cold']:>9.3f} / {result['warm']:>8.3f} s"
            )
        line = f"{case:>10} {nodes:>5} {gpus:>2}  " + "  ".join(row)
        target = TARGETS.get((case, nodes, gpus))
        ours = results.get("this")
        if target and ours:
            line += f"  {target:g} s ({ours['cold'] / target:.2f} of it)"
        peer = results.get("peer")
        if ours and peer:
            line += f"; peer/this cold {peer['cold'] / ours['cold']:.1f}x"
            same = ours["values"].keys() == peer["values"].keys() and all(
                abs(ours["values"][n] - peer["values"][n]) <= 1e-9 * peer["values"][n] for n in peer["values"]
            )
            if same and ours["layouts"] != peer["layouts"]:
                line += ", same figures, LAYOUTS DIFFER"
            else:
                line += ", same templates (every stage)" if same else ", TEMPLATES DIFFER"
        print(line, flush=True)


def _clear(templates) -> None:
    from oobleck.planning import pipeline_cost

    templates.memo.clear()
    pipeline_cost._exact_cached.cache_clear()


def _cold_and_warm(fn, templates, repeats: int) -> tuple[float, float]:
    cold = warm = float("inf")
    for _ in range(repeats):
        _clear(templates)
        started = time.process_time()
        fn()
        cold = min(cold, time.process_time() - started)
        started = time.process_time()
        fn()
        warm = min(warm, time.process_time() - started)
    return cold, warm


def plans_case(case: str, nodes: int, gpus: int, repeats: int) -> dict:
    """Instantiation of every node, then a reconfiguration losing one node of each of f pipelines."""
    from oobleck.planning.instantiate import instantiate
    from oobleck.planning.reconfigure import preload_solver, reconfigure
    from oobleck.planning.templates import generate_templates

    profile, cluster = profile_and_cluster(case, nodes, gpus)
    templates = generate_templates(profile, cluster, FAULTS)
    preload_solver()  # its import is paid once per process, before any recovery (see reconfigure.py)
    batch = 16 * nodes
    plan = instantiate(templates, range(nodes), batch, 1, FAULTS)
    lost = [p.nodes[-1] for p in plan.pipelines[:FAULTS]]
    inst = _cold_and_warm(lambda: instantiate(templates, range(nodes), batch, 1, FAULTS), templates, repeats)
    rec = _cold_and_warm(lambda: reconfigure(plan, templates, removed=lost), templates, repeats)
    result = reconfigure(plan, templates, removed=lost)
    shape = (
        f"{len(plan.pipelines)} -> {len(result.new.pipelines)} pipelines, {result.bytes_moved / 1e9:.2f} GB moved, "
        f"{'re-planned' if result.replanned else 'regrouped'}"
    )
    return {"instantiate": inst, "reconfigure": rec, "shape": shape}


def section_plans(trees: dict[str, Path], repeats: int) -> None:
    print(
        f"\ninstantiation and reconfiguration (losing one node of each of f={FAULTS} pipelines), CPU ms, best of {repeats}"
    )
    print(f"cold: caches cleared; warm: the memoised answer; each tree in its own process, alternated ({load()})")
    print(
        f"{'profile':>10} {'N':>5} {'G':>2} {'tree':>5}  {'instantiate cold / warm':>24}  "
        f"{'reconfigure cold / warm':>24}  result"
    )
    for case, nodes, gpus in (
        ("synthetic", 64, 1),
        ("synthetic", 64, 8),
        ("realistic", 64, 8),
        ("synthetic", 256, 1),
        ("realistic", 256, 8),
        ("realistic", 1024, 8),
    ):
        for name, tree in trees.items():
            r = run_child(tree, "plans_case", (case, nodes, gpus, repeats), 1800)
            assert r is not None  # (no limit that binds: 1,800 s)
            inst, rec = r["instantiate"], r["reconfigure"]
            print(
                f"{case:>10} {nodes:>5} {gpus:>2} {name:>5}  {inst[0] * 1e3:>11.1f} / {inst[1] * 1e3:>8.2f}  "
                f"{rec[0] * 1e3:>11.1f} / {rec[1] * 1e3:>8.2f}  {r['shape']}",
                flush=True,
            )
    print("targets: instantiation at N=1,024 within 500 ms, reconfiguration of 64 nodes of 8 GPUs within 50 ms, cold")


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
    tally = {"cases": 0, "slower": 0, "over_3pct": 0, "over_3pct_justified": 0, "over_1_5x": 0, "replanned": 0}
    tally["worst"] = 1.0
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
        fresh = instantiate(templates, result.new.nodes, M, 1, eager.new.fault_tolerance)
        ratio = result.new.predicted_iteration_s / min(fresh.predicted_iteration_s, eager.new.predicted_iteration_s)
        tally["cases"] += 1
        tally["replanned"] += result.replanned
        tally["slower"] += ratio > 1 + 1e-12
        tally["over_1_5x"] += ratio > 1.5
        tally["worst"] = max(tally["worst"], ratio)
        if ratio > 1.03:
            tally["over_3pct"] += 1
            slower = horizon * (result.new.predicted_iteration_s - eager.new.predicted_iteration_s)
            extra = copy_seconds(eager.transfers, cluster.inter_node_bandwidth) - copy_seconds(
                result.transfers, cluster.inter_node_bandwidth
            )
            tally["over_3pct_justified"] += slower <= extra + 1e-9
    return tally


def _paper_shrink(model: str, stop: int) -> list[tuple[int, float, float]]:
    """experiment=paper_failure_frequency: 30 nodes losing one node at a time (the lowest id of the
    largest pipeline) down to ``stop``; per node count the reconfigured plan's predicted iteration
    time and a fresh instantiation's on the same nodes."""
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


def section_quality(cases: int) -> None:
    tally = _random_reconfigurations(cases)
    n = tally["cases"]
    print(f"\nreconfiguration quality: {n} seeded random reconfigurations, planner.replan_horizon_steps=100 ({load()})")
    print(
        f"  slower than a fresh plan: {tally['slower']} ({tally['slower'] / n:.1%}); more than 3% slower: "
        f"{tally['over_3pct']}, of which the fresh plan's extra copying over the horizon justifies "
        f"{tally['over_3pct_justified']}; more than 1.5x: {tally['over_1_5x']}; worst {tally['worst']:.3f}x; "
        f"re-planned from scratch: {tally['replanned']}"
    )
    for model in ("gpt3_medium", "gpt2_small"):
        rows = _paper_shrink(model, 15)
        worst = max(rows, key=lambda row: row[1] / row[2])
        print(
            f"  paper_failure_frequency, {model}, 30 -> 15 nodes one at a time: worst reconfigured/fresh "
            f"{worst[1] / worst[2]:.3f} at {worst[0]} nodes"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer", type=Path, help="a checkout of the planner to compare with (see the docstring)")
    parser.add_argument("--only", nargs="+", default=["templates", "plans"], choices=["templates", "plans", "quality"])
    parser.add_argument("--repeats", type=int, default=5, help="instantiation and reconfiguration: best of this many")
    parser.add_argument("--timeout", type=float, default=600.0, help="limit per template case and tree, seconds")
    parser.add_argument("--quality-cases", type=int, default=1000)
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as profiles:
        os.environ["BENCH_PLANNER_PROFILES"] = profiles
        gpt_profiles(Path(profiles))
        trees = {"this": REPO}
        if args.peer:
            trees["peer"] = args.peer.resolve()
        if "templates" in args.only:
            section_templates(trees, args.timeout)
        if "plans" in args.only:
            section_plans(trees, args.repeats)
        if "quality" in args.only:
            section_quality(args.quality_cases)


if __name__ == "__main__":
    main()

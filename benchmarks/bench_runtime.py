"""Runtime benchmarks: recovery breakdown and steady-state throughput against torch's own peers.

    python benchmarks/bench_runtime.py [--only recovery|ddp|pipeline] [--steps 40] [--repeats 3]

1. recovery: gpt3_tiny on 6 local nodes with f=2; nodes SIGKILLed one at a time (detected by
   process exit), joins in between; prints every recovery's breakdown and the medians.
2. ddp: 4 processes, a pure data-parallel plan (4 single-node pipelines holding every layer)
   against torch DistributedDataParallel on the same 4 processes, model, batches, optimizer and
   clipping (gloo).
3. pipeline: one pipeline of 4 stages against torch.distributed.pipelining's Schedule1F1B on the
   same stage split and microbatches (untied embeddings on both sides, since a pipelining stage
   has no tied-weight sync of its own).

Throughput is the median samples/s over the steps after a warm-up, measured the same way on
both sides (time between consecutive step completions); the ratio is ours / theirs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path


WARMUP = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_config(steps: int, **overrides):
    from oobleck.runtime.testing import tiny_config

    cfg = tiny_config(**{"job.steps": steps, "job.global_batch_size": 32, "job.microbatch_size": 2, **overrides})
    cfg.runtime.save_final_params = False
    return cfg


# ---------------------------------------------------------------------------- recovery
def bench_recovery() -> dict:
    from oobleck.elastic.job import launch

    events = [
        {"action": "remove", "step": 10, "count": 1},
        {"action": "remove", "step": 20, "count": 1},
        {"action": "remove", "step": 30, "count": 1},
        {"action": "join", "step": 35, "count": 3},
        {"action": "remove", "step": 45, "count": 1},
        {"action": "remove", "step": 55, "count": 1},
        {"action": "remove", "step": 65, "count": 1},
    ]
    cfg = bench_config(400, **{"cluster.nodes": 6, "job.fault_tolerance": 2, "failures.kind": "explicit", "failures.events": events})
    with tempfile.TemporaryDirectory() as tmp:
        outcome, _ = launch(cfg, tmp, recorder=False)
    failures = [r for r in outcome.recoveries if r["removed"]]
    keys = ("detect_s", "plan_s", "groups_s", "state_copy_s", "first_step_s", "total_s", "bytes_moved")
    print("\nrecoveries (gpt3_tiny, 6 local nodes, f=2, SIGKILL detected by process exit)")
    print("  gen  removed joined  " + "  ".join(f"{k:>12}" for k in keys))
    for r in outcome.recoveries:
        print(f"  {r['generation']:>3}  {str(r['removed']):>7} {str(r['joined']):>6}  " + "  ".join(f"{r[k]:>12}" for k in keys))
    medians = {k: statistics.median(r[k] for r in failures) for k in keys}
    print("  median over failures: " + ", ".join(f"{k}={v:.4g}" for k, v in medians.items()))
    return medians


# ---------------------------------------------------------------------------- ours
def ours(cfg, plan) -> float:
    from oobleck.elastic.job import launch

    with tempfile.TemporaryDirectory() as tmp:
        outcome, _ = launch(cfg, tmp, initial_plan=plan, recorder=False)
    rates = [row["samples_per_s"] for row in outcome.steps[WARMUP:]]
    phases: dict[str, float] = {}
    for per_worker in outcome.phase_seconds.values():
        for name, seconds in per_worker.items():
            phases[name] = phases.get(name, 0.0) + seconds
    total = sum(phases.values()) or 1.0
    print("  where our workers' step time goes: " + ", ".join(f"{k} {v / total:.0%}" for k, v in phases.items()))
    return statistics.median(rates)


def pure_dp_plan(nodes: int, batch: int, micro: int, layers: int):
    from oobleck.runtime.testing import hand_plan, template

    per = batch // micro // nodes
    one = template([(0, layers, 0, 0, 1)])
    return hand_plan([(one, (n,), per) for n in range(nodes)], batch=batch, micro=micro, layers=layers, f=nodes - 1, gpus=1)


def pipeline_plan(splits, batch: int, micro: int, layers: int):
    from oobleck.runtime.testing import hand_plan, template

    tmpl = template([(a, b, i, 0, 1) for i, (a, b) in enumerate(splits)])
    return hand_plan([(tmpl, tuple(range(len(splits))), batch // micro)], batch=batch, micro=micro, layers=layers, f=0, gpus=1)


# ---------------------------------------------------------------------------- theirs
def peer_worker(kind: str, rank: int, world: int, port: int, cfg_path: str, splits_json: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from oobleck.config import from_container
    from oobleck.data import GlobalBatchSampler, build_dataset, collate
    from oobleck.models import build_layers, build_reference_model, loss_fn
    from oobleck.runtime.state import learning_rate

    cfg = from_container(json.loads(Path(cfg_path).read_text()))
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    job, model_cfg = cfg.job, cfg.model
    B, b = int(job.global_batch_size), int(job.microbatch_size)
    dataset = build_dataset(job, model_cfg)
    sampler = GlobalBatchSampler(len(dataset), B, int(job.seed))
    times = []
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(build_reference_model(model_cfg, int(job.seed)))
        params = list(model.parameters())
        share = B // world

        def step(s: int) -> None:
            indices = sampler.step_indices(s)[rank * share : (rank + 1) * share]
            chunks = [indices[i : i + b] for i in range(0, share, b)]
            for j, chunk in enumerate(chunks):
                x, y = collate(dataset, chunk)
                with model.no_sync() if j < len(chunks) - 1 else nullcontext():
                    (loss_fn(model(x), y) / B).backward()

    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        splits = json.loads(splits_json)
        a, c = splits[rank]
        module = nn.Sequential(*build_layers(model_cfg, int(job.seed), range(a, c)))
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=B // b, loss_fn=lambda out, tgt: loss_fn(out, tgt) / B)
        params = list(module.parameters())

        def step(s: int) -> None:
            x, y = collate(dataset, sampler.step_indices(s))
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()

    optimizer = torch.optim.AdamW(params, lr=float(job.lr), betas=(float(job.beta1), float(job.beta2)), weight_decay=float(job.weight_decay))
    last = time.perf_counter()
    for s in range(int(job.steps)):
        step(s)
        # global-norm clipping over the whole model, as the runtime does
        sq = torch.zeros(1, dtype=torch.float64)
        for p in params:
            if p.grad is not None:
                sq += p.grad.double().pow(2).sum()
        if kind != "ddp":
            dist.all_reduce(sq)
        coefficient = min(1.0, float(job.grad_clip) / (float(sq.sqrt()) + 1e-6))
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coefficient)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(job, s)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()  # a step ends when every rank is done (as our commit does)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def theirs(kind: str, cfg, world: int, splits=None) -> float:
    from oobleck.config import to_container

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, out = os.path.join(tmp, "cfg.json"), os.path.join(tmp, "times.json")
        Path(cfg_path).write_text(json.dumps(to_container(cfg)))
        procs = [
            subprocess.Popen([sys.executable, __file__, "--peer", kind, str(r), str(world), str(port), cfg_path, json.dumps(splits or []), out])
            for r in range(world)
        ]
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise RuntimeError(f"{kind} peer failed")
        times = json.loads(Path(out).read_text())
    B = int(cfg.job.global_batch_size)
    return statistics.median(B / t for t in times[WARMUP:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("recovery", "ddp", "pipeline"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each side")
    parser.add_argument("--peer", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        kind, rank, world, port, cfg_path, splits, out = args.peer
        peer_worker(kind, int(rank), int(world), int(port), cfg_path, splits, out)
        return
    results = {}
    if args.only in (None, "recovery"):
        results["recovery"] = bench_recovery()
    # On a shared machine the load drifts: alternate the two sides and compare medians.
    if args.only in (None, "ddp"):
        cfg = bench_config(args.steps, **{"cluster.nodes": 4, "job.fault_tolerance": 3})
        pairs = [(ours(cfg, pure_dp_plan(4, 32, 2, 6)), theirs("ddp", cfg, 4)) for _ in range(args.repeats)]
        mine, peer = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        results["ddp"] = {"ours": mine, "ddp": peer, "ratio": mine / peer, "pairs": pairs}
        print(f"\npure data parallel, 4 processes: ours {mine:.1f} samples/s, DDP {peer:.1f} samples/s, ratio {mine / peer:.3f}")
    if args.only in (None, "pipeline"):
        splits = [(0, 2), (2, 3), (3, 4), (4, 6)]
        cfg = bench_config(args.steps, **{"cluster.nodes": 4, "job.fault_tolerance": 0, "model.tie_embeddings": False})
        pairs = [(ours(cfg, pipeline_plan(splits, 32, 2, 6)), theirs("pipeline", cfg, 4, splits)) for _ in range(args.repeats)]
        mine, peer = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        results["pipeline"] = {"ours": mine, "schedule_1f1b": peer, "ratio": mine / peer, "pairs": pairs}
        print(f"one 4-stage pipeline: ours {mine:.1f} samples/s, Schedule1F1B {peer:.1f} samples/s, ratio {mine / peer:.3f}")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

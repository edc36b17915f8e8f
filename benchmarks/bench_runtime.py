"""Runtime benchmarks: throughput against torch's own peers, recovery, state copies, scale.

    python benchmarks/bench_runtime.py [--only SECTION ...] [--steps 40] [--repeats 3]

Every figure is a ratio against a peer measured in the same run (sides alternated, medians
compared), because on a shared 2-core machine the load drifts from minute to minute:

1. ``recovery``: gpt3_tiny on 6 local nodes with f=2; nodes SIGKILLed one at a time (detected by
   process exit), joins in between; every recovery's breakdown and the medians.
2. ``ddp``: 4 processes (``--ddp-nodes``), a pure data-parallel plan (single-node pipelines holding every layer),
   ours (gradient buckets all-reduced during the backward pass) and ours with the reduction after
   the backward pass (``runtime.overlap_grad_reduce=false``: what overlapping the reduction saves) against
   torch DistributedDataParallel on the same processes, model, batches, optimizer, clipping and
   bucket size (``--bucket-mb``: both sides' bucket cap; gloo).
3. ``pipeline``: one pipeline of 4 stages against torch.distributed.pipelining's Schedule1F1B on
   the same stage split and microbatches (untied embeddings on both sides, since a pipelining
   stage has no tied-weight sync of its own).
4. ``hetero``: 5 nodes as pipelines of 2 and 3 nodes (tied embeddings summed across them): the
   overlapped reduction against the reduction after backward.
5. ``transfer``: gpt2_small (``model.seq_len=64``: the parameters are those of gpt2_small, the
   compute per step is small) on 6 nodes, the planner's 3 pipelines of 2 stages, f=2; node 5
   (pipeline 2's second stage) is SIGKILLed after 2 committed steps, so the survivor of its
   pipeline takes the second stage's layers from the other pipelines' holders of them
   (``bytes_moved``: 353 MB of parameters and AdamW state when last measured). Run with
   ``planner.transfer_sources=1`` and ``=2`` (one source, or the chunks of each layer split over
   two), and with one source and ``runtime.prefault_copies=false`` (the receive buffers
   allocated as the copy starts, not ahead while the groups are created); then both of those
   again without link probes, end to end (the probes run between the groups and the copy, so
   they give the preparation time to finish that a real run does not); ``runtime.link_probe_mb`` times a raw gloo send/recv on the same channels between the
   same processes just before the copy, the peer of the copy's bytes per second, into memory
   already touched and into fresh memory (as the copy lands); ``receiver_copy_s`` is the
   receiver's own copy time (the split's figure). With ``--link-mbit M`` (root, tc): one source
   against two with every node's sending link capped at M Mbit/s (``capped_links``: each node's
   workers on an address of their own, ``cluster.node_address_base``, one HTB class per address
   on loopback), where the links, not the receiver's CPU, bound the copy.
6. ``scale``: gpt3_tiny on 4, 8 and 12 nodes (the planner's plan, f=1, one node SIGKILLed
   midway): steady samples/s, the recovery's breakdown, and the CPU seconds per committed step of
   this process's threads: the controller's loop (main thread) and the TCPStore server that every
   worker's traffic goes through (``pt_tcpstore_uv``), over the whole run and over the steady
   window alone (from the commit of step 5 to that of the step before the kill: no start-up,
   recovery or shutdown).
7. ``startup``: gpt3_tiny on 4 and 8 local nodes, seconds from ``launch()`` to the first committed
   step, with workers forked by the run's fork server (``cluster.fork_workers=true``, the local
   default: torch imported once per run) against exec'd ones (``false``: a fresh
   ``python -m oobleck.runtime.worker`` per node, as on Slurm), alternated.

Throughput is the median samples/s over the steps after a warm-up, measured the same way on both
sides (time between consecutive step completions). The load average is printed with each section.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

# The test helpers (testing/) come from the checkout, which `python benchmarks/<name>.py` does not
# put on sys.path by itself.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WARMUP = 5
RECOVERY_KEYS = ("detect_s", "plan_s", "groups_s", "state_copy_s", "first_step_s", "total_s", "bytes_moved")
SECTIONS = ("recovery", "ddp", "pipeline", "hetero", "transfer", "scale", "startup")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def bench_config(steps: int, *groups: str, **overrides):
    from testing import tiny_config

    cfg = tiny_config(
        *groups, **{"job.steps": steps, "job.global_batch_size": 32, "job.microbatch_size": 2, **overrides}
    )
    cfg.runtime.save_final_params = False
    return cfg


def run_job(cfg, plan=None, on_start=None):
    from oobleck.elastic.job import launch

    with tempfile.TemporaryDirectory() as tmp:
        outcome, _ = launch(cfg, tmp, initial_plan=plan, recorder=False, on_start=on_start)
    return outcome


def print_recoveries(title: str, recoveries: list[dict], extra: tuple[str, ...] = ()) -> None:
    keys = RECOVERY_KEYS + extra
    print(f"\n{title}")
    print("  gen  removed joined  " + "  ".join(f"{k:>14}" for k in keys))
    for r in recoveries:
        print(
            f"  {r['generation']:>3}  {str(r['removed']):>7} {str(r['joined']):>6}  "
            + "  ".join(f"{r.get(k, '-'):>14}" for k in keys)
        )


def medians(rows: list[dict], keys) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in keys if all(k in r for r in rows)}


# ---------------------------------------------------------------------------- recovery
def bench_recovery() -> dict:
    events = [
        {"action": "remove", "step": 10, "count": 1},
        {"action": "remove", "step": 20, "count": 1},
        {"action": "remove", "step": 30, "count": 1},
        {"action": "join", "step": 35, "count": 3},
        {"action": "remove", "step": 45, "count": 1},
        {"action": "remove", "step": 55, "count": 1},
        {"action": "remove", "step": 65, "count": 1},
    ]
    cfg = bench_config(
        400, **{"cluster.nodes": 6, "job.fault_tolerance": 2, "failures.kind": "explicit", "failures.events": events}
    )
    outcome = run_job(cfg)
    failures = [r for r in outcome.recoveries if r["removed"]]
    print_recoveries(
        f"recoveries (gpt3_tiny, 6 local nodes, f=2, SIGKILL detected by process exit; {load()})", outcome.recoveries
    )
    result = medians(failures, RECOVERY_KEYS)
    print("  median over failures: " + ", ".join(f"{k}={v:.4g}" for k, v in result.items()))
    return result


# ---------------------------------------------------------------------------- ours
def ours(cfg, plan=None) -> float:
    outcome = run_job(cfg, plan)
    rates = [row["samples_per_s"] for row in outcome.steps[WARMUP:]]
    phases: dict[str, float] = {}
    for per_worker in outcome.phase_seconds.values():
        for name, seconds in per_worker.items():
            phases[name] = phases.get(name, 0.0) + seconds
    total = sum(phases.values()) or 1.0
    overlap = "overlapped" if cfg.runtime.overlap_grad_reduce else "after backward"
    print(
        f"  ours ({overlap}): {statistics.median(rates):.1f} samples/s; step time: "
        + ", ".join(f"{k} {v / total:.0%}" for k, v in phases.items() if v)
    )
    return statistics.median(rates)


def with_overlap(cfg, overlap: bool):
    changed = copy.deepcopy(cfg)
    changed.runtime.overlap_grad_reduce = overlap
    return changed


def pure_dp_plan(nodes: int, batch: int, micro: int, layers: int):
    from testing import hand_plan, template

    per = batch // micro // nodes
    one = template([(0, layers, 0, 0, 1)])
    return hand_plan(
        [(one, (n,), per) for n in range(nodes)], batch=batch, micro=micro, layers=layers, f=nodes - 1, gpus=1
    )


def pipeline_plan(splits, batch: int, micro: int, layers: int):
    from testing import hand_plan, template

    tmpl = template([(a, b, i, 0, 1) for i, (a, b) in enumerate(splits)])
    return hand_plan(
        [(tmpl, tuple(range(len(splits))), batch // micro)], batch=batch, micro=micro, layers=layers, f=0, gpus=1
    )


def hetero_plan(batch: int, micro: int):
    from testing import hand_plan, template

    count = batch // micro
    return hand_plan(
        [
            (template([(0, 3, 0, 0, 1), (3, 6, 1, 0, 1)]), (0, 1), count * 3 // 8),
            (template([(0, 2, 0, 0, 1), (2, 4, 1, 0, 1), (4, 6, 2, 0, 1)]), (2, 3, 4), count - count * 3 // 8),
        ],
        batch=batch,
        micro=micro,
        layers=6,
        f=1,
        gpus=1,
    )


# ---------------------------------------------------------------------------- theirs
def peer_worker(kind: str, rank: int, world: int, port: int, cfg_path: str, splits_json: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from oobleck.config import from_container
    from oobleck.data import GlobalBatchSampler, build_dataset, collate
    from oobleck.layer_state import learning_rate
    from oobleck.models import build_layers, build_reference_model, loss_fn

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
        model = nn.parallel.DistributedDataParallel(
            build_reference_model(model_cfg, int(job.seed)), bucket_cap_mb=float(cfg.runtime.bucket_mb)
        )
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

    optimizer = torch.optim.AdamW(
        params, lr=float(job.lr), betas=(float(job.beta1), float(job.beta2)), weight_decay=float(job.weight_decay)
    )
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
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--peer",
                    kind,
                    str(r),
                    str(world),
                    str(port),
                    cfg_path,
                    json.dumps(splits or []),
                    out,
                ]
            )
            for r in range(world)
        ]
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise RuntimeError(f"{kind} peer failed")
        times = json.loads(Path(out).read_text())
    B = int(cfg.job.global_batch_size)
    rate = statistics.median(B / t for t in times[WARMUP:])
    print(f"  {kind}: {rate:.1f} samples/s")
    return rate


def compare(title: str, sides: dict[str, Callable[[], float]], repeats: int, ratios: list[tuple[str, str]]) -> dict:
    """Run every side ``repeats`` times, alternating; print and return medians and ratios."""
    print(f"\n{title} ({load()})")
    samples: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, run in sides.items():
            samples[name].append(run())
    result: dict[str, Any] = {name: statistics.median(values) for name, values in samples.items()}
    result["samples"] = samples
    for a, b in ratios:
        result[f"{a}/{b}"] = result[a] / result[b]
        pairs = ", ".join(f"{x / y:.3f}" for x, y in zip(samples[a], samples[b]))
        print(
            f"  {a} / {b}: {result[a]:.1f} / {result[b]:.1f} samples/s = {result[a] / result[b]:.3f} (per repeat: {pairs})"
        )
    print(f"  ({load()})")
    return result


# ---------------------------------------------------------------------------- state copies
TRANSFER_NODES = 6
LINK_BASE = "127.0.1.0"  # cluster.node_address_base of the link-capped runs: node n sends from 127.0.1.n


def transfer_config(steps: int, **overrides):
    """The config of the state-copy runs (``bench_transfer``, ``bench_relay``): gpt2_small at a
    short sequence on ``TRANSFER_NODES`` nodes, analytic profile, timeouts long enough for a
    capped link; ``overrides`` add the run's own keys."""
    return bench_config(
        steps,
        "model=gpt2_small",
        **{
            "model.seq_len": 64,
            "job.global_batch_size": 6,
            "job.microbatch_size": 1,
            "job.warmup_steps": 1,
            "cluster.nodes": TRANSFER_NODES,
            "job.fault_tolerance": 2,
            "profile.source": "analytic",
            "cluster.collective_timeout_s": 120.0,
            "cluster.heartbeat_timeout_s": 30.0,
            **overrides,
        },
    )


@contextlib.contextmanager
def capped_links(mbit: float, nodes: int = TRANSFER_NODES):
    """Cap what each local node sends at ``mbit`` Mbit/s, as a NIC would: one HTB class per node's
    source address (``LINK_BASE`` + n) on the loopback device, everything else unshaped. Needs root
    and tc (iproute2); the loopback device must have no qdisc of its own (it is removed after)."""
    import ipaddress
    import shutil

    if os.geteuid() != 0 or shutil.which("tc") is None:
        raise SystemExit("--link-mbit shapes loopback traffic with tc: run as root on a machine with iproute2's tc")
    shown = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], check=True, capture_output=True, text=True).stdout
    if "htb" in shown or "netem" in shown or "tbf" in shown:
        raise SystemExit(f"lo already has a qdisc ({shown.strip()}); remove it first (tc qdisc del dev lo root)")

    def tc(*args: str) -> None:
        subprocess.run(["tc", *args], check=True, capture_output=True, text=True)

    tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "1")
    try:
        tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit", "quantum", "200000")
        for node in range(nodes):
            classid = f"1:{10 + node}"
            source = str(ipaddress.IPv4Address(LINK_BASE) + node)
            tc(
                "class",
                "add",
                "dev",
                "lo",
                "parent",
                "1:",
                "classid",
                classid,
                "htb",
                "rate",
                f"{mbit}mbit",
                "burst",
                "256k",
                "quantum",
                "65536",
            )
            tc(
                "filter",
                "add",
                "dev",
                "lo",
                "parent",
                "1:",
                "protocol",
                "ip",
                "prio",
                "1",
                "u32",
                "match",
                "ip",
                "src",
                f"{source}/32",
                "flowid",
                classid,
            )
        yield
    finally:
        tc("qdisc", "del", "dev", "lo", "root")


def bench_transfer(repeats: int, steps: int = 4, link_mbit: float = 0.0) -> dict:
    """gpt2_small: a recovery that moves a whole stage. With link probes (the raw gloo peer):
    one source with the receive buffers prepared ahead (the default), the same without, and
    split over two sources. Without probes (as a real run): prepared and not, end to end. With
    ``link_mbit``: one source against two with every node's sending link capped (``capped_links``)."""
    variants = {
        "1": (1, True, 256),
        "1_unprepared": (1, False, 256),
        "2": (2, True, 256),
        "1_no_probe": (1, True, 0),
        "1_unprepared_no_probe": (1, False, 0),
    }
    if link_mbit:
        # probes of 64 MB: at 100 MB/s a probe of 256 MB would take longer than the copy
        variants = {"1_capped": (1, True, 64), "2_capped": (2, True, 64)}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (sources, prefault, probe_mb) in variants.items():
            cfg = transfer_config(
                steps,
                **{
                    "planner.transfer_sources": sources,
                    "runtime.prefault_copies": prefault,
                    "runtime.link_probe_mb": probe_mb,
                    "failures.kind": "explicit",
                    "failures.events": [{"action": "remove", "step": 2, "nodes": [5]}],
                    "cluster.node_address_base": LINK_BASE if link_mbit else None,
                },
            )
            with capped_links(link_mbit) if link_mbit else nullcontext():
                outcome = run_job(cfg)
            moved = [r for r in outcome.recoveries if r["bytes_moved"]]
            if not moved:
                raise RuntimeError(f"the gpt2_small recovery moved no layers: {outcome.recoveries}")
            results[name] += moved
            print_recoveries(
                f"gpt2_small, node 5 killed, planner.transfer_sources={sources}, runtime.prefault_copies={prefault},"
                f" runtime.link_probe_mb={probe_mb} ({load()})",
                moved,
                ("receiver_copy_s", "copy_bytes_per_s", "prefault_s", "prefault_wait_s")
                + (("link_probe_bytes_per_s", "link_probe_cold_bytes_per_s") if probe_mb else ()),
            )
    summary: dict[str, Any] = {}
    for name, rows in results.items():
        summary[name] = medians(
            rows, RECOVERY_KEYS + ("receiver_copy_s", "copy_bytes_per_s", "prefault_s", "prefault_wait_s")
        )
        summary[name]["groups_and_copy_s"] = statistics.median(r["groups_s"] + r["receiver_copy_s"] for r in rows)
        rate = summary[name]["copy_bytes_per_s"]
        line = f"  {name}: the receiver's copy {summary[name]['receiver_copy_s']:.3f} s, {rate / 1e6:.0f} MB/s"
        if variants[name][2]:
            link = statistics.median(r["link_probe_bytes_per_s"] for r in rows)
            cold = statistics.median(r["link_probe_cold_bytes_per_s"] for r in rows)
            summary[name].update(
                {
                    "link_bytes_per_s": link,
                    "link_cold_bytes_per_s": cold,
                    "copy/link": rate / link,
                    "copy/link_cold": rate / cold,
                }
            )
            line += (
                f"; raw gloo send/recv per channel {link / 1e6:.0f} MB/s into touched memory (ratio {rate / link:.2f}),"
                f" {cold / 1e6:.0f} MB/s into fresh memory (ratio {rate / cold:.2f})"
            )
        line += f"; buffers prepared in {summary[name]['prefault_s']:.3f} s, of which the copy waited {summary[name]['prefault_wait_s']:.3f} s"
        print(line)
    if link_mbit:
        one, two = summary["1_capped"], summary["2_capped"]
        summary["split_speedup"] = one["receiver_copy_s"] / two["receiver_copy_s"]
        print(
            f"  every node's sending link capped at {link_mbit:g} Mbit/s: the receiver's copy takes {one['receiver_copy_s']:.3f} s"
            f" from one source and {two['receiver_copy_s']:.3f} s split over two ({summary['split_speedup']:.2f}x faster)"
        )
        summary["relay"] = bench_relay(repeats, steps, link_mbit)
        return summary
    one, unprepared, two = summary["1"], summary["1_unprepared"], summary["2"]
    summary["prepare_speedup"] = unprepared["receiver_copy_s"] / one["receiver_copy_s"]
    summary["split_speedup"] = one["receiver_copy_s"] / two["receiver_copy_s"]
    ahead, plain = summary["1_no_probe"], summary["1_unprepared_no_probe"]
    summary["prepare_speedup_end_to_end"] = plain["groups_and_copy_s"] / ahead["groups_and_copy_s"]
    print(
        f"  with probes (which give the preparation time to finish): the copy into prepared buffers takes {one['receiver_copy_s']:.3f} s"
        f" against {unprepared['receiver_copy_s']:.3f} s into buffers allocated as it starts ({summary['prepare_speedup']:.2f}x);"
        f" split over 2 sources {two['receiver_copy_s']:.3f} s ({summary['split_speedup']:.2f}x faster than one)\n"
        f"  end to end without probes (groups + the receiver's copy): {ahead['groups_and_copy_s']:.3f} s prepared ahead against"
        f" {plain['groups_and_copy_s']:.3f} s ({summary['prepare_speedup_end_to_end']:.2f}x)"
    )
    return summary


def bench_relay(repeats: int, steps: int, link_mbit: float) -> dict:
    """A sole holder feeding three new holders, with every node's sending link capped: gpt2_small
    (``model.seq_len=64``) on 6 nodes as three 2-stage pipelines (f=2); nodes 2 and 4 (the first
    stages of pipelines 1 and 2) are SIGKILLed together after 2 committed steps and every survivor
    becomes a 1-node pipeline, so node 0 is the only holder of the first stage's layers, which
    nodes 1, 3 and 5 all need. Relayed (the planner's copies: node 0 sends each chunk once, down a
    chain through the three) against the copies before relays (node 0 sends it to each of them),
    alternated; the copy ends when the last receiver has its layers (``receiver_copy_s``). The
    cost model's figure for each (``copy_seconds``, at the capped link's rate) is printed beside."""
    from oobleck.models import num_layers
    from oobleck.planning.pipeline_cost import copy_seconds
    from oobleck.planning.reconfigure import plan_transfers
    from oobleck.strategies.oobleck import Oobleck, plan_layout
    from oobleck.strategy import Decision, Kind
    from testing import hand_plan, template

    results: dict[str, list[dict]] = {"direct": [], "relayed": []}
    charged: dict[str, float] = {}
    original = Oobleck.on_change
    try:
        for _ in range(repeats):
            for name in results:

                def every_node_its_own_pipeline(self, state, relay=name == "relayed"):
                    layers = state.layout.plan.num_layers
                    alive = sorted(set(state.layout.nodes) - set(state.removed))
                    whole = template([(0, layers, 0, 0, 1)])
                    plan = state.layout.plan
                    share, extra = divmod(plan.num_microbatches, len(alive))
                    new = hand_plan(
                        [(whole, (n,), share + (i < extra)) for i, n in enumerate(alive)],
                        batch=plan.global_batch_size,
                        micro=plan.microbatch_size,
                        layers=layers,
                        f=2,
                        gpus=1,
                    )
                    transfers = plan_transfers(plan, new, state.removed, self.context.layer_param_bytes, relay=relay)
                    charged[name] = copy_seconds(transfers, link_mbit * 1e6 / 8)
                    return Decision(Kind.RECONFIGURE, plan_layout(new), transfers=transfers, reason=name)

                Oobleck.on_change = every_node_its_own_pipeline
                cfg = transfer_config(
                    steps,
                    **{
                        "failures.kind": "explicit",
                        "failures.events": [{"action": "remove", "step": 2, "nodes": [2, 4]}],
                        "cluster.node_address_base": LINK_BASE,
                    },
                )
                layers = num_layers(cfg.model)
                half = template([(0, layers // 2, 0, 0, 1), (layers // 2, layers, 1, 0, 1)])
                start = hand_plan(
                    [(half, (0, 1), 2), (half, (2, 3), 2), (half, (4, 5), 2)],
                    batch=6,
                    micro=1,
                    layers=layers,
                    f=2,
                    gpus=1,
                )
                with capped_links(link_mbit):
                    outcome = run_job(cfg, start)
                moved = [r for r in outcome.recoveries if r["bytes_moved"]]
                results[name] += moved
                print_recoveries(
                    f"gpt2_small, nodes 2 and 4 killed, every survivor its own pipeline, {name} copies,"
                    f" links capped at {link_mbit:g} Mbit/s ({load()})",
                    moved,
                    ("receiver_copy_s", "copy_bytes_per_s"),
                )
    finally:
        Oobleck.on_change = original
    summary: dict[str, Any] = {
        name: medians(rows, RECOVERY_KEYS + ("receiver_copy_s",)) for name, rows in results.items()
    }
    direct, relayed = summary["direct"]["receiver_copy_s"], summary["relayed"]["receiver_copy_s"]
    summary["relay_speedup"] = direct / relayed
    summary["charged"] = dict(charged)
    print(
        f"  a sole holder feeding 3 new holders, links capped at {link_mbit:g} Mbit/s: the copy ends after"
        f" {relayed:.2f} s relayed against {direct:.2f} s sent to each ({summary['relay_speedup']:.2f}x faster);"
        f" the cost model charges {charged['relayed']:.2f} s and {charged['direct']:.2f} s"
    )
    return summary


# ---------------------------------------------------------------------------- scale
def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads so far: main (the controller's loop), the TCPStore
    server (``pt_tcpstore_uv``), and the rest (agent connections, the abort and reaper threads)."""
    ticks = os.sysconf("SC_CLK_TCK")
    main = threading.main_thread().native_id
    cpu = {"controller_loop": 0.0, "store_server": 0.0, "other_threads": 0.0}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        kind = (
            "controller_loop"
            if int(task.name) == main
            else "store_server"
            if name.startswith("pt_tcpstore")
            else "other_threads"
        )
        cpu[kind] += seconds
    return cpu


def bench_scale(nodes_list: tuple[int, ...], steps: int) -> dict:
    results = {}
    kill = steps // 2
    print(f"\nscale: gpt3_tiny, global batch 48, f=1, the planner's plan, one node SIGKILLed at step {kill} ({load()})")
    print(
        "  nodes  pipelines  samples/s  recovery_s  groups_s  first_step_s  loop_cpu_ms/step  store_cpu_ms/step  other_cpu_ms/step"
    )
    for nodes in nodes_list:
        cfg = bench_config(
            steps,
            **{
                "cluster.nodes": nodes,
                "job.fault_tolerance": 1,
                "job.global_batch_size": 48,
                "failures.kind": "explicit",
                "failures.events": [{"action": "remove", "step": kill, "nodes": [nodes - 1]}],
            },
        )
        # CPU of this process's threads when steps WARMUP and kill - 1 commit: the steady window,
        # without start-up, the recovery or the shutdown (sampled in the loop, twice per run)
        marks: dict[int, dict[str, float]] = {}

        def watch(controller) -> None:
            def on_step(row: dict) -> None:
                if row["step"] in (WARMUP, kill - 1) and row["step"] not in marks:
                    marks[row["step"]] = thread_cpu()

            controller.on_step = on_step

        before = thread_cpu()
        outcome = run_job(cfg, on_start=watch)
        after = thread_cpu()
        committed = len(outcome.steps) or 1
        per_step = {k: (after[k] - before[k]) / committed * 1e3 for k in before}
        window = kill - 1 - WARMUP
        steady_cpu = {k: (marks[kill - 1][k] - marks[WARMUP][k]) / window * 1e3 for k in before}
        steady = [row["samples_per_s"] for row in outcome.steps[WARMUP:kill]]
        recovery = outcome.recoveries[0] if outcome.recoveries else {}
        row = {
            "pipelines": outcome.steps[0]["pipelines"],
            "samples_per_s": statistics.median(steady),
            "recovery": recovery,
            "cpu_ms_per_step": per_step,
            "steady_cpu_ms_per_step": steady_cpu,
            "steady_step_s": statistics.median(row["step_time_s"] for row in outcome.steps[WARMUP:kill]),
        }
        results[nodes] = row
        print(
            f"  {nodes:>5}  {row['pipelines']:>9}  {row['samples_per_s']:>9.1f}  {recovery.get('total_s', float('nan')):>10.3f}"
            f"  {recovery.get('groups_s', float('nan')):>8.3f}  {recovery.get('first_step_s', float('nan')):>12.3f}"
            f"  {per_step['controller_loop']:>16.2f}  {per_step['store_server']:>17.2f}  {per_step['other_threads']:>17.2f}"
        )
        print(
            f"         steady window (steps {WARMUP}-{kill - 1}): loop {steady_cpu['controller_loop']:.2f}, store {steady_cpu['store_server']:.2f},"
            f" other {steady_cpu['other_threads']:.2f} ms CPU per step of {row['steady_step_s'] * 1e3:.0f} ms"
            f" (loop share {steady_cpu['controller_loop'] / 1e3 / row['steady_step_s']:.1%})"
        )
    print(f"  ({load()})")
    return results


# ---------------------------------------------------------------------------- start-up
def seconds_to_first_step(cfg) -> float:
    """Seconds from ``launch()`` to the controller's first committed step."""
    first: list[float] = []

    def watch(controller) -> None:
        controller.on_step = lambda row: first.append(time.perf_counter()) if not first else None

    started = time.perf_counter()
    run_job(cfg, on_start=watch)
    return first[0] - started


def bench_startup(nodes_list: tuple[int, ...], repeats: int) -> dict:
    print(f"\nstart-up: launch() to the first committed step, gpt3_tiny, forked vs exec'd workers ({load()})")
    result: dict[str, Any] = {}
    for nodes in nodes_list:
        cfg = bench_config(3, **{"cluster.nodes": nodes, "job.fault_tolerance": 1})
        samples: dict[str, list[float]] = {"forked": [], "execd": []}
        for _ in range(repeats):
            for side, fork in (("forked", True), ("execd", False)):
                run = copy.deepcopy(cfg)
                run.cluster.fork_workers = fork
                samples[side].append(seconds_to_first_step(run))
        forked, execd = statistics.median(samples["forked"]), statistics.median(samples["execd"])
        result[nodes] = {"forked_s": forked, "execd_s": execd, "execd/forked": execd / forked, "samples": samples}
        per = ", ".join(f"{e / f:.2f}" for f, e in zip(samples["forked"], samples["execd"]))
        print(
            f"  {nodes:>2} nodes: forked {forked:.2f} s, exec'd {execd:.2f} s: exec'd / forked = {execd / forked:.2f} (per repeat: {per})"
        )
    print(f"  ({load()})")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=SECTIONS, help="sections to run (default: all)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each side")
    parser.add_argument("--ddp-nodes", type=int, default=4, help="processes of the pure data-parallel comparison")
    parser.add_argument("--bucket-mb", type=float, default=0.25, help="gradient bucket cap of both ours and DDP (MiB)")
    parser.add_argument("--transfer-repeats", type=int, default=1)
    parser.add_argument(
        "--link-mbit",
        type=float,
        default=0.0,
        help="transfer: cap every node's sending link at this many Mbit/s (tc on loopback; root) and compare 1 and 2 sources",
    )
    parser.add_argument("--scale-nodes", type=int, nargs="*", default=[4, 8, 12])
    parser.add_argument("--startup-nodes", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--peer", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        kind, rank, world, port, cfg_path, splits, out = args.peer
        peer_worker(kind, int(rank), int(world), int(port), cfg_path, splits, out)
        return
    chosen = set(args.only or SECTIONS)
    results: dict[str, Any] = {}
    if "recovery" in chosen:
        results["recovery"] = bench_recovery()
    if "ddp" in chosen:
        n = args.ddp_nodes
        cfg = bench_config(
            args.steps, **{"cluster.nodes": n, "job.fault_tolerance": n - 1, "runtime.bucket_mb": args.bucket_mb}
        )
        plan = pure_dp_plan(n, 32, 2, 6)
        results["ddp"] = compare(
            f"pure data parallel, {n} processes, buckets of {args.bucket_mb} MiB on both sides",
            {
                "overlapped": lambda: ours(with_overlap(cfg, True), plan),
                "ddp": lambda: theirs("ddp", cfg, n),
                "after_backward": lambda: ours(with_overlap(cfg, False), plan),
            },
            args.repeats,
            [("overlapped", "ddp"), ("after_backward", "ddp"), ("overlapped", "after_backward")],
        )
    if "pipeline" in chosen:
        splits = [(0, 2), (2, 3), (3, 4), (4, 6)]
        cfg = bench_config(
            args.steps,
            **{
                "cluster.nodes": 4,
                "job.fault_tolerance": 0,
                "model.tie_embeddings": False,
                "runtime.bucket_mb": args.bucket_mb,
            },
        )
        plan = pipeline_plan(splits, 32, 2, 6)
        results["pipeline"] = compare(
            "one 4-stage pipeline",
            {"ours": lambda: ours(cfg, plan), "schedule_1f1b": lambda: theirs("pipeline", cfg, 4, splits)},
            args.repeats,
            [("ours", "schedule_1f1b")],
        )
    if "hetero" in chosen:
        cfg = bench_config(
            args.steps, **{"cluster.nodes": 5, "job.fault_tolerance": 1, "runtime.bucket_mb": args.bucket_mb}
        )
        plan = hetero_plan(32, 2)
        results["hetero"] = compare(
            "heterogeneous: pipelines of 2 and 3 nodes (5 processes)",
            {
                "overlapped": lambda: ours(with_overlap(cfg, True), plan),
                "after_backward": lambda: ours(with_overlap(cfg, False), plan),
            },
            args.repeats,
            [("overlapped", "after_backward")],
        )
    if "transfer" in chosen:
        results["transfer"] = bench_transfer(args.transfer_repeats, link_mbit=args.link_mbit)
    if "scale" in chosen:
        results["scale"] = bench_scale(tuple(args.scale_nodes), args.steps)
    if "startup" in chosen:
        results["startup"] = bench_startup(tuple(args.startup_nodes), args.repeats)
    print(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()

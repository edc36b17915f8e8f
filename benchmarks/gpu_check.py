"""The CUDA / NCCL check (issue 17): one command that writes one JSON report, on any CUDA machine.

    python benchmarks/gpu_check.py --out report.json [--quick] [--only UNIT ...] [--budget-s S]

Every unit runs in its own subprocess with its own timeout (and all of them within ``--budget-s``),
so a hang or a crash in one leaves the others' results; the report is rewritten after each unit
and the script exits 0 whenever it was written. Without CUDA each CUDA measurement is an entry
``{"status": "skipped", "reason": ...}`` and what is meaningful on a CPU still runs.

1. ``exactness``: gpt3_tiny trained a few steps through the runtime's executor (one rank, every
   layer) on the GPU with TF32 off, the same model in a plain PyTorch loop on the GPU, and a real
   ``python -m oobleck.run cluster.nodes=1 cluster.device=cuda`` run (metrics.csv losses and
   final_params.pt), each against the CPU single-process reference (``train_reference``). On CPU
   only the executor-on-CPU comparison runs: the reduction-order floor the GPU figures sit above.
   Tolerance (``LOSS_RTOL``, ``UPDATE_RTOL``): GPU fp32 kernels (cuBLAS without TF32, SDPA,
   fused norms) round differently from the CPU ones, ~1e-7..1e-6 relative per op, and AdamW
   (eps=1e-8) normalises every update, so a coordinate's error stays below lr per step. So
   instead of the CPU tests' absolute bound the check compares each layer's *update* (final minus
   initial parameters): ``||final - reference|| / ||reference - initial||``. A real bug moves
   that by O(1): one microbatch of 8 dropped from every step gives 0.22 (and a loss 6.6e-3 off)
   over 4 steps (tests/benchmarks/test_gpu_check.py); the executor on the CPU, where only the
   reduction order differs, gives 1e-6 (loss 2e-8). The GPU's measured values are in the report.
2. ``profile``: the measured profile (``oobleck.profiling.measure_profile``) of gpt2_small and
   gpt3_medium on the GPU, in fp32 (TF32 off, how the harness trains) and under bf16 autocast
   (what the analytic model assumes), beside the analytic profile of ``conf/gpu/h200.yaml``:
   per-layer measured / analytic, and the ``achieved_flop_fraction`` that would make the analytic
   compute time of the compute-bound layers equal the measured one.
3. ``lifecycle``: in one process, 25 times: a generation's groups built by the runtime's
   ``Communicator`` over ``PrefixStore("g<g>", TCPStore)``, collectives, an op left pending, the
   generation aborted through the store key the controller sets (the ``AbortWatch`` thread wakes
   the waiting ``Waiter``), the groups released (NCCL: aborted) and parked in the ``Reaper``, and
   the next generation under a new prefix: time per cycle, abort latency, threads, fds and CUDA
   memory. The pending op: gloo, a receive from an in-process peer that never sends; NCCL (one
   GPU cannot hold two ranks of one communicator), an all-reduce queued behind a GPU spin. On NCCL
   four ways of getting a genuinely pending op with a second rank are tried, each in its own
   process: a peer that never joins (lazy, eager and non-blocking communicator init), and a
   second process on the same GPU.
4. ``throughput``: steady samples/s of gpt3_medium training on the GPU (gpt3_tiny on CPU) through
   the executor against a plain PyTorch loop on the same model, batches and optimizer, alternated
   in the same run; the ratio is executor / plain.

``--quick`` keeps the whole run within about five minutes on an H200 (the budget of a 15-minute
device lease with room for a rerun) and under a minute on a small CPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from oobleck.config import from_container
from oobleck.data import GlobalBatchSampler, build_dataset
from oobleck.elastic.job import check_device
from oobleck.elastic.local import run_processes
from oobleck.errors import RunError
from oobleck.models import build_layers, layer_name, load_model_config, num_layers, tied_parameters
from oobleck.models.spec import model_spec
from oobleck.profiling import analytic_profile, load_gpu_config, measure_profile
from oobleck.profiling.analytic import block_forward_flops, head_forward_flops
from oobleck.runtime import keys
from oobleck.runtime.backend import GlooBackend, NcclBackend
from oobleck.runtime.comm import Aborted, AbortWatch, Communicator, GroupSpec, Reaper, Waiter, run_in_thread
from oobleck.runtime.executor import StepContext, clip_and_step, global_grad_norm, run_schedule, sync_gradients
from oobleck.runtime.reference import train_reference
from oobleck.runtime.state import learning_rate, new_layer_state
from oobleck.runtime.topology import build_topology, group_specs
from oobleck.runtime.worker import resource_probe

# The test helpers (testing/) come from the checkout, which `python benchmarks/gpu_check.py` does
# not put on sys.path by itself.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from testing import hand_plan, template, tiny_config

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20

# Exactness tolerances (see the module doc for why they are these).
LOSS_RTOL = 1e-4
UPDATE_RTOL = 1e-2
# The issue's bound on CUDA memory over the lifecycle cycles.
MEMORY_FLAT_MIB = 256
# What oobleck.runtime.worker sets for cluster.device=cuda (in-process recovery: a communicator
# error must not kill the process); the lifecycle units run the runtime's code the same way.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}


@dataclass(frozen=True)
class Settings:
    """Sizes and timeouts of one run (``QUICK`` or ``FULL``)."""

    quick: bool
    budget_s: float
    exact_steps: int
    run_timeout_s: float  # the python -m oobleck.run subprocess
    profile_microbatch: int
    profile_warmup: int
    profile_repeats: int
    cycles: int
    collective_timeout_s: float  # groups of the lifecycle loop
    spin_s: float  # how long the NCCL op stays queued behind the GPU spin
    abort_after_s: float  # when the "controller" aborts a generation with a pending op
    issue_wait_s: float  # how long an absent-peer experiment lets the op start before aborting
    experiment_wait_s: float  # how long it then waits for abort() and for the blocked thread
    throughput_batch: int
    throughput_microbatch: int
    throughput_warmup: int
    throughput_steps: int
    throughput_rounds: int
    unit_timeout_s: tuple[tuple[str, float], ...]

    def timeout(self, kind: str) -> float:
        return dict(self.unit_timeout_s)[kind]


QUICK = Settings(
    quick=True,
    budget_s=300.0,
    exact_steps=4,
    run_timeout_s=150.0,
    profile_microbatch=1,
    profile_warmup=1,
    profile_repeats=3,
    cycles=25,
    collective_timeout_s=5.0,
    spin_s=0.3,
    abort_after_s=0.05,
    issue_wait_s=1.0,
    experiment_wait_s=5.0,
    throughput_batch=8,
    throughput_microbatch=2,
    throughput_warmup=2,
    throughput_steps=6,
    throughput_rounds=1,
    unit_timeout_s=(
        ("exactness", 200.0),
        ("profile", 120.0),
        ("lifecycle", 90.0),
        ("throughput", 120.0),
        ("experiment", 45.0),
    ),
)
FULL = replace(  # longer and repeated measurements where a run is not squeezed into a lease
    QUICK,
    quick=False,
    budget_s=900.0,
    exact_steps=8,
    run_timeout_s=300.0,
    profile_warmup=2,
    profile_repeats=5,
    spin_s=0.5,
    issue_wait_s=2.0,
    experiment_wait_s=10.0,
    throughput_warmup=3,
    throughput_steps=15,
    throughput_rounds=2,
    unit_timeout_s=(
        ("exactness", 400.0),
        ("profile", 300.0),
        ("lifecycle", 200.0),
        ("throughput", 300.0),
        ("experiment", 90.0),
    ),
)


# ---------------------------------------------------------------------------- shared helpers
def cuda_reason() -> str | None:
    """Why the CUDA parts cannot run here, or None when they can."""
    if torch.cuda.is_available():
        return None
    return f"CUDA is not available here (torch {torch.__version__}, built with CUDA {torch.version.cuda})"


def tf32_off() -> None:
    """fp32 matrix products and convolutions in full fp32 (the harness trains in fp32)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


@contextlib.contextmanager
def local_store() -> Iterator[Any]:
    """A TCPStore server on loopback, standing in for the controller's."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    yield store


# ---------------------------------------------------------------------------- one rank through the executor
class SoloRun:
    """Training through the runtime's executor as one rank: one pipeline of one stage holding every
    layer, the Communicator of a one-rank world (no groups), per-layer AdamW, the runtime's
    clipping and tied-weight handling. What a worker does per step, minus the store's commit."""

    def __init__(self, cfg: Any, device: str, store: Any) -> None:
        job, model = cfg.job, cfg.model
        if int(cfg.cluster.torch_threads) > 0:
            torch.set_num_threads(int(cfg.cluster.torch_threads))  # as the workers do
        layers, batch, micro = num_layers(model), int(job.global_batch_size), int(job.microbatch_size)
        plan = hand_plan(
            [(template([(0, layers, 0, 0, 1)]), (0,), batch // micro)],
            batch=batch,
            micro=micro,
            layers=layers,
            f=0,
            gpus=1,
        )
        tied = tied_parameters(model)
        topology = build_topology(plan, (0, 0), tied[0].layers if tied else ())
        assert topology is not None
        timeout_s = float(cfg.cluster.collective_timeout_s)
        self.store = store
        self.watch = AbortWatch("127.0.0.1", store.port, timeout_s)
        self.watch.watch(0)
        backend = NcclBackend(device=device) if device.startswith("cuda") else GlooBackend()
        waiter = Waiter(self.watch, timeout_s, float(cfg.cluster.heartbeat_timeout_s), backend)
        self.comm = Communicator(
            0,
            topology.rank,
            group_specs(topology),
            host="127.0.0.1",
            port=store.port,
            timeout_s=timeout_s,
            waiter=waiter,
        )
        self.comm.build()
        dataset = build_dataset(job, model)
        self.job = job
        self.ctx = StepContext(
            topology=topology,
            comm=self.comm,
            layers={i: new_layer_state(model, job, i, int(job.seed), device, 0) for i in topology.assignment.layers},
            dataset=dataset,
            sampler=GlobalBatchSampler(len(dataset), batch, int(job.seed)),
            spec=model_spec(model, int(job.seed)),
            global_batch_size=batch,
            device=device,
            bucket_bytes=int(float(cfg.runtime.bucket_mb) * MIB),
        )

    def step(self, step: int) -> float:
        """One training step; returns the mean loss over the global batch (as metrics.csv has it)."""
        for layer in self.ctx.layers.values():
            layer.zero_grad()
        loss = run_schedule(self.ctx, step)
        sync_gradients(self.ctx)
        norm = global_grad_norm(self.ctx)
        clip_and_step(self.ctx, norm, float(self.job.grad_clip), learning_rate(self.job, step))
        return loss / self.ctx.global_batch_size

    def state(self) -> dict[int, dict[str, Any]]:
        return {
            i: {k: v.detach().to("cpu", copy=True) for k, v in layer.module.state_dict().items()}
            for i, layer in self.ctx.layers.items()
        }

    def close(self) -> None:
        self.ctx.close()
        self.comm.release()
        self.store.set(keys.abort(0), "1")  # ends the watcher thread
        self.watch.aborted.wait(5.0)


@dataclass
class Trained:
    losses: list[float]
    step_ends: list[float]  # time.perf_counter() after each step
    state: dict[int, dict[str, Any]]


def train_solo(cfg: Any, device: str, steps: int, *, with_state: bool = True) -> Trained:
    with local_store() as store:
        run = SoloRun(cfg, device, store)
        try:
            losses, ends = [], []
            for step in range(steps):
                losses.append(run.step(step))
                ends.append(time.perf_counter())
            return Trained(losses, ends, run.state() if with_state else {})
        finally:
            run.close()


def initial_state(cfg: Any) -> dict[int, dict[str, Any]]:
    layers = build_layers(cfg.model, int(cfg.job.seed), range(num_layers(cfg.model)))
    return {i: {k: v.detach() for k, v in layer.state_dict().items()} for i, layer in enumerate(layers)}


def differences(
    losses: list[float], state: dict[int, dict[str, Any]], reference: Any, initial: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """How far a run is from the reference: per-step loss, parameters, and each layer's update."""
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, reference.losses, strict=True))
    param_abs, update_rel, worst_layer = 0.0, 0.0, None
    for layer, expected in reference.layers.items():
        diff_sq = update_sq = 0.0
        for name, value in expected.items():
            mine = state[layer][name].double()
            delta = mine - value.double()
            param_abs = max(param_abs, float(delta.abs().max()))
            diff_sq += float(delta.pow(2).sum())
            update_sq += float((value.double() - initial[layer][name].double()).pow(2).sum())
        relative = math.sqrt(diff_sq) / math.sqrt(update_sq) if update_sq > 0 else (0.0 if diff_sq == 0 else math.inf)
        if relative >= update_rel:
            update_rel, worst_layer = relative, layer
    return {
        "loss_max_rel_diff": loss_rel,
        "param_max_abs_diff": param_abs,
        "update_max_rel_diff": update_rel,
        "worst_layer": worst_layer,
        "within_tolerance": loss_rel <= LOSS_RTOL and update_rel <= UPDATE_RTOL,
    }


# ---------------------------------------------------------------------------- 1. exactness
def unit_exactness(s: Settings) -> dict[str, Any]:
    cfg = tiny_config(**{"job.steps": s.exact_steps})
    reference = train_reference(cfg)
    initial = initial_state(cfg)
    cpu = train_solo(cfg, "cpu", s.exact_steps)
    result: dict[str, Any] = {
        "model": str(cfg.model.name),
        "steps": s.exact_steps,
        "tolerance": {"loss_rtol": LOSS_RTOL, "update_rtol": UPDATE_RTOL},
        "cpu_executor": differences(cpu.losses, cpu.state, reference, initial),
    }
    reason = cuda_reason()
    if reason:
        return {"status": "skipped", "reason": reason, **result}
    tf32_off()
    gpu = train_solo(cfg, "cuda", s.exact_steps)
    result["cuda_executor"] = differences(gpu.losses, gpu.state, reference, initial)
    plain = train_reference(cfg, device="cuda")
    result["cuda_plain_loop"] = differences(plain.losses, plain.layers, reference, initial)
    result["oobleck_run"] = oobleck_run_check(s, "cuda")
    result["check_device"] = check_device_refuses_local_nodes()
    checks = [result[k]["within_tolerance"] for k in ("cuda_executor", "cuda_plain_loop")]
    checks.append(result["oobleck_run"].get("within_tolerance", False))
    result["passed"] = all(checks)
    return {"status": "ok", **result}


def oobleck_run_check(s: Settings, device: str) -> dict[str, Any]:
    """A real run: controller, one agent, one worker on ``device``; its outputs against the
    reference of its own resolved config."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        run_id = uuid.uuid4().hex[:12]
        overrides = [
            "model=gpt3_tiny",
            "cluster.nodes=1",
            f"cluster.device={device}",
            "job.fault_tolerance=0",
            "failures=none",
            f"job.steps={s.exact_steps}",
            "job.global_batch_size=16",
            "job.microbatch_size=2",
            "job.warmup_steps=2",
            "logger.wandb.mode=disabled",
            "logger.progress_bar=false",
            "runtime.save_final_params=true",
            f"profile.cache_dir={tmp}/profiles",
            f"hydra.run.dir={run_dir}",
        ]
        # The workers are the run's grandchildren: TF32 goes off for them through the environment.
        env = dict(os.environ, OOBLECK_RUN_ID=run_id, WANDB_SILENT="true", NVIDIA_TF32_OVERRIDE="0")
        command = [sys.executable, "-m", "oobleck.run", *overrides]
        started = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=s.run_timeout_s)
        except subprocess.TimeoutExpired as expired:
            kill_strays(run_processes(run_id))
            return {
                "status": "timeout",
                "reason": f"python -m oobleck.run did not finish within {s.run_timeout_s} s",
                "log_tail": tail(expired.stderr),
            }
        wall_s = time.perf_counter() - started
        strays = run_processes(run_id)
        kill_strays(strays)
        if done.returncode != 0:
            return {
                "status": "failed",
                "reason": f"python -m oobleck.run exited with {done.returncode}",
                "log_tail": tail(done.stderr),
                "command": command,
            }
        cfg = from_container(OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "config.yaml"), resolve=True))
        with open(run_dir / "metrics.csv", newline="") as handle:
            rows = sorted(csv.DictReader(handle), key=lambda row: int(row["step"]))
        losses = [float(row["loss"]) for row in rows]
        final = torch.load(run_dir / "final_params.pt", weights_only=True)
        summary = json.loads((run_dir / "summary.json").read_text())
        result = differences(losses, {int(k): v for k, v in final.items()}, train_reference(cfg), initial_state(cfg))
        return {
            "status": "ok",
            "command": " ".join(command[1:]),
            "wall_s": wall_s,
            "steps": [int(row["step"]) for row in rows],
            "strays_left": len(strays),
            "summary": {k: summary.get(k) for k in ("steps", "throughput", "consecutive_steps")},
            **result,
        }


def check_device_refuses_local_nodes() -> dict[str, Any]:
    try:
        check_device(tiny_config(**{"cluster.device": "cuda", "cluster.nodes": 2}))
    except RunError as error:
        return {"refused": True, "message": str(error)}
    return {"refused": False}


def kill_strays(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def tail(text: Any, lines: int = 30) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])


# ---------------------------------------------------------------------------- 2. profile
PRECISIONS = ("fp32", "bf16_autocast")
PROFILED_MODELS = ("gpt2_small", "gpt3_medium")
TFLOP = 1e12


def layer_forward_flops(model_cfg: Any, microbatch: int, index: int) -> float | None:
    """The analytic model's forward FLOPs of a layer; None for the (memory-bound) embedding."""
    name = layer_name(model_cfg, index)
    if name == "embedding":
        return None
    return head_forward_flops(model_cfg, microbatch) if name == "head" else block_forward_flops(model_cfg, microbatch)


def compare_profiles(model_cfg: Any, gpu_cfg: Any, measured: Any, analytic: Any) -> dict[str, Any]:
    """Per-layer measured / analytic, and the achieved_flop_fraction the measurement implies.

    A layer the analytic model finds compute-bound takes ``3F / (peak * fraction)`` for forward
    plus backward (backward = 2x forward), so the fraction that reproduces a measured time ``t``
    is ``3F / (peak * t)``; over several layers, ``sum 3F / (peak * sum t)``.
    """
    peak = float(gpu_cfg.peak_tflops) * TFLOP
    fraction = float(gpu_cfg.achieved_flop_fraction)
    rows, work, seconds = [], 0.0, 0.0
    for index, (m, a) in enumerate(zip(measured.layers, analytic.layers, strict=True)):
        flops = layer_forward_flops(model_cfg, measured.microbatch_size, index)
        compute_bound = flops is not None and math.isclose(a.forward_s, flops / (peak * fraction), rel_tol=1e-9)
        measured_s, analytic_s = m.forward_s + m.backward_s, a.forward_s + a.backward_s
        row = {
            "layer": m.name,
            "measured_fwd_s": m.forward_s,
            "measured_bwd_s": m.backward_s,
            "analytic_fwd_s": a.forward_s,
            "analytic_bwd_s": a.backward_s,
            "ratio": measured_s / analytic_s,
            "ratio_fwd": m.forward_s / a.forward_s,
            "ratio_bwd": m.backward_s / a.backward_s,
            "analytic_bound": "compute"
            if compute_bound
            else ("memory" if flops is not None else "not fitted (embedding)"),
            "implied_flop_fraction": 3 * flops / (peak * measured_s) if compute_bound and flops else None,
        }
        if compute_bound and flops:
            work, seconds = work + 3 * flops, seconds + measured_s
        rows.append(row)
    blocks = [r for r in rows if r["layer"].startswith("block")]
    block_fractions = [r["implied_flop_fraction"] for r in blocks if r["implied_flop_fraction"] is not None]
    return {
        "layers": rows,
        "total_ratio": sum(m.forward_s + m.backward_s for m in measured.layers)
        / sum(a.forward_s + a.backward_s for a in analytic.layers),
        "block_ratio_median": statistics.median(r["ratio"] for r in blocks) if blocks else None,
        "implied_flop_fraction_blocks_median": statistics.median(block_fractions) if block_fractions else None,
        "implied_flop_fraction": work / (peak * seconds) if seconds else None,
        "configured_flop_fraction": fraction,
    }


@contextlib.contextmanager
def precision(name: str) -> Iterator[None]:
    tf32_off()
    if name == "bf16_autocast":
        with torch.autocast("cuda", dtype=torch.bfloat16):
            yield
    else:
        yield


def unit_profile(s: Settings) -> dict[str, Any]:
    reason = cuda_reason()
    if reason:
        return {"status": "skipped", "reason": reason}
    gpu_cfg = load_gpu_config("h200")
    b = s.profile_microbatch
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "analytic": "conf/gpu/h200.yaml",
        "peak_tflops": float(gpu_cfg.peak_tflops),
        "microbatch_size": b,
        "warmup": s.profile_warmup,
        "repeats": s.profile_repeats,
        "models": {},
    }
    for name in PROFILED_MODELS:
        model_cfg = load_model_config(name)
        analytic = analytic_profile(model_cfg, gpu_cfg, b)
        entry = {}
        for kind in PRECISIONS:
            with precision(kind):
                measured = measure_profile(
                    model_cfg, b, "cuda", warmup=s.profile_warmup, repeats=s.profile_repeats, seed=0
                )
            entry[kind] = {
                "profiling_s": measured.metadata["profiling_seconds"],
                **compare_profiles(model_cfg, gpu_cfg, measured, analytic),
            }
            free_device_memory(True)
        result["models"][name] = entry
    result["implied_flop_fraction"] = {
        f"{name}/{kind}": result["models"][name][kind]["implied_flop_fraction"]
        for name in PROFILED_MODELS
        for kind in PRECISIONS
    }
    return {"status": "ok", **result}


# ---------------------------------------------------------------------------- 3. lifecycle
def process_resources() -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        free, total = torch.cuda.mem_get_info()
        extra = {"cuda_reserved_mib": torch.cuda.memory_reserved() / MIB, "cuda_used_mib": (total - free) / MIB}
    return resource_probe(extra)


def spin_cycles(seconds: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``seconds`` (calibrated here)."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * seconds * 1000.0 / max(start.elapsed_time(end), 1e-3))


class Lifecycle:
    """Generations of the runtime's Communicator in one process, each aborted with an op pending."""

    def __init__(self, s: Settings, store: Any, cuda: bool) -> None:
        self.s, self.store, self.cuda = s, store, cuda
        self.device = "cuda" if cuda else "cpu"
        self.gloo_device = None if cuda else dist.ProcessGroupGloo.create_default_device()
        timeout = s.collective_timeout_s
        self.watch = AbortWatch("127.0.0.1", store.port, timeout)
        backend = NcclBackend(device="cuda") if cuda else GlooBackend(self.gloo_device)
        self.waiter = Waiter(self.watch, timeout, peer_grace_s=1.0, backend=backend)
        self.reaper = Reaper(delay_s=timeout + 1.0)
        # NCCL: one rank per GPU, so a one-rank group; gloo: plus a pair with an in-process peer.
        self.specs = [GroupSpec("solo", (0,))] + ([] if cuda else [GroupSpec("pair", (0, 1))])
        self.spin = spin_cycles(s.spin_s) if cuda else 0
        self.tensor = lambda value: torch.full((1024,), float(value), device=self.device)

    def communicator(self, generation: int, rank: int) -> Any:
        return Communicator(
            generation,
            rank,
            self.specs,
            host="127.0.0.1",
            port=self.store.port,
            timeout_s=self.s.collective_timeout_s,
            waiter=self.waiter,
        )

    def cycle(self, generation: int) -> dict[str, Any]:
        started = time.perf_counter()
        self.watch.watch(generation)
        comm = self.communicator(generation, 0)
        peer = None if self.cuda else self.communicator(generation, 1)
        peer_built = run_in_thread(peer.build, "peer-build") if peer is not None else None
        comm.build()
        if peer_built is not None:
            peer_built.result(timeout=self.s.collective_timeout_s)
        built = time.perf_counter()
        x = self.tensor(3)
        comm.allreduce_wait("solo", x, "all-reducing on the one-rank group")
        y = self.tensor(generation)
        self.waiter.work(comm.broadcast("solo", y, 0), "broadcasting on the one-rank group")
        correct = bool(torch.equal(x, self.tensor(3)) and torch.equal(y, self.tensor(generation)))
        if peer is not None:
            mine, theirs = self.tensor(1), self.tensor(2)
            works = [comm.allreduce("pair", mine), peer.allreduce("pair", theirs)]
            for work in works:
                self.waiter.work(work, "all-reducing on the pair")
            correct = correct and bool(torch.equal(mine, self.tensor(3)) and torch.equal(theirs, self.tensor(3)))
        collectives = time.perf_counter()
        # An op that cannot complete before the abort.
        if self.cuda:
            torch.cuda._sleep(self.spin)
            pending = comm.allreduce("solo", self.tensor(1))
        else:
            pending = comm.broadcast("pair", self.tensor(0), 1)  # the peer never sends
        was_pending = not pending.is_completed()
        abort_at: list[float] = []

        def abort() -> None:
            abort_at.append(time.perf_counter())
            self.store.set(keys.abort(generation), "1")

        threading.Timer(self.s.abort_after_s, abort).start()
        try:
            self.waiter.work(pending, "the pending op")
            outcome = "completed" if pending.is_completed() else "returned_while_pending"
        except Aborted:
            outcome = "aborted"
        woke = time.perf_counter()
        if peer is not None:
            self.reaper.park(peer.release(), [])
        self.reaper.park(comm.release(), [pending])
        released = time.perf_counter()
        if self.cuda:
            torch.cuda.synchronize()  # the spin ends; nothing of the aborted generation may hang
        return {
            "generation": generation,
            "correct": correct,
            "was_pending": was_pending,
            "outcome": outcome,
            "abort_latency_s": woke - abort_at[0] if abort_at else None,
            "build_s": built - started,
            "collectives_s": collectives - built,
            "release_s": released - woke,
            "cycle_s": time.perf_counter() - started,
            "parked": self.reaper.parked(),
            **process_resources(),
        }

    def drain(self) -> None:
        """Wait for the reaper to drop every parked group, then let their threads end."""
        deadline = time.monotonic() + self.reaper.delay_s + 3.0
        while self.reaper.parked() and time.monotonic() < deadline:
            time.sleep(0.1)
        gc.collect()
        time.sleep(0.5)


def growth(before: dict[str, Any], after: dict[str, Any], samples: list[dict[str, Any]], key: str) -> dict[str, Any]:
    values = [sample[key] for sample in samples if key in sample]
    return {
        "baseline": before.get(key),
        "final": after.get(key),
        "growth": after.get(key, 0) - before.get(key, 0),
        **spread(values),
    }


def unit_lifecycle_loop(s: Settings) -> dict[str, Any]:
    cuda = cuda_reason() is None
    with local_store() as store:
        life = Lifecycle(s, store, cuda)
        life.cycle(0)  # one-time initialisations (CUDA context, NCCL, gloo device) before the baseline
        life.drain()
        before = process_resources()
        samples = [life.cycle(g) for g in range(1, s.cycles + 1)]
        life.drain()
        after = process_resources()
    outcomes: dict[str, int] = {}
    for sample in samples:
        outcomes[sample["outcome"]] = outcomes.get(sample["outcome"], 0) + 1
    result: dict[str, Any] = {
        "backend": "nccl" if cuda else "gloo",
        "cycles": s.cycles,
        "pending_op": f"all-reduce queued behind a {s.spin_s} s GPU spin"
        if cuda
        else "receive from an in-process peer that never sends",
        "outcomes": outcomes,
        "cycle_s": spread([x["cycle_s"] for x in samples]),
        "build_s": spread([x["build_s"] for x in samples]),
        "abort_latency_s": spread([x["abort_latency_s"] for x in samples if x["abort_latency_s"] is not None]),
        "release_s": spread([x["release_s"] for x in samples]),
        "threads": growth(before, after, samples, "threads"),
        "fds": growth(before, after, samples, "fds"),
        "rss_kb": growth(before, after, samples, "rss_kb"),
        "parked_after_drain": life.reaper.parked(),
    }
    checks = {
        "collectives_correct": all(x["correct"] for x in samples),
        "op_was_pending_at_abort": all(x["was_pending"] for x in samples),
        "every_abort_woke_the_waiter": outcomes.get("aborted", 0) == s.cycles,
        "no_thread_growth": result["threads"]["growth"] <= 0,
        "no_fd_growth": result["fds"]["growth"] <= 0,
    }
    if cuda:
        for key in ("cuda_reserved_mib", "cuda_used_mib"):
            result[key] = growth(before, after, samples, key)
            span = result[key]["max"] - result[key]["min"]
            result[key]["span"] = span
            checks[f"{key.removesuffix('_mib')}_flat_within_{MEMORY_FLAT_MIB}_mib"] = (
                span <= MEMORY_FLAT_MIB and result[key]["growth"] <= MEMORY_FLAT_MIB
            )
    result["checks"] = checks
    result["passed"] = all(checks.values())
    result["samples"] = samples
    return {"status": "ok", **result}


def unit_absent_peer(s: Settings, init: str) -> dict[str, Any]:
    """A two-rank NCCL group whose second rank never joins: is the op pending, does ``abort()`` from
    another thread return, and does it release the thread blocked in the op?

    ``init``: ``lazy`` (the communicator is made by the first collective, blocking), ``eager``
    (``eager_connect_single_device`` first), ``nonblocking`` (``options.config.blocking = 0``).
    """
    with local_store() as store:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=s.collective_timeout_s)
        if init == "nonblocking":
            options.config.blocking = 0
            os.environ["TORCH_NCCL_USE_COMM_NONBLOCKING"] = "1"  # torch's own switch, read by the group
        group = dist.ProcessGroupNCCL(dist.PrefixStore("absent", store), 0, 2, options)
        tensor = torch.ones(1024, device="cuda")
        box: dict[str, Any] = {}
        returned = threading.Event()

        def issue() -> None:
            try:
                if init == "eager":
                    group.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
                    box["connected"] = True
                box["work"] = group.allreduce([tensor])
            except Exception as error:  # what the blocked call ended with, if it ended
                box["error"] = f"{type(error).__name__}: {error}"[:2000]
            finally:
                returned.set()

        started = time.perf_counter()
        threading.Thread(target=issue, daemon=True, name="issue").start()
        returned_before_abort = returned.wait(s.issue_wait_s)
        work = box.get("work")
        pending = work is not None and not work.is_completed()
        aborted = threading.Event()
        abort_started = time.perf_counter()

        def abort() -> None:
            try:
                group.abort()
                box["abort"] = "returned"
            except Exception as error:
                box["abort"] = f"{type(error).__name__}: {error}"[:2000]
            aborted.set()

        threading.Thread(target=abort, daemon=True, name="abort").start()
        abort_returned = aborted.wait(s.experiment_wait_s)
        abort_s = time.perf_counter() - abort_started
        released = returned.wait(s.experiment_wait_s)
        result = {
            "init": init,
            "config_blocking": int(options.config.blocking),
            "issue_returned_before_abort": returned_before_abort,
            "op_pending_before_abort": pending,
            "abort_returned": abort_returned,
            "abort_s": abort_s if abort_returned else None,
            "abort_result": box.get("abort"),
            "blocked_thread_released": released,
            "issue_error": box.get("error"),
            "wall_s": time.perf_counter() - started,
        }
        if work is not None and released:
            result["work_completed_after_abort"] = bool(work.is_completed())
            try:
                work.wait()
                result["work_wait"] = "returned"
            except Exception as error:
                result["work_wait"] = f"{type(error).__name__}: {error}"[:2000]
    works = released and abort_returned and (pending or not returned_before_abort)
    return {"status": "ok", "genuinely_pending_and_abortable": works, **result}


def unit_second_process(s: Settings) -> dict[str, Any]:
    """Two processes, ranks 0 and 1 of one NCCL group, both on cuda:0: does NCCL allow it?"""
    with local_store() as store:
        command = [
            sys.executable,
            __file__,
            "--nccl-rank",
            "{rank}",
            "--store-port",
            str(store.port),
            "--timeout-s",
            str(s.collective_timeout_s),
        ]
        # Both ranks see one device; NCCL_DEBUG=WARN prints NCCL's own reason if it refuses.
        env = {
            **NCCL_ENV,
            "NCCL_DEBUG": "WARN",
            **os.environ,
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
        }
        started = time.perf_counter()
        procs = [
            subprocess.Popen(
                [c.format(rank=r) for c in command],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            for r in (0, 1)
        ]
        ranks, outputs = [], []
        for rank, proc in enumerate(procs):
            timed_out = False
            try:
                output, _ = proc.communicate(timeout=s.experiment_wait_s * 3)
            except subprocess.TimeoutExpired:
                timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
            outputs.append(output or "")
            ranks.append(
                {"rank": rank, "exit_code": proc.returncode, "timed_out": timed_out, "log_tail": tail(output, 12)}
            )
    duplicate = any("Duplicate GPU" in output for output in outputs)
    ran = all(r["exit_code"] == 0 and "RESULT ok" in output for r, output in zip(ranks, outputs))
    return {
        "status": "ok",
        "nccl_allowed_two_ranks_on_one_gpu": ran,
        "duplicate_gpu_refused": duplicate,
        "wall_s": time.perf_counter() - started,
        "ranks": ranks,
    }


def nccl_rank_main(rank: int, port: int, timeout_s: float) -> int:
    """One rank of ``unit_second_process``."""
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=timeout_s)
    group = dist.ProcessGroupNCCL(dist.PrefixStore("same-gpu", store), rank, 2, options)
    tensor = torch.full((1024,), float(rank + 1), device="cuda")
    try:
        group.allreduce([tensor]).wait()
        torch.cuda.synchronize()
        print(f"RESULT ok sum={float(tensor[0])}", flush=True)
    except Exception as error:
        print(f"RESULT error {type(error).__name__}: {error}", flush=True)
    return 0


# ---------------------------------------------------------------------------- 4. throughput
def unit_throughput(s: Settings) -> dict[str, Any]:
    cuda = cuda_reason() is None
    device, model = ("cuda", "gpt3_medium") if cuda else ("cpu", "gpt3_tiny")
    steps = s.throughput_warmup + s.throughput_steps
    cfg = tiny_config(
        **{
            "job.steps": steps,
            "job.global_batch_size": s.throughput_batch,
            "job.microbatch_size": s.throughput_microbatch,
            "job.dataset": "synthetic",
            "runtime.save_final_params": False,
        }
    )
    cfg.model = load_model_config(model)
    if cuda:
        tf32_off()

    def rate(ends: list[float]) -> float:
        # step k's time = end(k) - end(k-1): both sides sync at each microbatch's loss, the same way
        intervals = [b - a for a, b in zip(ends[s.throughput_warmup - 1 :], ends[s.throughput_warmup :])]
        return s.throughput_batch / statistics.median(intervals)

    rounds = []
    for _ in range(s.throughput_rounds):  # alternate the two sides against drift
        executor = rate(train_solo(cfg, device, steps, with_state=False).step_ends)
        free_device_memory(cuda)
        plain = rate(train_reference(cfg, device=device).step_ends)
        free_device_memory(cuda)
        rounds.append({"executor_samples_per_s": executor, "plain_samples_per_s": plain})
    executor = statistics.median(r["executor_samples_per_s"] for r in rounds)
    plain = statistics.median(r["plain_samples_per_s"] for r in rounds)
    return {
        "status": "ok",
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "model": model,
        "precision": "fp32 (TF32 off)" if cuda else "fp32",
        "global_batch_size": s.throughput_batch,
        "microbatch_size": s.throughput_microbatch,
        "warmup_steps": s.throughput_warmup,
        "measured_steps": s.throughput_steps,
        "executor_samples_per_s": executor,
        "plain_samples_per_s": plain,
        "ratio": executor / plain,
        "rounds": rounds,
    }


def free_device_memory(cuda: bool) -> None:
    """Give the cached blocks of the side just measured back, so the next side starts alike."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- units and the report
@dataclass(frozen=True)
class Unit:
    name: str  # report path: "part" or "part.sub"
    run: Callable[[Settings], dict[str, Any]]
    needs_cuda: bool
    timeout: str  # key of Settings.unit_timeout_s


UNITS = (  # in order of importance: a spent budget skips the last ones
    Unit("exactness", unit_exactness, needs_cuda=False, timeout="exactness"),
    Unit("profile", unit_profile, needs_cuda=True, timeout="profile"),
    Unit("lifecycle.loop", unit_lifecycle_loop, needs_cuda=False, timeout="lifecycle"),
    Unit("throughput", unit_throughput, needs_cuda=False, timeout="throughput"),
    Unit(
        "lifecycle.absent_peer_lazy_init", lambda s: unit_absent_peer(s, "lazy"), needs_cuda=True, timeout="experiment"
    ),
    Unit(
        "lifecycle.absent_peer_eager_init",
        lambda s: unit_absent_peer(s, "eager"),
        needs_cuda=True,
        timeout="experiment",
    ),
    Unit(
        "lifecycle.absent_peer_nonblocking_init",
        lambda s: unit_absent_peer(s, "nonblocking"),
        needs_cuda=True,
        timeout="experiment",
    ),
    Unit("lifecycle.second_process_same_gpu", unit_second_process, needs_cuda=True, timeout="experiment"),
)
UNIT_NAMES = tuple(u.name for u in UNITS)


def run_unit(unit: Unit, quick: bool, timeout_s: float) -> dict[str, Any]:
    """Run ``unit`` in a fresh process (its own CUDA context, threads and fds), bounded by ``timeout_s``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "unit.json"
        command = [sys.executable, __file__, "--unit", unit.name, "--unit-out", str(out)] + (
            ["--quick"] if quick else []
        )
        env = {**NCCL_ENV, **os.environ}  # as a worker sets it for NCCL (harmless for gloo)
        started = time.perf_counter()
        proc = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            return {
                "status": "timeout",
                "reason": f"did not finish within its {timeout_s:.0f} s",
                "wall_s": time.perf_counter() - started,
                "log_tail": tail(output),
            }
        wall_s = time.perf_counter() - started
        if not out.exists():
            return {
                "status": "failed",
                "reason": f"exited with {proc.returncode} without a result",
                "wall_s": wall_s,
                "log_tail": tail(output),
            }
        result = json.loads(out.read_text())
        result["wall_s"] = wall_s
        if result.get("status") == "failed":
            result["log_tail"] = tail(output)
        return result


def unit_main(name: str, out: Path, settings: Settings) -> None:
    """Inside a unit's process: run it and write its result (a failure becomes a result too)."""
    unit = next(u for u in UNITS if u.name == name)
    try:
        result = unit.run(settings)
    except Exception as error:
        result = {
            "status": "failed",
            "reason": f"{type(error).__name__}: {error}"[:4000],
            "traceback": traceback.format_exc()[-6000:],
        }
    out.write_text(json.dumps(_scrub(result), indent=1, default=str))


def _scrub(value: Any) -> Any:
    """NaN and infinities as strings (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _scrub(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_scrub(v) for v in value]
    return value


def meta(settings: Settings) -> dict[str, Any]:
    info: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "settings": asdict(settings),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NCCL", "NCCL_", "CUDA_VISIBLE"))},
    }
    with contextlib.suppress(Exception):
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            device_count=torch.cuda.device_count(),
            capability=f"{props.major}.{props.minor}",
            device_memory_gib=props.total_memory / (1 << 30),
            nccl=str(torch.cuda.nccl.version()) if torch.distributed.is_nccl_available() else None,
        )
    return info


def put(report: dict[str, Any], name: str, value: dict[str, Any]) -> None:
    part, _, sub = name.partition(".")
    if sub:
        report.setdefault(part, {})[sub] = value
    else:
        report[part] = value


def write_report(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(_scrub(report), indent=1, default=str))
    temporary.replace(path)


def summary_line(name: str, result: dict[str, Any]) -> str:
    status = result.get("status")
    if status != "ok":
        return f"{name}: {status} ({result.get('reason', '')})"
    keys = (
        "passed",
        "ratio",
        "implied_flop_fraction",
        "genuinely_pending_and_abortable",
        "duplicate_gpu_refused",
        "outcomes",
    )
    shown = {k: result[k] for k in keys if k in result}
    return f"{name}: ok {json.dumps(_scrub(shown), default=str)} in {result.get('wall_s', 0):.1f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--out", type=Path, default=Path("gpu_check_report.json"), help="the JSON report to write")
    parser.add_argument(
        "--quick", action="store_true", help="sizes for a 15-minute device lease (about five minutes on an H200)"
    )
    parser.add_argument("--only", nargs="+", choices=UNIT_NAMES, help="run only these units")
    parser.add_argument("--budget-s", type=float, help="wall-clock budget of all units (default: 300 quick, 900 full)")
    parser.add_argument("--unit", choices=UNIT_NAMES, help=argparse.SUPPRESS)
    parser.add_argument("--unit-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--nccl-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--timeout-s", type=float, default=10.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.nccl_rank is not None:
        return nccl_rank_main(args.nccl_rank, args.store_port, args.timeout_s)
    if args.unit:
        unit_main(args.unit, args.unit_out, settings)
        return 0
    if args.budget_s is not None and args.budget_s <= 0:
        parser.error(f"--budget-s={args.budget_s} must be > 0")
    budget = args.budget_s if args.budget_s is not None else settings.budget_s
    report: dict[str, Any] = {"meta": meta(settings)}
    reason = cuda_reason()
    deadline = time.monotonic() + budget
    for unit in UNITS:
        if args.only and unit.name not in args.only:
            continue
        left = deadline - time.monotonic()
        if unit.needs_cuda and reason:
            result: dict[str, Any] = {"status": "skipped", "reason": reason}
        elif left < 1.0:
            result = {
                "status": "skipped",
                "reason": f"the --budget-s={budget:.0f} s of this run was spent before this unit",
            }
        else:
            result = run_unit(unit, settings.quick, min(settings.timeout(unit.timeout), left))
        put(report, unit.name, result)
        report["meta"]["wall_s"] = budget - (deadline - time.monotonic())
        write_report(args.out, report)
        print(summary_line(unit.name, result), flush=True)
    write_report(args.out, report)
    print(f"report: {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # A unit may leave threads blocked in NCCL or gloo (that is what some of them probe): do not
    # wait for them at interpreter exit.
    os._exit(code)

"""What the GPU check's units share: run sizes (``Settings``), the device, one rank training through
the runtime's executor (``SoloRun``), distances from the single-process reference, and the
process-resource and spread helpers of the report."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from oobleck.data import GlobalBatchSampler, build_dataset
from oobleck.models import model_spec
from oobleck.runtime import keys
from oobleck.runtime.backend import GlooBackend, NcclBackend
from oobleck.runtime.comm import Communicator
from oobleck.runtime.executor import StepContext, clip_and_step, global_grad_norm, run_schedule, sync_gradients
from oobleck.runtime.resources import resource_probe
from oobleck.runtime.sealed_store import SealedStore
from oobleck.runtime.state import learning_rate, new_layer_state
from oobleck.runtime.topology import build_topology, group_specs
from oobleck.runtime.waits import AbortWatch, Waiter
from testing import hand_plan, template

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20

# Exactness tolerances (gpu_check's docstring says why they are these).
LOSS_RTOL = 1e-4
UPDATE_RTOL = 1e-2
# The issue's bound on CUDA memory over the lifecycle cycles.
MEMORY_FLAT_MIB = 256
# What oobleck.runtime.backend sets for NCCL workers (in-process recovery: a communicator error
# must not kill the process); the units run the runtime's code the same way.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
# The key space of the units that drive the runtime's communicator without a controller (an
# abort is set the way the controller sets it: in a run's key space, here one of their own).
SPACE = keys.KeySpace("gpu-check")


@dataclass(frozen=True)
class Settings:
    """Sizes and timeouts of one run (``QUICK`` or ``FULL``); ``cpu_*`` sizes replace the GPU's
    where the unit runs on a CPU (the rehearsal)."""

    quick: bool
    budget_s: float
    exact_steps: int
    run_timeout_s: float  # each python -m oobleck.run subprocess
    recovery_nodes: int
    recovery_steps: int
    recovery_kill_step: int
    profile_models: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]  # (model, overrides) on a GPU
    cpu_profile_models: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]
    profile_microbatches: tuple[int, ...]
    cpu_profile_microbatches: tuple[int, ...]
    profile_warmup: int
    profile_repeats: int
    restart_probes: int
    cpu_restart_probes: int  # the rehearsal checks that a probe runs, not the spread of several
    restart_model: tuple[str, tuple[tuple[str, int], ...]]
    cpu_restart_model: tuple[str, tuple[tuple[str, int], ...]]
    first_step_model: str
    cpu_first_step_model: str
    host_copy_mib: int
    cycles: int
    collective_timeout_s: float  # groups of the lifecycle units
    # The loop's groups on a CPU (the rehearsal): its gloo pair is built by two threads of one
    # process, which a loaded machine (a test suite beside it) can starve past the GPU's timeout.
    cpu_collective_timeout_s: float
    spin_s: float  # how long the NCCL op stays queued behind the GPU spin
    abort_after_s: float  # when the "controller" aborts a generation with a pending op
    issue_wait_s: float  # how long an absent-peer experiment lets the op start before aborting
    experiment_wait_s: float  # how long it then waits for abort() and for the blocked thread
    peer_death_ranks: int
    throughput_batch: int
    throughput_microbatch: int
    throughput_warmup: int
    throughput_steps: int
    throughput_rounds: int
    unit_timeout_s: tuple[tuple[str, float], ...]

    def timeout(self, kind: str) -> float:
        return dict(self.unit_timeout_s)[kind]

    def group_timeout(self, cuda: bool) -> float:
        """The lifecycle loop's group timeout on this device."""
        return self.collective_timeout_s if cuda else self.cpu_collective_timeout_s


# The per-layer profile keeps one block of each model: every block of a model is the same layer,
# so one measures the layer type (and the head's and embedding's) at a fraction of the time.
ONE_BLOCK = (("n_layer", 1),)

QUICK = Settings(
    quick=True,
    budget_s=360.0,
    exact_steps=4,
    run_timeout_s=150.0,
    recovery_nodes=3,
    recovery_steps=6,
    recovery_kill_step=3,
    profile_models=(("gpt2_medium", ONE_BLOCK), ("gpt3_medium", ONE_BLOCK), ("llama3_8b", ONE_BLOCK)),
    cpu_profile_models=(("gpt3_tiny", ONE_BLOCK), ("llama_tiny", ONE_BLOCK)),
    profile_microbatches=(1, 2),
    cpu_profile_microbatches=(1, 2),
    profile_warmup=1,
    profile_repeats=3,
    restart_probes=2,
    cpu_restart_probes=1,
    restart_model=("gpt3_medium", ()),
    cpu_restart_model=("gpt3_tiny", (("n_embd", 256), ("n_layer", 2))),
    first_step_model="gpt3_medium",
    cpu_first_step_model="gpt3_tiny",
    host_copy_mib=1024,
    cycles=25,
    collective_timeout_s=5.0,
    cpu_collective_timeout_s=15.0,
    spin_s=0.3,
    abort_after_s=0.05,
    issue_wait_s=1.0,
    experiment_wait_s=5.0,
    peer_death_ranks=3,
    throughput_batch=8,
    throughput_microbatch=2,
    throughput_warmup=2,
    throughput_steps=6,
    throughput_rounds=1,
    unit_timeout_s=(
        ("backends", 45.0),
        ("exactness", 200.0),
        ("recovery", 180.0),
        ("profile", 150.0),
        ("restart", 150.0),
        ("lifecycle", 90.0),
        ("throughput", 120.0),
        ("experiment", 45.0),
    ),
)
FULL = replace(  # longer and repeated measurements where a run is not squeezed into a lease
    QUICK,
    quick=False,
    budget_s=1200.0,
    exact_steps=8,
    run_timeout_s=300.0,
    recovery_nodes=4,
    recovery_steps=10,
    recovery_kill_step=5,
    profile_microbatches=(1, 2, 4),
    profile_warmup=2,
    profile_repeats=5,
    restart_probes=3,
    cpu_restart_probes=3,
    spin_s=0.5,
    issue_wait_s=2.0,
    experiment_wait_s=10.0,
    throughput_warmup=3,
    throughput_steps=15,
    throughput_rounds=2,
    unit_timeout_s=(
        ("backends", 90.0),
        ("exactness", 400.0),
        ("recovery", 400.0),
        ("profile", 400.0),
        ("restart", 300.0),
        ("lifecycle", 200.0),
        ("throughput", 300.0),
        ("experiment", 90.0),
    ),
)


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


def scrub(value: Any) -> Any:
    """NaN and infinities as strings (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: scrub(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v) for v in value]
    return value


@contextlib.contextmanager
def local_store() -> Iterator[Any]:
    """A TCPStore server on loopback, standing in for the controller's."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    yield store


def spawn(command: list[str], env: Mapping[str, str]) -> subprocess.Popen[str]:
    """``command`` started in the repository root, in a session of its own (a kill of its process
    group reaches whatever it starts), its stdout and stderr read together as text."""
    return subprocess.Popen(
        command,
        cwd=REPO,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def spawn_ranks(command: list[str], ranks: Iterable[int], env: Mapping[str, str]) -> list[subprocess.Popen[str]]:
    """``command`` once per rank (``spawn``), each ``{rank}`` in its words replaced by the rank."""
    return [spawn([word.format(rank=rank) for word in command], env) for rank in ranks]


def free_device_memory(cuda: bool) -> None:
    """Give the cached blocks of the side just measured back, so the next side starts alike."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def kill_strays(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def tail(text: Any, lines: int = 30) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])


def process_resources() -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        free, total = torch.cuda.mem_get_info()
        extra = {"cuda_reserved_mib": torch.cuda.memory_reserved() / MIB, "cuda_used_mib": (total - free) / MIB}
    return resource_probe(extra)


def growth(before: dict[str, Any], after: dict[str, Any], samples: list[dict[str, Any]], key: str) -> dict[str, Any]:
    values = [sample[key] for sample in samples if key in sample]
    return {
        "baseline": before.get(key),
        "final": after.get(key),
        "growth": after.get(key, 0) - before.get(key, 0),
        **spread(values),
    }


# ---------------------------------------------------------------------------- one rank through the executor
class SoloRun:
    """Training through the runtime's executor as one rank: one pipeline of one stage holding every
    layer, the Communicator of a one-rank world (no groups), per-layer AdamW, the runtime's
    clipping and tied-weight handling. What a worker does per step, minus the store's commit."""

    def __init__(self, cfg: Any, device: str, store: Any) -> None:
        job, model = cfg.job, cfg.model
        if int(cfg.cluster.torch_threads) > 0:
            torch.set_num_threads(int(cfg.cluster.torch_threads))  # as the workers do
        spec = model_spec(model, int(job.seed))
        layers, batch, micro = spec.num_layers, int(job.global_batch_size), int(job.microbatch_size)
        plan = hand_plan(
            [(template([(0, layers, 0, 0, 1)]), (0,), batch // micro)],
            batch=batch,
            micro=micro,
            layers=layers,
            f=0,
            gpus=1,
        )
        topology = build_topology(plan, (0, 0), spec.tied_layers)
        assert topology is not None
        timeout_s = float(cfg.cluster.collective_timeout_s)
        self.store = store
        self.watch = AbortWatch("127.0.0.1", store.port, timeout_s, SPACE)
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
            space=SPACE,
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
            spec=spec,
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
        SealedStore(self.store, SPACE).set(keys.abort(0), "1")  # ends the watcher thread
        self.watch.aborted.wait(5.0)


@dataclass
class Trained:
    losses: list[float]
    step_starts: list[float]  # time.perf_counter() before each step
    step_ends: list[float]  # time.perf_counter() after each step
    state: dict[int, dict[str, Any]]


def train_solo(cfg: Any, device: str, steps: int, *, with_state: bool = True) -> Trained:
    with local_store() as store:
        run = SoloRun(cfg, device, store)
        try:
            losses, starts, ends = [], [], []
            for step in range(steps):
                starts.append(time.perf_counter())
                losses.append(run.step(step))
                ends.append(time.perf_counter())
            return Trained(losses, starts, ends, run.state() if with_state else {})
        finally:
            run.close()


def initial_state(cfg: Any) -> dict[int, dict[str, Any]]:
    spec = model_spec(cfg.model, int(cfg.job.seed))
    layers = spec.build_layers(range(spec.num_layers))
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

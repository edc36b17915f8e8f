"""Whether a measured profile is worth starting here: its memory and time, estimated up front.

Measuring (``oobleck.profiling.measure``) builds one layer at a time on the device and runs
``warmup + repeats`` forward and backward passes of one microbatch, twice (fused and split backward). Before the first layer,
``estimate_measurement`` works out

- the memory of the largest layer: fp32 parameters and gradients (8 bytes per parameter) plus the
  activations autograd keeps for one microbatch at 4 bytes per value (the family's count,
  ``Architecture.layer_cost``), doubled for backward's temporaries;
- the time: the model's forward and backward FLOPs (the family's count) times the runs (each
  measured with a fused and with a split backward), at the FLOP rate a short matrix-product probe
  reaches on this device with the thread count the measurement uses. A layer does worse than a
  large matrix product (attention, norms and the gathers are memory-bound), so the estimate is a
  lower bound.

``check_measurement`` raises ``ProfileError`` pointing at ``profile.source=analytic`` when the
largest layer does not fit the free memory, or the time exceeds ``profile.max_measure_s``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from oobleck.errors import ProfileError
from oobleck.models.architecture import LayerCost
from oobleck.models.registry import architecture

FP32_BYTES = 4
PARAM_AND_GRAD_BYTES = 2 * FP32_BYTES
BACKWARD_TEMPORARIES = 2  # backward holds about as much again as the saved activations
MEASURED_BACKWARDS = 2  # each run is measured with a fused and with a split backward (measure.py)
PROBE_SIZE = 512  # square fp32 matrix product: large enough to reach the device's matmul rate
PROBE_SECONDS = 0.2


@dataclass(frozen=True)
class MeasurementEstimate:
    """What measuring a model here would take (see the module docstring)."""

    seconds: float
    peak_bytes: int  # the largest layer's training memory
    largest_layer: str
    available_bytes: int | None  # free memory on the device (None: unknown)
    flop_rate: float  # FLOP/s the probe reached

    @property
    def duration(self) -> str:
        """The time, readable: "about 3.1 h"."""
        return f"about {_duration(self.seconds)}"

    def describe(self) -> str:
        return (
            f"{self.duration} or more at {self.flop_rate / 1e9:.0f} GFLOP/s, up to {_size(self.peak_bytes)} per layer"
        )


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s"


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def layer_training_bytes(cost: LayerCost) -> int:
    """Memory of measuring a layer (costed at fp32): parameters and gradients plus saved activations."""
    return cost.params * PARAM_AND_GRAD_BYTES + cost.activation_bytes * BACKWARD_TEMPORARIES


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device``: CUDA's free bytes, or the host's MemAvailable (Linux)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def matmul_flop_rate(device: torch.device, threads: int | None) -> float:
    """FLOP/s of a fp32 matrix product on ``device`` with ``threads`` torch threads (a short probe)."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(PROBE_SIZE, PROBE_SIZE, device=device)
        b = torch.randn(PROBE_SIZE, PROBE_SIZE, device=device)
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        (a @ b).sum().item()  # warm-up (and the first CUDA kernel launch)
        runs, started = 0, time.perf_counter()
        while time.perf_counter() - started < PROBE_SECONDS:
            a @ b
            runs += 1
        sync()
        elapsed = time.perf_counter() - started
    finally:
        torch.set_num_threads(previous)
    return 2.0 * PROBE_SIZE**3 * runs / elapsed


def estimate_measurement(
    model_cfg: Any, microbatch_size: int, device: torch.device, *, runs: int, threads: int | None
) -> MeasurementEstimate:
    """The memory and time of measuring ``model_cfg`` with ``runs`` forward+backward passes per layer."""
    arch = architecture(model_cfg)
    costs = [arch.layer_cost(i, microbatch_size, FP32_BYTES) for i in range(arch.num_layers)]
    peak, largest = max((layer_training_bytes(cost), cost.name) for cost in costs)
    flops = runs * sum(cost.forward_flops + cost.backward_flops for cost in costs)
    rate = matmul_flop_rate(device, threads)
    return MeasurementEstimate(flops / rate, peak, largest, available_bytes(device), rate)


def check_measurement(cfg: Any, device: torch.device) -> MeasurementEstimate:
    """The estimate for ``cfg``'s measured profile, or ``ProfileError`` when it does not fit this
    device's free memory or would take longer than ``profile.max_measure_s``."""
    model, profile = cfg.model, cfg.profile
    estimate = estimate_measurement(
        model,
        int(cfg.job.microbatch_size),
        device,
        runs=MEASURED_BACKWARDS * (int(profile.warmup) + int(profile.repeats)),
        threads=int(cfg.cluster.torch_threads) or None,
    )
    instead = f"use profile.source=analytic (the FLOP/byte model of the {cfg.cluster.gpu.name}, cluster.gpu; gpu=<name> picks another)"
    where = f"{device.type}" + (
        " (profile.source=auto measures when the device exists here)" if profile.source == "auto" else ""
    )
    if estimate.available_bytes is not None and estimate.peak_bytes > estimate.available_bytes:
        raise ProfileError(
            f"measuring model={model.name} on {where} needs about {estimate.peak_bytes / 1e9:.1f} GB for its layer "
            f"{estimate.largest_layer} (microbatch {cfg.job.microbatch_size}), but {estimate.available_bytes / 1e9:.1f} GB "
            f"is free here; {instead}, or lower job.microbatch_size"
        )
    if estimate.seconds > float(profile.max_measure_s):
        raise ProfileError(
            f"measuring model={model.name} on {where} would take {estimate.duration} "
            f"({architecture(model).num_layers} layers x {MEASURED_BACKWARDS * (int(profile.warmup) + int(profile.repeats))} runs at the "
            f"{estimate.flop_rate / 1e9:.0f} GFLOP/s this device reaches), over profile.max_measure_s={profile.max_measure_s:g}; "
            f"{instead}, or raise profile.max_measure_s"
        )
    return estimate

"""Analytic per-layer profiles of a named GPU from FLOPs, bytes and bandwidth (no GPU, no torch).

For paper-scale planning and simulation. Each pass of a layer takes a roofline:
``max(FLOPs / (peak * achieved_flop_fraction), bytes / (bandwidth * achieved_bandwidth_fraction))``,
with the fractions (assumptions) in ``conf/gpu/<name>.yaml``. The FLOPs, bytes and activation
sizes of each layer come from its model family (``Architecture.layer_cost``: the formulas and their
sources are in ``oobleck/models/<family>/__init__.py``), at the GPU's ``activation_bytes_per_value``.
Parameters are counted at 4 bytes (fp32 master weights), as in measured profiles; the planner
adds gradients and optimizer state.
"""

from __future__ import annotations

from typing import Any

from oobleck.models.architecture import Architecture, LayerCost
from oobleck.models.registry import architecture
from oobleck.planning.inputs import LayerProfile, ModelProfile

FP32_BYTES = 4
TFLOP = 1e12
GB = 1e9
GPU_KEYS = (
    "name",
    "peak_tflops",
    "memory_gb",
    "memory_bandwidth_gbps",
    "achieved_flop_fraction",
    "achieved_bandwidth_fraction",
    "activation_bytes_per_value",
)


def roofline_seconds(flops: float, nbytes: float, gpu: Any) -> float:
    """The longer of the compute time and the memory time on ``gpu`` (``cluster.gpu``)."""
    compute = flops / (gpu.peak_tflops * TFLOP * gpu.achieved_flop_fraction)
    memory = nbytes / (gpu.memory_bandwidth_gbps * GB * gpu.achieved_bandwidth_fraction)
    return max(compute, memory)


def compute_bound(cost: LayerCost, gpu: Any) -> bool:
    """Whether the roofline puts the layer's forward pass on the compute side."""
    compute = cost.forward_flops / (gpu.peak_tflops * TFLOP * gpu.achieved_flop_fraction)
    return compute >= roofline_seconds(cost.forward_flops, cost.forward_bytes, gpu)


def layer_profile(cost: LayerCost, gpu: Any) -> LayerProfile:
    return LayerProfile(
        name=cost.name,
        forward_s=roofline_seconds(cost.forward_flops, cost.forward_bytes, gpu),
        backward_s=roofline_seconds(cost.backward_flops, cost.backward_bytes, gpu),
        param_bytes=cost.params * FP32_BYTES,
        activation_bytes=cost.activation_bytes,
        output_bytes=cost.output_bytes,
    )


def analytic_layer(model_cfg: Any, gpu_cfg: Any, microbatch_size: int, index: int) -> LayerProfile:
    arch = architecture(model_cfg)
    return layer_profile(arch.layer_cost(index, microbatch_size, int(gpu_cfg.activation_bytes_per_value)), gpu_cfg)


def analytic_profile(model_cfg: Any, gpu_cfg: Any, microbatch_size: int) -> ModelProfile:
    """The profile ``gpu_cfg`` (``cluster.gpu``) would give ``model_cfg`` at this microbatch size."""
    arch: Architecture = architecture(model_cfg)
    width = int(gpu_cfg.activation_bytes_per_value)
    layers = tuple(layer_profile(arch.layer_cost(i, microbatch_size, width), gpu_cfg) for i in range(arch.num_layers))
    return ModelProfile(
        model=arch.name,
        microbatch_size=int(microbatch_size),
        device=f"analytic:{gpu_cfg.name}",
        layers=layers,
        source="analytic",
        tied_layers=arch.tied_pairs,
        metadata={"gpu": {key: getattr(gpu_cfg, key) for key in GPU_KEYS}},
    )

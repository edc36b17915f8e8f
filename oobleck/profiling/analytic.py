"""Analytic per-layer profiles of a named GPU from FLOPs, bytes and bandwidth (no GPU, no torch).

For paper-scale planning and simulation. Each pass of a layer takes a roofline:
``max(FLOPs / (peak * achieved_flop_fraction), bytes / (bandwidth * achieved_bandwidth_fraction))``,
with the fractions (assumptions) in ``conf/gpu/<name>.yaml``. The FLOPs, bytes and activation
sizes of each layer come from its model family (``Architecture.layer_cost``: the formulas and their
sources are in ``oobleck/models/<family>/__init__.py``), at the GPU's ``activation_bytes_per_value``.
Parameters are counted at 4 bytes (fp32 master weights), as in measured profiles; the planner
adds gradients and optimizer state.

The split backward (``LayerProfile.backward_input_s`` / ``backward_weight_s``, for schedules that
run the two apart) gives each half its own FLOPs (``LayerCost.backward_input_flops`` /
``backward_weight_flops``, as Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24, Table 1,
count them) and half the backward's memory traffic (each half reads the layer's weights and
activations once). A layer whose input takes no gradient (token ids) has no input half: its whole
backward is the weight half.
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


def backward_halves(cost: LayerCost, gpu: Any) -> tuple[float, float]:
    """Seconds of the input-gradient and the weight-gradient passes run apart (module docstring)."""
    backward = roofline_seconds(cost.backward_flops, cost.backward_bytes, gpu)
    if cost.backward_input_flops == 0:
        return 0.0, backward
    if cost.backward_weight_flops == 0:
        return backward, 0.0
    half_bytes = cost.backward_bytes / 2
    return (
        roofline_seconds(cost.backward_input_flops, half_bytes, gpu),
        roofline_seconds(cost.backward_weight_flops, half_bytes, gpu),
    )


def layer_profile(cost: LayerCost, gpu: Any) -> LayerProfile:
    inputs, weights = backward_halves(cost, gpu)
    return LayerProfile(
        name=cost.name,
        forward_s=roofline_seconds(cost.forward_flops, cost.forward_bytes, gpu),
        backward_s=roofline_seconds(cost.backward_flops, cost.backward_bytes, gpu),
        param_bytes=cost.params * FP32_BYTES,
        activation_bytes=cost.activation_bytes,
        output_bytes=cost.output_bytes,
        backward_input_s=inputs,
        backward_weight_s=weights,
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

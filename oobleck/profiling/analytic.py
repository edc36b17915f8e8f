"""Analytic per-layer profiles of a named GPU from FLOPs, bytes and bandwidth (no GPU needed).

For paper-scale planning and simulation. Each layer's time is a roofline:
``max(FLOPs / (peak * achieved_flop_fraction), bytes / (bandwidth * achieved_bandwidth_fraction))``,
with the fractions (assumptions) in ``conf/gpu/<name>.yaml``. Backward is twice the forward
(two matrix products per forward one: input and weight gradients).

The split backward (``LayerProfile.backward_input_s`` / ``backward_weight_s``, for schedules that
run the two apart) counts each half's own FLOPs, as Qi et al. ("Zero Bubble Pipeline
Parallelism", ICLR'24, Table 1) do: a block's weight gradient is its linear layers' products,
``(8 + 4f) b T C^2``; its input gradient the same plus the backward of attention's scores and
weighted sum, which have no weights (``8 b T^2 C``); the head's halves are equal (``2 b T C V``
each); the embedding's input is token ids, so its whole backward is the weight (scatter) half.
Each half reads the layer's weights and activations once (half the backward's traffic).

FLOPs per microbatch of b sequences of length T, width C, MLP width f*C, vocabulary V:
- transformer block forward: ``(8 + 4f) b T C^2 + 4 b T^2 C`` (QKV 6, output projection 2,
  MLP 4f; attention scores and weighted sum 4 b T^2 C) = ``24 b T C^2 + 4 b T^2 C`` for f = 4;
- LM head forward: ``2 b T C V``; the embedding is a memory-bound gather.
Activation memory kept for backward (16-bit values, no recomputation) follows Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models" (MLSys'23), eq. 1:
``T b C (34 + 5 a T / C)`` bytes per block with a heads, scaled by ``activation_bytes_per_value / 2``
(and by the MLP width when f != 4). Parameters are counted at 4 bytes (fp32 master weights), as in
measured profiles; the planner adds gradients and optimizer state.
"""

from __future__ import annotations

from typing import Any

from oobleck.models import layer_name, num_layers, parameter_count, tied_parameters
from oobleck.planning.inputs import LayerProfile, ModelProfile

FP32_BYTES = 4
INDEX_BYTES = 8  # int64 token ids
TFLOP = 1e12
GB = 1e9


def block_forward_flops(model_cfg: Any, microbatch_size: int) -> float:
    b, t, c, f = microbatch_size, model_cfg.seq_len, model_cfg.n_embd, model_cfg.ffn_mult
    return (8 + 4 * f) * b * t * c * c + 4 * b * t * t * c


def block_weight_gradient_flops(model_cfg: Any, microbatch_size: int) -> float:
    """The weight-gradient half of a block's backward: one product per linear layer's forward one
    (attention's scores and weighted sum have no weights: their backward is all input gradient)."""
    b, t, c, f = microbatch_size, model_cfg.seq_len, model_cfg.n_embd, model_cfg.ffn_mult
    return (8 + 4 * f) * b * t * c * c


def head_forward_flops(model_cfg: Any, microbatch_size: int) -> float:
    return 2 * microbatch_size * model_cfg.seq_len * model_cfg.n_embd * model_cfg.vocab_size


def block_activation_bytes(model_cfg: Any, microbatch_size: int, bytes_per_value: int) -> int:
    b, t, c, a, f = microbatch_size, model_cfg.seq_len, model_cfg.n_embd, model_cfg.n_head, model_cfg.ffn_mult
    # Korthikanti et al.: 34 T b C + 5 a T^2 b bytes at 2 bytes/value; the MLP's 4C-wide
    # intermediate (GeLU input and output) accounts for 16 of the 34 when f = 4.
    per_token_width = 34 + 4 * (f - 4)
    return int((t * b * c * per_token_width + 5 * a * t * t * b) * bytes_per_value / 2)


def _seconds(flops: float, nbytes: float, gpu: Any) -> float:
    compute = flops / (gpu.peak_tflops * TFLOP * gpu.achieved_flop_fraction)
    memory = nbytes / (gpu.memory_bandwidth_gbps * GB * gpu.achieved_bandwidth_fraction)
    return max(compute, memory)


def analytic_layer(model_cfg: Any, gpu_cfg: Any, microbatch_size: int, index: int) -> LayerProfile:
    b, t, c, v = microbatch_size, model_cfg.seq_len, model_cfg.n_embd, model_cfg.vocab_size
    p = int(gpu_cfg.activation_bytes_per_value)
    params = parameter_count(model_cfg, index)
    name = layer_name(model_cfg, index)
    boundary = b * t * c * p
    if name == "embedding":
        # Gather two rows per token, write the sum; backward scatters into a dense fp32 gradient.
        flops = float(b * t * c)
        activation = b * t * INDEX_BYTES + b * t * c  # ids + a 1-byte dropout mask per value
        forward = _seconds(flops, 3 * boundary, gpu_cfg)
        backward = _seconds(flops, params * FP32_BYTES + 2 * boundary, gpu_cfg)
        return LayerProfile(name, forward, backward, params * FP32_BYTES, activation, boundary, 0.0, backward)
    if name == "head":
        flops = head_forward_flops(model_cfg, b)
        # LayerNorm and LM-head inputs at 16 bit plus fp32 logits for the softmax/cross entropy.
        activation = 2 * boundary + b * t * v * FP32_BYTES
        traffic = params * p + activation
        forward = _seconds(flops, traffic, gpu_cfg)
        backward = _seconds(2 * flops, 2 * traffic, gpu_cfg)
        half = _seconds(flops, traffic, gpu_cfg)
        # The head ends the model: it sends no boundary tensor onward.
        return LayerProfile(name, forward, backward, params * FP32_BYTES, activation, 0, half, half)
    flops = block_forward_flops(model_cfg, b)
    activation = block_activation_bytes(model_cfg, b, p)
    traffic = params * p + activation
    forward = _seconds(flops, traffic, gpu_cfg)
    backward = _seconds(2 * flops, 2 * traffic, gpu_cfg)
    weights = block_weight_gradient_flops(model_cfg, b)
    inputs = _seconds(2 * flops - weights, traffic, gpu_cfg)
    return LayerProfile(
        name, forward, backward, params * FP32_BYTES, activation, boundary, inputs, _seconds(weights, traffic, gpu_cfg)
    )


def analytic_profile(model_cfg: Any, gpu_cfg: Any, microbatch_size: int) -> ModelProfile:
    """The profile ``gpu_cfg`` (``cluster.gpu``) would give ``model_cfg`` at this microbatch size."""
    layers = tuple(analytic_layer(model_cfg, gpu_cfg, microbatch_size, i) for i in range(num_layers(model_cfg)))
    return ModelProfile(
        model=str(model_cfg.name),
        microbatch_size=int(microbatch_size),
        device=f"analytic:{gpu_cfg.name}",
        layers=layers,
        source="analytic",
        tied_layers=tuple(t.layers for t in tied_parameters(model_cfg)),
        metadata={
            "gpu": {
                key: getattr(gpu_cfg, key)
                for key in (
                    "name",
                    "peak_tflops",
                    "memory_gb",
                    "memory_bandwidth_gbps",
                    "achieved_flop_fraction",
                    "achieved_bandwidth_fraction",
                    "activation_bytes_per_value",
                )
            },
        },
    )

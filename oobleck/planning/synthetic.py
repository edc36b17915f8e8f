"""Seeded synthetic model profiles for tests, benchmarks and the planner CLI without a profiler.

Layers look like a transformer's blocks (similar times and sizes, each perturbed by a seeded
factor), with lighter embedding and head layers at the ends when ``num_layers >= 3``.
"""

from __future__ import annotations

import numpy as np

from oobleck.planning.inputs import LayerProfile, ModelProfile


def synthetic_profile(
    num_layers: int,
    seed: int = 0,
    *,
    forward_s: float = 0.01,
    param_bytes: int = 50_000_000,
    activation_bytes: int = 20_000_000,
    output_bytes: int = 4_000_000,
    jitter: float = 0.3,
    microbatch_size: int = 1,
    model: str = "synthetic",
) -> ModelProfile:
    """A ``num_layers`` profile; every size is scaled by a factor in [1 - jitter, 1 + jitter]."""
    rng = np.random.default_rng(seed)
    layers = []
    for index in range(num_layers):
        scale = 1.0 + jitter * (2.0 * rng.random(4) - 1.0)
        edge = num_layers >= 3 and index in (0, num_layers - 1)
        weight = 0.5 if edge else 1.0  # embedding and head: less compute than a block
        fwd = forward_s * weight * float(scale[0])
        layers.append(
            LayerProfile(
                name="embedding" if edge and index == 0 else "head" if edge else f"block{index}",
                forward_s=fwd,
                backward_s=2.0 * fwd * float(scale[1]),
                param_bytes=int(param_bytes * float(scale[2])) // 4 * 4,
                activation_bytes=int(activation_bytes * float(scale[3])),
                output_bytes=int(output_bytes),
            )
        )
    return ModelProfile(
        model=model,
        microbatch_size=microbatch_size,
        device="synthetic",
        layers=tuple(layers),
        source="synthetic",
        metadata={"seed": seed},
    )

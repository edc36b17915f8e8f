"""Helpers of the checkpoint tests: gpt3_tiny layers with non-trivial state, and saving them."""

from __future__ import annotations

import torch

from oobleck.checkpoint import AsyncCheckpointWriter, fingerprint, save_checkpoint, step_dir
from oobleck.layer_state import LayerState
from oobleck.models import num_layers
from oobleck.runtime.state import new_layer_state

WAIT_S = 60.0  # bound on every wait in these tests (a hang guard, not a performance limit)


def trained_layers(cfg, seed: int = 0, steps: int = 2) -> list[LayerState]:
    """Every layer of ``cfg``'s model after ``steps`` AdamW steps on seeded gradients: the moments
    and parameters are then all distinct from a fresh layer's."""
    generator = torch.Generator().manual_seed(seed)
    layers = [new_layer_state(cfg.model, cfg.job, index, seed, "cpu") for index in range(num_layers(cfg.model))]
    for _ in range(steps):
        for layer in layers:
            for p in layer.params:
                p.grad = torch.randn(p.shape, generator=generator)
            layer.optimizer.step()
            layer.zero_grad()
    return layers


def save(root, step, layers, cfg, *, extra=None, async_write=True):
    """A complete checkpoint of ``layers`` at ``step`` under ``root``; returns its step dir."""
    with AsyncCheckpointWriter(async_write=async_write, threads=2, timeout_s=WAIT_S) as writer:
        save_checkpoint(root, step, layers, fingerprint(cfg), len(layers), writer=writer, extra=extra)
    return step_dir(root, step)

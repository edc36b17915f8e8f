"""Per-layer training state on one worker: the layer, its AdamW state, and how that state moves.

Each locally held layer has its own ``torch.optim.AdamW`` whose state is created eagerly (step 0,
zero moments), so a layer's complete state is always (parameters, exp_avg, exp_avg_sq, step) and
can be cut into chunks, sent to a new holder and checksummed. The optimizer step count equals the
number of committed steps on every replica, so it travels as a number, not a tensor.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from oobleck.models import build_layer

STATE_KINDS = 3  # parameters, exp_avg, exp_avg_sq


@dataclass
class LayerState:
    index: int
    module: nn.Module
    optimizer: torch.optim.AdamW

    @property
    def params(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def new_layer_state(model_cfg: Any, job: Any, index: int, seed: int, device: str, committed_steps: int = 0) -> LayerState:
    module = build_layer(model_cfg, index, seed, device=device)
    optimizer = torch.optim.AdamW(
        module.parameters(),
        lr=float(job.lr),
        betas=(float(job.beta1), float(job.beta2)),
        weight_decay=float(job.weight_decay),
    )
    for p in module.parameters():
        optimizer.state[p] = {
            "step": torch.tensor(float(committed_steps)),
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }
    return LayerState(index=index, module=module, optimizer=optimizer)


def learning_rate(job: Any, step: int) -> float:
    """Linear warmup over ``job.warmup_steps``, then cosine decay to ``job.min_lr`` at ``job.steps``."""
    lr, min_lr, warmup, total = float(job.lr), float(job.min_lr), int(job.warmup_steps), int(job.steps)
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def flat_state(layer: LayerState) -> torch.Tensor:
    """``[3, numel]``: flattened parameters, exp_avg, exp_avg_sq (a copy, on the layer's device)."""
    first = layer.params[0]
    return flat_state_into(layer, torch.empty((STATE_KINDS, layer.numel), dtype=first.dtype, device=first.device))


def flat_state_into(layer: LayerState, out: torch.Tensor, *, non_blocking: bool = False) -> torch.Tensor:
    """Copy ``flat_state(layer)`` into ``out`` (``[3, numel]`` on any device, e.g. pinned host
    memory for a checkpoint snapshot) with one copy per tensor; returns ``out``."""
    offset = 0
    for p in layer.params:
        n = p.numel()
        state = layer.optimizer.state[p]
        for row, tensor in enumerate((p.detach(), state["exp_avg"], state["exp_avg_sq"])):
            out[row, offset : offset + n].copy_(tensor.reshape(-1), non_blocking=non_blocking)
        offset += n
    return out


def chunk_bounds(numel: int, chunk: int, chunks: int) -> tuple[int, int]:
    """Element range ``[a, b)`` of chunk ``chunk`` of ``chunks`` near-equal pieces."""
    return chunk * numel // chunks, (chunk + 1) * numel // chunks


def install_flat_state(layer: LayerState, flat: torch.Tensor, committed_steps: int) -> None:
    """Overwrite parameters and AdamW state from a ``[3, numel]`` tensor (see ``flat_state``)."""
    offset = 0
    with torch.no_grad():
        for p in layer.params:
            n = p.numel()
            p.copy_(flat[0, offset : offset + n].view_as(p))
            state = layer.optimizer.state[p]
            state["exp_avg"].copy_(flat[1, offset : offset + n].view_as(p))
            state["exp_avg_sq"].copy_(flat[2, offset : offset + n].view_as(p))
            state["step"] = torch.tensor(float(committed_steps))
            offset += n


def crc32(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.detach().cpu().contiguous().numpy().tobytes())


def layer_checksum(layer: LayerState) -> int:
    """CRC32 over parameters and AdamW moments: equal on every replica of a layer, bit for bit."""
    return crc32(flat_state(layer))


def set_learning_rate(layer: LayerState, lr: float) -> None:
    for group in layer.optimizer.param_groups:
        group["lr"] = lr

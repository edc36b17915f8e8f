"""The model as the runtime sees it, described in one place (in the spirit of torchtitan's
``ModelSpec``): how many layers, how to build layer ``i``, the loss, the shape of the tensor that
crosses each stage boundary, and the weights two layers share.

The runtime (``oobleck.runtime``) reads only a ``ModelSpec``; which model family produced it and
which config keys it came from stay here. Today the family is the layered GPT of
``oobleck.models.gpt``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from oobleck.models import gpt


@dataclass(frozen=True)
class ModelSpec:
    """What the runtime needs to know about a layered model.

    - ``build_layer(index, device, initialise)``: layer ``index``; with ``initialise`` false its
      parameters are left unset (on ``device="meta"``: a shell without memory, whose parameters
      the caller places), and ``initialise(module, index)`` gives them their seeded initial
      values later, wherever they now live;
    - ``loss(output, targets)``: the loss of a microbatch *summed* over its samples (the runtime
      divides by the global batch size);
    - ``boundary_shape(index, rows)``: the shape of the activation that layer ``index`` hands to
      layer ``index + 1`` for a microbatch share of ``rows`` samples (what a stage receives, and
      the gradient it sends back); ``boundary_dtype`` its dtype;
    - ``tied``: weights held by two layers, whose gradients the runtime sums.
    """

    name: str
    num_layers: int
    build_layer: Callable[[int, str | None, bool], nn.Module]
    initialise: Callable[[nn.Module, int], None]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    boundary_shape: Callable[[int, int], tuple[int, ...]]
    boundary_dtype: torch.dtype
    tied: tuple[gpt.TiedParameter, ...]

    @property
    def tied_layers(self) -> tuple[int, ...]:
        """The layers of the (one) tied weight, or ``()``."""
        return self.tied[0].layers if self.tied else ()

    @property
    def tied_names(self) -> dict[int, str]:
        """Layer -> the name of its copy of the tied weight."""
        return dict(zip(self.tied[0].layers, self.tied[0].names)) if self.tied else {}


def model_spec(model_cfg: Any, seed: int) -> ModelSpec:
    """The spec of ``model_cfg`` (a ``conf/model/<name>.yaml``) with weights keyed by ``seed``."""
    return _gpt_spec(model_cfg, seed)


def _gpt_spec(model_cfg: Any, seed: int) -> ModelSpec:
    seq_len, width = int(model_cfg.seq_len), int(model_cfg.n_embd)

    def build(index: int, device: str | None = None, initialise: bool = True) -> nn.Module:
        return gpt.build_layer(model_cfg, index, seed, device=device, initialise=initialise)

    def initialise(module: nn.Module, index: int) -> None:
        gpt.initialise_layer(module, model_cfg, index, seed)

    def boundary(index: int, rows: int) -> tuple[int, ...]:
        # Every layer but the head outputs the residual stream [rows, T, C].
        return (rows, seq_len, width)

    return ModelSpec(
        name=str(model_cfg.name),
        num_layers=gpt.num_layers(model_cfg),
        build_layer=build,
        initialise=initialise,
        loss=gpt.loss_fn,
        boundary_shape=boundary,
        boundary_dtype=torch.float32,
        tied=gpt.tied_parameters(model_cfg),
    )

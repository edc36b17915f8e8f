"""The model as the runtime sees it, described in one place (in the spirit of torchtitan's
``ModelSpec``): its ``Architecture`` (layers, costs, the tied pair), how to build layer ``i``, the
loss, the shape of the tensor that crosses each stage boundary, and the weights two layers share.

Every user of a model reads a ``ModelSpec``: the runtime (``oobleck.runtime``), the measured
profiler, the single-process reference (``ModelSpec.reference_model``) and the torchft worker.
``model_spec(model_cfg, seed)`` finds the family ``model.family`` names (``oobleck.models.registry``)
and asks its ``model`` module for the spec; which family produced it stays there.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from oobleck.models.architecture import Architecture, TiedParameter
from oobleck.models.registry import family_of, model_config


@dataclass(frozen=True)
class ModelSpec:
    """What the runtime, the measured profiler and the reference need to know about a layered model.

    - ``architecture``: the torch-free description (names, kinds, costs, sizes, the tied weight:
      ``tied``, whose two copies' gradients the runtime sums);
    - ``build_layer(index, device, initialise)``: layer ``index``; with ``initialise`` false its
      parameters are left unset (on ``device="meta"``: a shell without memory, whose parameters
      the caller places), and ``initialise(module, index)`` gives them their seeded initial
      values later, wherever they now live. A layer holds parameters only (no buffers), so a
      shell whose parameters are placed is a complete layer;
    - ``loss(output, targets)``: the loss of a microbatch *summed* over its samples (the runtime
      divides by the global batch size);
    - ``boundary_shape(index, rows)``: the shape of the activation that layer ``index`` hands to
      layer ``index + 1`` for a microbatch share of ``rows`` samples (what a stage receives, and
      the gradient it sends back); ``boundary_dtype`` its dtype. Layer 0 takes token ids
      ``[rows, seq_len]`` below ``vocab_size``.
    """

    architecture: Architecture
    build_layer: Callable[[int, str | None, bool], nn.Module]
    initialise: Callable[[nn.Module, int], None]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    boundary_shape: Callable[[int, int], tuple[int, ...]]
    boundary_dtype: torch.dtype

    @property
    def name(self) -> str:
        return self.architecture.name

    @property
    def num_layers(self) -> int:
        return self.architecture.num_layers

    @property
    def tied(self) -> tuple[TiedParameter, ...]:
        return self.architecture.tied

    @property
    def tied_layers(self) -> tuple[int, ...]:
        """The layers of the (one) tied weight, or ``()``."""
        return self.tied[0].layers if self.tied else ()

    @property
    def tied_names(self) -> dict[int, str]:
        """Layer -> the name of its copy of the tied weight."""
        return dict(zip(self.tied[0].layers, self.tied[0].names)) if self.tied else {}

    def build_layers(self, indices: Any, device: str | None = None) -> list[nn.Module]:
        """``build_layer`` (initialised) for each index, in the order given."""
        return [self.build_layer(index, device, True) for index in indices]

    def reference_model(self, device: torch.device | str | None = None) -> nn.Sequential:
        """All layers as one ``nn.Sequential`` with each tied weight as ONE ``Parameter``.

        This is the single-process truth: the layered form, with the gradients of each tied pair
        summed, must produce the same outputs and gradients.
        """
        model = nn.Sequential(*self.build_layers(range(self.num_layers), None if device is None else str(device)))
        for tied in self.tied:
            (src_layer, dst_layer), (src_name, dst_name) = tied.layers, tied.names
            shared = model[src_layer].get_parameter(src_name)
            owner_path, _, attr = dst_name.rpartition(".")
            owner = model[dst_layer].get_submodule(owner_path) if owner_path else model[dst_layer]
            setattr(owner, attr, shared)
        return model


def model_spec(model_cfg: Any, seed: int) -> ModelSpec:
    """The spec of ``model_cfg`` (a ``model:`` section or a family's typed config) with weights
    keyed by ``seed``."""
    family = family_of(model_cfg)
    config = model_config(model_cfg)
    return importlib.import_module(family.layers_module).spec(config, seed)

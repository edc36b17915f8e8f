"""Layered models: a model is an ordered list of layers, so any contiguous range of layers is a
pipeline stage. Families (GPT, Llama-style) are plugins: each registers its config, a torch-free
``Architecture`` (layers, tied weight, per-layer costs) and a torch ``ModelSpec`` (layers, loss,
boundary shapes); ``oobleck.models.registry`` says how to add one.

Everything imported here is torch-free; the torch-bound names (``model_spec``, ``ModelSpec``,
``build_layer``, ``build_layers``, ``build_reference_model``, ``loss_fn``) load on first use, so the
config checks, the planner and the simulator use the architecture without importing torch.
"""

from typing import TYPE_CHECKING, Any

from oobleck.errors import ConfigError
from oobleck.models.architecture import Architecture, LayerCost, ModelFamily, TiedParameter
from oobleck.models.registry import FAMILIES, architecture, family_of, model_config

if TYPE_CHECKING:
    from torch import nn

    from oobleck.models.common import lm_loss as loss_fn
    from oobleck.models.spec import ModelSpec, model_spec


def num_layers(model_cfg: Any) -> int:
    return architecture(model_cfg).num_layers


def layer_name(model_cfg: Any, index: int) -> str:
    names = architecture(model_cfg).layer_names
    if not 0 <= index < len(names):
        raise ConfigError(f"layer index {index} is outside 0..{len(names) - 1} for model {model_cfg.name!r}")
    return names[index]


def parameter_count(model_cfg: Any, index: int) -> int:
    return architecture(model_cfg).params(index)


def tied_parameters(model_cfg: Any) -> tuple[TiedParameter, ...]:
    return architecture(model_cfg).tied


def build_layer(model_cfg: Any, index: int, seed: int, *, device: Any = None, initialise: bool = True) -> "nn.Module":
    """Layer ``index`` of ``model_cfg``'s model, initialised from ``(seed, index, model_cfg)`` only."""
    from oobleck.models.spec import model_spec

    layer_name(model_cfg, index)
    return model_spec(model_cfg, seed).build_layer(index, device, initialise)


def build_layers(model_cfg: Any, seed: int, indices: Any, *, device: Any = None) -> "list[nn.Module]":
    from oobleck.models.spec import model_spec

    return model_spec(model_cfg, seed).build_layers(indices, device)


def build_reference_model(model_cfg: Any, seed: int, *, device: Any = None) -> "nn.Sequential":
    """All layers as one ``nn.Sequential`` with the tied weight as ONE parameter (``ModelSpec.reference_model``)."""
    from oobleck.models.spec import model_spec

    return model_spec(model_cfg, seed).reference_model(device)


_NEEDS_TORCH = {
    "oobleck.models.spec": ("ModelSpec", "model_spec"),
    "oobleck.models.common": ("lm_loss",),
}


def __getattr__(name: str) -> Any:
    import importlib

    if name == "loss_fn":
        name = "lm_loss"
    for module, names in _NEEDS_TORCH.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'oobleck.models' has no attribute {name!r}")


__all__ = [
    "FAMILIES",
    "Architecture",
    "LayerCost",
    "ModelFamily",
    "ModelSpec",
    "TiedParameter",
    "architecture",
    "build_layer",
    "build_layers",
    "build_reference_model",
    "family_of",
    "layer_name",
    "loss_fn",
    "model_config",
    "model_spec",
    "num_layers",
    "parameter_count",
    "tied_parameters",
]

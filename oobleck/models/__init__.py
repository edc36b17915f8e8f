"""Layered models: a model is an ordered list of layers (the GPT family), so any contiguous range
of layers is a pipeline stage. See ``oobleck.models.gpt`` for the layers and their seeded init."""

from oobleck.models.configs import load_model_config, model_names
from oobleck.models.gpt import (
    TiedParameter,
    build_layer,
    build_layers,
    build_reference_model,
    layer_name,
    loss_fn,
    num_layers,
    parameter_count,
    tied_parameters,
)

__all__ = [
    "TiedParameter",
    "build_layer",
    "build_layers",
    "build_reference_model",
    "layer_name",
    "load_model_config",
    "model_names",
    "loss_fn",
    "num_layers",
    "parameter_count",
    "tied_parameters",
]

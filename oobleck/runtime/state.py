"""A layer's training state built from a model config (``new_layer_state``), and the names of
``oobleck.layer_state`` under their former home.

The state itself (``LayerState``, its flat ``[3, numel]`` tensor, checksums, the learning-rate
schedule) lives in ``oobleck.layer_state``, below both the runtime and the checkpoints; import it
from there. The names are re-exported here so code written against ``oobleck.runtime.state`` keeps
working.
"""

from __future__ import annotations

from typing import Any

from oobleck.layer_state import (
    STATE_KINDS,
    LayerState,
    chunk_bounds,
    chunk_rows,
    flat_state,
    flat_state_into,
    install_flat_state,
    layer_checksum,
    layer_state,
    learning_rate,
    set_learning_rate,
    set_step,
    tensor_hash,
)
from oobleck.models.spec import model_spec

__all__ = [
    "STATE_KINDS",
    "LayerState",
    "chunk_bounds",
    "chunk_rows",
    "flat_state",
    "flat_state_into",
    "install_flat_state",
    "layer_checksum",
    "layer_state",
    "learning_rate",
    "new_layer_state",
    "set_learning_rate",
    "set_step",
    "tensor_hash",
]


def new_layer_state(
    model_cfg: Any, job: Any, index: int, seed: int, device: str, committed_steps: int = 0
) -> LayerState:
    """``layer_state`` of the model ``model_cfg`` describes, initialised from ``seed``."""
    return layer_state(model_spec(model_cfg, seed), job, index, device, committed_steps)

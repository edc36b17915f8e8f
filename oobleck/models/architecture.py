"""A model family's torch-free description: what the planner, the analytic profiler and the simulator
need to know about a layered model without building it.

A model is an ordered list of layers, so any contiguous range of them is a pipeline stage. Its
``Architecture`` names the layers, says which two share a weight, and costs each layer for one
microbatch (``LayerCost``): parameters, FLOPs of the forward pass and of the two halves of the
backward pass (input gradients and weight gradients: what a zero-bubble schedule runs apart),
the memory traffic a roofline needs, the activations kept for backward and the tensor sent to
the next stage. ``ModelFamily`` is what a family registers (``oobleck.models.registry``): its
config dataclass (the schema of a ``conf/model/<name>.yaml`` of that family), the function that
describes a config of it, and the module whose ``spec(config, seed)`` builds it in torch
(``oobleck.models.spec``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Layer kinds: the unit of per-layer-type reports (achieved fraction of peak, measured vs analytic).
EMBEDDING = "embedding"
BLOCK = "block"
HEAD = "head"


@dataclass(frozen=True)
class LayerCost:
    """One layer for one microbatch, from the architecture alone (counts, not seconds).

    FLOPs count a multiply-add as two. ``*_bytes`` of memory traffic is what a roofline divides by
    the memory bandwidth; ``activation_bytes`` stay on the device from a microbatch's forward until
    its backward; ``output_bytes`` is the boundary tensor sent to the next stage (0 for the last
    layer). Sizes of activations depend on the bytes per value the costing assumed.
    """

    name: str  # embedding, block<i>, head
    kind: str  # EMBEDDING | BLOCK | HEAD
    params: int
    forward_flops: float
    backward_input_flops: float  # gradients of the layer's input (0 when its input is token ids)
    backward_weight_flops: float  # gradients of its parameters
    forward_bytes: float
    backward_bytes: float
    activation_bytes: int
    output_bytes: int

    @property
    def backward_flops(self) -> float:
        return self.backward_input_flops + self.backward_weight_flops


@dataclass(frozen=True)
class TiedParameter:
    """One weight shared by two layers: ``names[k]`` is its parameter name inside ``layers[k]``."""

    layers: tuple[int, int]
    names: tuple[str, str]


@dataclass(frozen=True)
class Architecture:
    """A model config of some family, described without torch (see the module docstring).

    ``layer_cost(index, microbatch_size, bytes_per_value)`` costs layer ``index`` for a microbatch
    of that many sequences with activations of ``bytes_per_value`` bytes each (2 for bf16/fp16,
    4 for fp32).
    """

    family: str
    name: str
    config: Any  # the family's frozen config dataclass
    layer_names: tuple[str, ...]
    layer_kinds: tuple[str, ...]
    seq_len: int
    vocab_size: int
    width: int  # values per token of the boundary tensor between two layers
    tied: tuple[TiedParameter, ...]  # weights two layers share (the runtime sums their gradients)
    layer_cost: Callable[[int, int, int], LayerCost]
    params: Callable[[int], int]  # parameters of layer ``index``

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def tied_pairs(self) -> tuple[tuple[int, int], ...]:
        """The layer pairs that hold one shared weight (``ModelProfile.tied_layers``)."""
        return tuple(t.layers for t in self.tied)

    def total_params(self) -> int:
        """Parameters of the model, a tied weight counted once (it is the token embedding, the one
        weight our families tie: ``vocab_size x width``)."""
        return sum(self.params(i) for i in range(self.num_layers)) - len(self.tied) * self.vocab_size * self.width


@dataclass(frozen=True)
class ModelFamily:
    """What a family registers: its config schema, its description, and where its torch code is.

    ``config``: the frozen dataclass that types a ``model:`` section of this family (every field
    without a default: the values live in ``conf/model/<name>.yaml``); ``check(config)`` raises
    ``ConfigError`` for values the types allow but the family does not (a head count that does
    not divide the width); ``describe(config)`` gives the ``Architecture``; ``layers_module``
    names the module whose ``spec(config, seed)`` returns the torch ``ModelSpec``.
    """

    name: str
    config: type
    check: Callable[[Any], None]
    describe: Callable[[Any], Architecture]
    layers_module: str

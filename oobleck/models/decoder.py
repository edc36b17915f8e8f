"""What the decoder-only families (GPT, Llama-style) share, without torch: the layer layout, the
checks every such config needs, the ``Architecture`` built from a family's costs, and the cost of a
layer made of weight products.

Layout: layer 0 is the token embedding, layers 1..n_layer are the blocks, and the last layer is the
final norm plus the output head: ``num_layers = n_layer + 2``, so plans and tests written for one
family fit the other. A family keeps what differs (its config, its parameter counts, its
activation sizes, its embedding's cost) in its own package; ``oobleck.models.common`` holds the
torch side of the same plumbing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from oobleck.errors import ConfigError
from oobleck.models.architecture import BLOCK, EMBEDDING, HEAD, Architecture, LayerCost, TiedParameter

FP32_BYTES = 4
INDEX_BYTES = 8  # int64 token ids


class DecoderConfig(Protocol):
    """The fields every decoder family's config has (read-only: the configs are frozen)."""

    @property
    def name(self) -> str: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def n_embd(self) -> int: ...
    @property
    def n_head(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def tie_embeddings(self) -> bool: ...


def check_shape(config: DecoderConfig, positive: Sequence[str]) -> None:
    """The keys in ``positive`` are positive integers and the heads divide the width."""
    for key in positive:
        if getattr(config, key) <= 0:
            raise ConfigError(f"model.{key}={getattr(config, key)} must be a positive integer")
    if config.n_embd % config.n_head:
        raise ConfigError(
            f"model.n_embd={config.n_embd} is not divisible by model.n_head={config.n_head}; "
            "choose a head count that divides the width"
        )


def num_layers(config: DecoderConfig) -> int:
    return config.n_layer + 2


def layer_name(config: DecoderConfig, index: int) -> str:
    """``embedding``, ``block<i>`` (0-based block number) or ``head``."""
    last = num_layers(config) - 1
    if not 0 <= index <= last:
        raise ConfigError(f"layer index {index} is outside 0..{last} for model {config.name!r}")
    if index == 0:
        return EMBEDDING
    if index == last:
        return HEAD
    return f"block{index - 1}"


def embedding_cost(
    name: str, params: int, tokens: int, width: int, bytes_per_value: int, rows_per_token: int, extra_activation: int
) -> LayerCost:
    """The embedding: a memory-bound gather of ``rows_per_token`` rows per token, summed and
    written (FLOPs one per value); its input (token ids) takes no gradient, and backward
    scatters the output gradient into a dense fp32 gradient. It keeps the token ids and
    ``extra_activation`` bytes (a dropout mask) for backward."""
    gather = float(tokens * width)
    boundary = tokens * width * bytes_per_value
    return LayerCost(
        name=name,
        kind=EMBEDDING,
        params=params,
        forward_flops=gather,
        backward_input_flops=0.0,
        backward_weight_flops=gather,
        forward_bytes=(rows_per_token + 1) * boundary,
        backward_bytes=params * FP32_BYTES + rows_per_token * boundary,
        activation_bytes=tokens * INDEX_BYTES + extra_activation,
        output_bytes=boundary,
    )


def product_layer_cost(
    name: str,
    kind: str,
    params: int,
    weight_flops: float,
    attention_flops: float,
    activation_bytes: int,
    bytes_per_value: int,
    output_bytes: int,
) -> LayerCost:
    """A layer of weight products (and attention, 0 for the head): the input gradients redo every
    product once and the attention twice, the weight gradients redo the products once; its memory
    traffic is its parameters plus the activations it writes, twice that for backward."""
    traffic = params * bytes_per_value + activation_bytes
    return LayerCost(
        name=name,
        kind=kind,
        params=params,
        forward_flops=weight_flops + attention_flops,
        backward_input_flops=weight_flops + 2 * attention_flops,
        backward_weight_flops=weight_flops,
        forward_bytes=traffic,
        backward_bytes=2 * traffic,
        activation_bytes=activation_bytes,
        output_bytes=output_bytes,
    )


def describe(
    family: str,
    config: DecoderConfig,
    tied_names: tuple[str, str],
    layer_cost: Callable[[int, int, int], LayerCost],
    params: Callable[[int], int],
) -> Architecture:
    """The ``Architecture`` of ``config``: ``tied_names`` are the parameter names of the tied
    weight in the embedding and in the head (tied only with ``tie_embeddings``); ``layer_cost``
    and ``params`` are the family's, bound to ``config``."""
    names = tuple(layer_name(config, i) for i in range(num_layers(config)))
    last = num_layers(config) - 1
    return Architecture(
        family=family,
        name=config.name,
        config=config,
        layer_names=names,
        layer_kinds=tuple(BLOCK if n.startswith(BLOCK) else n for n in names),
        seq_len=config.seq_len,
        vocab_size=config.vocab_size,
        width=config.n_embd,
        tied=(TiedParameter(layers=(0, last), names=tied_names),) if config.tie_embeddings else (),
        layer_cost=layer_cost,
        params=params,
    )

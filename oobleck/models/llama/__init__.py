"""The Llama-style decoder family (Llama 3's shape: RMSNorm, rotary position embeddings, SwiGLU,
grouped-query attention, an untied output head): its config, its layers and their costs, without
torch. ``oobleck.models.llama.model`` builds it.

Layer 0 is the token embedding (no learned positions: rotary embeddings inside attention carry
them), layers 1..n_layer are pre-RMSNorm blocks, and the last layer is the final RMSNorm plus the
output projection: ``num_layers = n_layer + 2``, the same layout as the GPT family, so plans and
tests written for one fit the other. Sizes of the published models are in ``conf/model/llama3_*``
(Meta's "The Llama 3 Herd of Models", 2024, Table 3).

Costs of one microbatch of b sequences of length T, width C, h query heads of width d = C/h,
g key/value heads, SwiGLU hidden width F, vocabulary V:
- block forward FLOPs: weight products ``2 b T (2 C^2 + 2 C g d) + 6 b T C F`` (queries and
  output C x C, keys and values C x g d, three SwiGLU matrices) plus ``4 b T^2 C`` in attention
  (grouping key/value heads saves memory, not FLOPs; counted in full as for GPT); backward splits
  as GPT's does: input gradients redo the products once and the attention twice, weight
  gradients redo the products once;
- activations kept for backward: memory-efficient (flash) attention, as Llama 3 is trained,
  keeps its inputs and output and a per-row log-sum-exp, not the T x T probabilities. Per token:
  each RMSNorm's input and output (4 C), queries C, keys and values 2 g d, the attention output and
  the output projection's input (2 C), SwiGLU's gate and up products, the gate's SiLU and their
  product (4 F): ``7 C + 2 g d + 4 F`` values, plus fp32 statistics (two RMSNorm scales, h
  log-sum-exps);
- head: ``2 b T C V``; it keeps its RMSNorm input and output and fp32 logits for the cross entropy;
  the embedding gathers one row per token and its input (token ids) takes no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from omegaconf import MISSING

from oobleck.errors import ConfigError
from oobleck.models import decoder
from oobleck.models.architecture import BLOCK, EMBEDDING, HEAD, Architecture, LayerCost, ModelFamily
from oobleck.models.decoder import FP32_BYTES, embedding_cost, layer_name, product_layer_cost

# The tied pair's parameter names inside the embedding and the head (``llama.model``).
TIED_EMBEDDING_PARAM = "tok_embeddings.weight"
TIED_HEAD_PARAM = "output.weight"


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-style model (``family: llama``); ``conf/model/<name>.yaml`` holds the sizes."""

    family: str = MISSING
    name: str = MISSING
    n_layer: int = MISSING  # decoder blocks (the layered model adds embedding and head)
    n_embd: int = MISSING  # model width
    n_head: int = MISSING  # query heads
    n_kv_head: int = MISSING  # key/value heads (grouped-query attention; = n_head: multi-head)
    ffn_hidden: int = MISSING  # SwiGLU hidden width
    vocab_size: int = MISSING
    seq_len: int = MISSING
    rope_theta: float = MISSING  # base of the rotary embedding's frequencies
    norm_eps: float = MISSING  # RMSNorm epsilon
    init_std: float = MISSING
    tie_embeddings: bool = MISSING  # tied token embedding and output head


def check(config: LlamaConfig) -> None:
    decoder.check_shape(config, ("n_layer", "n_embd", "n_head", "n_kv_head", "ffn_hidden", "vocab_size", "seq_len"))
    if (config.n_embd // config.n_head) % 2:
        raise ConfigError(
            f"model.n_embd / model.n_head = {config.n_embd // config.n_head} is odd; rotary embeddings rotate pairs "
            "of values, so each head needs an even width"
        )
    if config.n_head % config.n_kv_head:
        raise ConfigError(
            f"model.n_head={config.n_head} is not a multiple of model.n_kv_head={config.n_kv_head}; each key/value "
            "head serves an equal group of query heads"
        )
    for key in ("rope_theta", "norm_eps", "init_std"):
        if not getattr(config, key) > 0.0:
            raise ConfigError(f"model.{key}={getattr(config, key)} must be > 0")


def kv_width(config: LlamaConfig) -> int:
    """Values per token of the keys (and of the values): g heads of width C / h."""
    return config.n_kv_head * (config.n_embd // config.n_head)


def parameter_count(config: LlamaConfig, index: int) -> int:
    c, v, f, kv = config.n_embd, config.vocab_size, config.ffn_hidden, kv_width(config)
    name = layer_name(config, index)
    if name == EMBEDDING:
        return v * c
    if name == HEAD:
        return c + c * v  # final RMSNorm, output projection (no bias anywhere)
    return 2 * c + (2 * c * c + 2 * c * kv) + 3 * c * f  # two RMSNorms, q o k v, w1 w2 w3


def block_activation_bytes(config: LlamaConfig, microbatch_size: int, bytes_per_value: int) -> int:
    tokens = microbatch_size * config.seq_len
    values = 7 * config.n_embd + 2 * kv_width(config) + 4 * config.ffn_hidden
    statistics = (2 + config.n_head) * FP32_BYTES
    return tokens * (values * bytes_per_value + statistics)


def layer_cost(config: LlamaConfig, index: int, microbatch_size: int, bytes_per_value: int) -> LayerCost:
    b, t, c, v = microbatch_size, config.seq_len, config.n_embd, config.vocab_size
    p = bytes_per_value
    name = layer_name(config, index)
    params = parameter_count(config, index)
    boundary = b * t * c * p
    if name == EMBEDDING:  # one row per token, no dropout
        return embedding_cost(name, params, b * t, c, p, 1, 0)
    if name == HEAD:
        product = 2.0 * b * t * c * v
        activation = 2 * boundary + b * t * (FP32_BYTES + v * FP32_BYTES)  # norm in/out, its scale, fp32 logits
        return product_layer_cost(name, HEAD, params, product, 0.0, activation, p, 0)
    kv, f = kv_width(config), config.ffn_hidden
    weights = float(2 * b * t * (2 * c * c + 2 * c * kv) + 6 * b * t * c * f)
    attention = float(4 * b * t * t * c)
    activation = block_activation_bytes(config, b, p)
    return product_layer_cost(name, BLOCK, params, weights, attention, activation, p, boundary)


def describe(config: LlamaConfig) -> Architecture:
    tied = (TIED_EMBEDDING_PARAM, TIED_HEAD_PARAM)
    return decoder.describe("llama", config, tied, partial(layer_cost, config), partial(parameter_count, config))


FAMILY = ModelFamily(
    name="llama", config=LlamaConfig, check=check, describe=describe, layers_module="oobleck.models.llama.model"
)

"""The layered GPT family (GPT-2 / GPT-3 shape; BERT-large's sizes run in it too): its config, its
layers and their costs, without torch. ``oobleck.models.gpt.model`` builds it.

Layer 0 is the input embedding (token + learned position), layers 1..n_layer are pre-LayerNorm
transformer blocks, and the last layer is the final LayerNorm plus the LM head:
``num_layers = n_layer + 2``; with ``tie_embeddings`` the head's weight is the embedding's.

Costs of one microbatch of b sequences of length T, width C, MLP width f*C, vocabulary V, a heads:
- block forward FLOPs ``(8 + 4f) b T C^2`` in weight matrix products (QKV 6, output projection 2,
  MLP 4f) plus ``4 b T^2 C`` in attention (scores and weighted sum; counted in full, as
  Megatron-LM's formula does); backward twice that: the input gradients redo every product
  (``(8 + 4f) b T C^2``) and the attention's twice (``8 b T^2 C``), the weight gradients redo the
  weight products once more;
- head forward ``2 b T C V`` (one weight product: input and weight gradients alike); the embedding
  is a memory-bound gather whose input (token ids) takes no gradient;
- activations kept for backward (16-bit values, no recomputation): Korthikanti et al., "Reducing
  Activation Recomputation in Large Transformer Models" (MLSys'23), eq. 1: ``T b C (34 + 5 a T / C)``
  bytes per block at 2 bytes per value (attention probabilities stored, as in Megatron-LM without
  flash attention), scaled by ``bytes_per_value / 2`` and by the MLP width when f != 4; the head
  keeps its LayerNorm and product inputs and fp32 logits for the cross entropy;
- memory traffic (the roofline's other term): parameters at ``bytes_per_value`` plus the
  activations written, twice that for backward; the embedding reads and writes its boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from omegaconf import MISSING

from oobleck.errors import ConfigError
from oobleck.models import decoder
from oobleck.models.architecture import BLOCK, EMBEDDING, HEAD, Architecture, LayerCost, ModelFamily
from oobleck.models.decoder import FP32_BYTES, embedding_cost, layer_name, product_layer_cost

# The tied pair's parameter names inside the embedding and the head (``gpt.model``).
TIED_EMBEDDING_PARAM = "wte.weight"
TIED_HEAD_PARAM = "lm_head.weight"
DROPOUT_MASK_BYTES = 1  # per value


@dataclass(frozen=True)
class GPTConfig:
    """A GPT-family model (``family: gpt``); ``conf/model/<name>.yaml`` holds the published sizes."""

    family: str = MISSING
    name: str = MISSING
    n_layer: int = MISSING  # transformer blocks (the layered model adds embedding and head)
    n_embd: int = MISSING
    n_head: int = MISSING
    vocab_size: int = MISSING
    seq_len: int = MISSING
    ffn_mult: int = MISSING  # MLP width / model width
    dropout: float = MISSING
    init_std: float = MISSING
    tie_embeddings: bool = MISSING  # tied input embedding and LM head (trained exactly)


def check(config: GPTConfig) -> None:
    decoder.check_shape(config, ("n_layer", "n_embd", "n_head", "vocab_size", "seq_len", "ffn_mult"))
    if not 0.0 <= config.dropout < 1.0:
        raise ConfigError(f"model.dropout={config.dropout} must be in [0, 1)")
    if not config.init_std > 0.0:
        raise ConfigError(f"model.init_std={config.init_std} must be > 0")


def parameter_count(config: GPTConfig, index: int) -> int:
    c, v, t, f = config.n_embd, config.vocab_size, config.seq_len, config.ffn_mult
    name = layer_name(config, index)
    if name == EMBEDDING:
        return v * c + t * c
    if name == HEAD:
        return 2 * c + v * c  # final LayerNorm, LM head without bias
    # two LayerNorms, QKV + output projections with biases, MLP with biases
    return 4 * c + (3 * c * c + 3 * c) + (c * c + c) + (f * c * c + f * c) + (f * c * c + c)


def block_activation_bytes(config: GPTConfig, microbatch_size: int, bytes_per_value: int) -> int:
    b, t, c, a, f = microbatch_size, config.seq_len, config.n_embd, config.n_head, config.ffn_mult
    # Korthikanti et al.: 34 T b C + 5 a T^2 b bytes at 2 bytes/value; the MLP's 4C-wide
    # intermediate (GeLU input and output) accounts for 16 of the 34 when f = 4.
    per_token_width = 34 + 4 * (f - 4)
    return int((t * b * c * per_token_width + 5 * a * t * t * b) * bytes_per_value / 2)


def layer_cost(config: GPTConfig, index: int, microbatch_size: int, bytes_per_value: int) -> LayerCost:
    b, t, c, v, f = microbatch_size, config.seq_len, config.n_embd, config.vocab_size, config.ffn_mult
    p = bytes_per_value
    name = layer_name(config, index)
    params = parameter_count(config, index)
    boundary = b * t * c * p
    if name == EMBEDDING:  # token and position rows; dropout keeps its mask
        return embedding_cost(name, params, b * t, c, p, 2, b * t * c * DROPOUT_MASK_BYTES)
    if name == HEAD:
        product = 2.0 * b * t * c * v
        # LayerNorm and LM-head inputs at bytes_per_value plus fp32 logits for the cross entropy.
        activation = 2 * boundary + b * t * v * FP32_BYTES
        return product_layer_cost(name, HEAD, params, product, 0.0, activation, p, 0)
    weights = float((8 + 4 * f) * b * t * c * c)
    attention = float(4 * b * t * t * c)
    activation = block_activation_bytes(config, b, p)
    return product_layer_cost(name, BLOCK, params, weights, attention, activation, p, boundary)


def describe(config: GPTConfig) -> Architecture:
    tied = (TIED_EMBEDDING_PARAM, TIED_HEAD_PARAM)
    return decoder.describe("gpt", config, tied, partial(layer_cost, config), partial(parameter_count, config))


FAMILY = ModelFamily(
    name="gpt", config=GPTConfig, check=check, describe=describe, layers_module="oobleck.models.gpt.model"
)

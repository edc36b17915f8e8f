"""The layered GPT family: a model is an ordered list of layers, so any contiguous range is a stage.

Layer 0 is the input embedding (token + position), layers 1..n_layer are transformer blocks, and
the last layer is the final LayerNorm plus the LM head: ``num_layers = n_layer + 2``.

Initial weights depend only on ``(seed, layer index, parameter name, model config)``: every
parameter is drawn from its own ``torch.Generator`` seeded from those, on the CPU, so any process
that builds layer l gets the same bits whatever else it builds and on whichever device it puts
them. With tied embeddings the LM head's weight is drawn from the embedding's key, so the two
copies the layered form holds start identical; the runtime keeps them identical by summing their
gradients across the stages that hold layer 0 and the last layer (see ``tied_parameters``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from oobleck.errors import ConfigError

EMBEDDING_NAME = "embedding"
HEAD_NAME = "head"
TIED_EMBEDDING_PARAM = "wte.weight"
TIED_HEAD_PARAM = "lm_head.weight"


@dataclass(frozen=True)
class TiedParameter:
    """One weight shared by two layers: ``names[k]`` is its parameter name inside ``layers[k]``."""

    layers: tuple[int, int]
    names: tuple[str, str]


def _check(model_cfg: Any) -> None:
    for key in ("n_layer", "n_embd", "n_head", "vocab_size", "seq_len", "ffn_mult"):
        value = getattr(model_cfg, key)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"model.{key}={value!r} must be a positive integer")
    if model_cfg.n_embd % model_cfg.n_head:
        raise ConfigError(
            f"model.n_embd={model_cfg.n_embd} is not divisible by model.n_head={model_cfg.n_head}; "
            "choose a head count that divides the width"
        )


def num_layers(model_cfg: Any) -> int:
    """Embedding + ``n_layer`` blocks + final (norm and LM head)."""
    return int(model_cfg.n_layer) + 2


def layer_name(model_cfg: Any, index: int) -> str:
    """``embedding``, ``block<i>`` (0-based block number) or ``head``."""
    last = num_layers(model_cfg) - 1
    if not 0 <= index <= last:
        raise ConfigError(f"layer index {index} is outside 0..{last} for model {model_cfg.name!r}")
    if index == 0:
        return EMBEDDING_NAME
    if index == last:
        return HEAD_NAME
    return f"block{index - 1}"


def tied_parameters(model_cfg: Any) -> tuple[TiedParameter, ...]:
    """The weights shared between layers; ``()`` when ``model.tie_embeddings`` is false."""
    if not model_cfg.tie_embeddings:
        return ()
    return (TiedParameter(layers=(0, num_layers(model_cfg) - 1), names=(TIED_EMBEDDING_PARAM, TIED_HEAD_PARAM)),)


class Embedding(nn.Module):
    """Layer 0: token + learned position embedding. ``[b, T]`` token ids -> ``[b, T, C]``."""

    def __init__(self, vocab_size: int, seq_len: int, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[-1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(positions))


class SelfAttention(nn.Module):
    """Causal multi-head self-attention (fused QKV projection, scaled-dot-product kernel)."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.c_proj(y.transpose(1, 2).reshape(b, t, c)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, ffn_mult: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, ffn_mult * n_embd)
        self.c_proj = nn.Linear(ffn_mult * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """A pre-LayerNorm transformer block. ``[b, T, C]`` -> ``[b, T, C]``."""

    def __init__(self, n_embd: int, n_head: int, ffn_mult: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = SelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, ffn_mult, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """The last layer: final LayerNorm + LM head. ``[b, T, C]`` -> logits ``[b, T, V]``."""

    def __init__(self, n_embd: int, vocab_size: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def _generator(seed: int, index: int, param: str) -> torch.Generator:
    # A stable 63-bit seed per (model seed, layer, parameter): Python's hash() is salted per
    # process, so derive it with a fixed digest instead.
    digest = hashlib.sha256(f"oobleck-init:{seed}:{index}:{param}".encode()).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return generator


def initialise_layer(module: nn.Module, model_cfg: Any, index: int, seed: int) -> None:
    """Set every parameter of layer ``index`` (a module ``build_layer`` made) in place, on
    whichever device it is. GPT-2-style init: N(0, init_std) for weights and embeddings, the residual projections
    scaled by 1/sqrt(2 n_layer), zero biases, unit LayerNorm gains."""
    last = num_layers(model_cfg) - 1
    residual_std = model_cfg.init_std / math.sqrt(2 * model_cfg.n_layer)
    with torch.no_grad():
        for name, param in module.named_parameters():
            key_index, key_name = index, name
            if model_cfg.tie_embeddings and index == last and name == TIED_HEAD_PARAM:
                key_index, key_name = 0, TIED_EMBEDDING_PARAM  # identical start for the tied copy
            owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
            if isinstance(owner, nn.LayerNorm):
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                std = residual_std if name.endswith("c_proj.weight") else model_cfg.init_std
                values = torch.empty(param.shape, dtype=torch.float32)
                values.normal_(0.0, std, generator=_generator(seed, key_index, key_name))
                param.copy_(values)


def build_layer(
    model_cfg: Any, index: int, seed: int, *, device: torch.device | str | None = None, initialise: bool = True
) -> nn.Module:
    """Layer ``index`` of the model, initialised from ``(seed, index, model_cfg)`` only.

    The values are drawn on the CPU in fp32 and copied to ``device`` (so the bits never depend
    on the device's random number generator). The module is created on the meta device and only
    then given memory: ``initialise_layer`` sets every parameter, so torch's own default
    initialisation (a second random fill of every weight, a large share of building an
    embedding of gpt2_small's 50k x 768) would be thrown away. With ``initialise`` false the
    parameters are left uninitialised, for a layer whose state is about to be overwritten.
    """
    _check(model_cfg)
    name = layer_name(model_cfg, index)
    dropout = float(model_cfg.dropout)
    with torch.device("meta"):
        if name == EMBEDDING_NAME:
            module: nn.Module = Embedding(model_cfg.vocab_size, model_cfg.seq_len, model_cfg.n_embd, dropout)
        elif name == HEAD_NAME:
            module = Head(model_cfg.n_embd, model_cfg.vocab_size)
        else:
            module = Block(model_cfg.n_embd, model_cfg.n_head, model_cfg.ffn_mult, dropout)
    module.to_empty(device=device if device is not None else "cpu")
    if initialise:
        initialise_layer(module, model_cfg, index, seed)
    return module


def build_layers(
    model_cfg: Any, seed: int, indices: Iterable[int], *, device: torch.device | str | None = None
) -> list[nn.Module]:
    """``build_layer`` for each index, in the order given."""
    return [build_layer(model_cfg, index, seed, device=device) for index in indices]


def build_reference_model(model_cfg: Any, seed: int, *, device: torch.device | str | None = None) -> nn.Sequential:
    """All layers as one ``nn.Sequential`` with the tied weights as ONE ``Parameter``.

    This is the single-process truth: the layered form, with the gradients of each tied pair
    summed, must produce the same outputs and gradients.
    """
    model = nn.Sequential(*build_layers(model_cfg, seed, range(num_layers(model_cfg)), device=device))
    for tied in tied_parameters(model_cfg):
        (src_layer, dst_layer), (src_name, dst_name) = tied.layers, tied.names
        shared = model[src_layer].get_parameter(src_name)
        owner_path, attr = dst_name.rsplit(".", 1)
        setattr(model[dst_layer].get_submodule(owner_path), attr, shared)
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed-over-samples language-model loss of a microbatch.

    Cross entropy summed over every token (``reduction="sum"``) and divided by the sequence
    length: the sum over samples of each sample's mean token loss. The runtime divides by the
    number of samples in the global batch, which makes the total exactly the usual mean token
    cross entropy of the global batch, however the batch is split into microbatches.
    """
    vocab = logits.shape[-1]
    total = F.cross_entropy(logits.reshape(-1, vocab).float(), targets.reshape(-1), reduction="sum")
    return total / targets.shape[-1]


def parameter_count(model_cfg: Any, index: int) -> int:
    """Parameters of layer ``index`` from the config alone (no tensors allocated)."""
    c, v, t, f = model_cfg.n_embd, model_cfg.vocab_size, model_cfg.seq_len, model_cfg.ffn_mult
    name = layer_name(model_cfg, index)
    if name == EMBEDDING_NAME:
        return v * c + t * c
    if name == HEAD_NAME:
        return 2 * c + v * c
    # two LayerNorms, QKV + output projections with biases, MLP with biases
    return 4 * c + (3 * c * c + 3 * c) + (c * c + c) + (f * c * c + f * c) + (f * c * c + c)

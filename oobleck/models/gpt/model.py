"""The layered GPT in torch: embedding, pre-LayerNorm blocks, final LayerNorm + LM head
(``oobleck.models.gpt`` has the config, the layer list and the costs).

Initial values (GPT-2's rule): N(0, init_std) for weights and embeddings, the residual projections
scaled by 1/sqrt(2 n_layer), zero biases, unit LayerNorm gains; each parameter from its own seeded
generator (``oobleck.models.common``). With tied embeddings the LM head's weight is drawn from the
embedding's key, so the two copies the layered form holds start identical; the runtime keeps them
identical by summing their gradients across the stages that hold layer 0 and the last layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from oobleck.models.architecture import EMBEDDING, HEAD
from oobleck.models.common import decoder_spec, seeded_generator
from oobleck.models.decoder import num_layers
from oobleck.models.gpt import TIED_EMBEDDING_PARAM, TIED_HEAD_PARAM, GPTConfig, describe
from oobleck.models.spec import ModelSpec


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


def make_layer(config: GPTConfig, kind: str) -> nn.Module:
    """A layer of ``kind`` (embedding, block or head), its parameters not yet set."""
    dropout = float(config.dropout)
    if kind == EMBEDDING:
        return Embedding(config.vocab_size, config.seq_len, config.n_embd, dropout)
    if kind == HEAD:
        return Head(config.n_embd, config.vocab_size)
    return Block(config.n_embd, config.n_head, config.ffn_mult, dropout)


def initialise_layer(module: nn.Module, config: GPTConfig, index: int, seed: int) -> None:
    """Set every parameter of layer ``index`` (a module ``make_layer`` made) in place, on
    whichever device it is (see the module docstring for the rule)."""
    last = num_layers(config) - 1
    residual_std = config.init_std / math.sqrt(2 * config.n_layer)
    with torch.no_grad():
        for name, param in module.named_parameters():
            key_index, key_name = index, name
            if config.tie_embeddings and index == last and name == TIED_HEAD_PARAM:
                key_index, key_name = 0, TIED_EMBEDDING_PARAM  # identical start for the tied copy
            owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
            if isinstance(owner, nn.LayerNorm):
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                std = residual_std if name.endswith("c_proj.weight") else config.init_std
                values = torch.empty(param.shape, dtype=torch.float32)
                values.normal_(0.0, std, generator=seeded_generator(seed, key_index, key_name))
                param.copy_(values)


def spec(config: GPTConfig, seed: int) -> ModelSpec:
    """The runtime's view of the layered GPT ``config`` with weights keyed by ``seed``."""
    return decoder_spec(
        describe(config),
        make=lambda kind: make_layer(config, kind),
        initialise=lambda module, index: initialise_layer(module, config, index, seed),
    )

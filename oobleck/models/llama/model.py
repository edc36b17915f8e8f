"""A Llama-style decoder in torch, as layers (``oobleck.models.llama`` has the config and costs).

Follows Meta's reference implementation (meta-llama/llama3, ``llama/model.py``): RMSNorm before
attention and before the feed-forward, rotary embeddings on queries and keys (pairs of adjacent
values rotated, frequencies ``theta^(-2i/d)``), grouped-query attention, a SwiGLU feed-forward
``w2(silu(w1 x) * w3 x)``, no biases, an untied output head. Where it differs: the rotation is
computed in each forward rather than from a cached table (a layer holds parameters only, so a
layer built as a shell and filled by the runtime is complete), no rope scaling for contexts
beyond training length, and attention is torch's ``scaled_dot_product_attention`` (flash on GPUs).

Initial values follow torchtitan's Llama 3 rule (pytorch/torchtitan, ``torchtitan/models/llama3/
__init__.py``): unit RMSNorm gains, N(0, 1) token embeddings, truncated N(0, init_std) for the
query, key, value and first SwiGLU matrices, the same scaled by ``1/sqrt(2 (block + 1))`` for the
output projection and the other two SwiGLU matrices ("depth init"), and truncated N(0, C^-1/2)
within 3 standard deviations for the output head; with tied embeddings the shared weight follows
the head's rule (torchtitan's tied 1B/3B models skip the embedding's own). Each value comes from
the parameter's own seeded generator (``oobleck.models.common``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from oobleck.models.architecture import BLOCK, EMBEDDING, HEAD
from oobleck.models.common import decoder_spec, seeded_generator
from oobleck.models.llama import TIED_EMBEDDING_PARAM, TIED_HEAD_PARAM, LlamaConfig, describe
from oobleck.models.spec import ModelSpec

EMBEDDING_STD = 1.0  # torchtitan's Llama 3 token-embedding init
HEAD_CUTOFF_STDS = 3.0  # torchtitan truncates the output head's init at 3 standard deviations
DEPTH_SCALED = ("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rotary_angles(
    seq_len: int, head_width: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position p times frequency ``theta^(-2i/d)``: ``[seq_len, 1, d/2]`` each."""
    frequencies = 1.0 / theta ** (torch.arange(0, head_width, 2, device=device, dtype=torch.float32) / head_width)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), frequencies)
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent pair of ``x`` (``[b, T, heads, d]``) by its position's angle: the real
    form of Meta's complex product ``view_as_complex(x) * freqs_cis``."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention: ``n_kv_head`` key/value heads, each shared by a group of queries."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        c, self.heads, self.kv_heads = config.n_embd, config.n_head, config.n_kv_head
        self.head_width, self.theta = c // config.n_head, config.rope_theta
        self.wq = nn.Linear(c, c, bias=False)
        self.wk = nn.Linear(c, self.kv_heads * self.head_width, bias=False)
        self.wv = nn.Linear(c, self.kv_heads * self.head_width, bias=False)
        self.wo = nn.Linear(c, c, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_width)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_width)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_width)
        cos, sin = rotary_angles(t, self.head_width, self.theta, x.device)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=self.kv_heads != self.heads,
        )
        return self.wo(y.transpose(1, 2).reshape(b, t, c))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, hidden, bias=False)
        self.w2 = nn.Linear(hidden, width, bias=False)
        self.w3 = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """A pre-RMSNorm decoder block. ``[b, T, C]`` -> ``[b, T, C]``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.feed_forward = FeedForward(config.n_embd, config.ffn_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Embedding(nn.Module):
    """Layer 0: token embedding. ``[b, T]`` token ids -> ``[b, T, C]``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.n_embd)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(ids)


class Head(nn.Module):
    """The last layer: final RMSNorm + output projection. ``[b, T, C]`` -> logits ``[b, T, V]``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.output = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))


def initial_values(config: LlamaConfig, index: int, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """Parameter ``name`` of layer ``index`` as its rule draws it (fp32, CPU; the module docstring)."""
    values = torch.empty(shape, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return values.fill_(1.0)
    shared = config.tie_embeddings and name in (TIED_EMBEDDING_PARAM, TIED_HEAD_PARAM)
    # Both copies of a tied weight are drawn from the embedding's key, so they start identical.
    generator = seeded_generator(seed, 0, TIED_EMBEDDING_PARAM) if shared else seeded_generator(seed, index, name)
    if shared or name == TIED_HEAD_PARAM:
        std = config.n_embd**-0.5
        cutoff = HEAD_CUTOFF_STDS * std
        return nn.init.trunc_normal_(values, 0.0, std, -cutoff, cutoff, generator=generator)
    if name == TIED_EMBEDDING_PARAM:
        return values.normal_(0.0, EMBEDDING_STD, generator=generator)
    std = config.init_std / math.sqrt(2 * index) if name in DEPTH_SCALED else config.init_std
    return nn.init.trunc_normal_(values, 0.0, std, generator=generator)


def initialise_layer(module: nn.Module, config: LlamaConfig, index: int, seed: int) -> None:
    """Set every parameter of layer ``index`` in place, wherever it lives."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(initial_values(config, index, name, param.shape, seed))


LAYERS: dict[str, type[nn.Module]] = {EMBEDDING: Embedding, BLOCK: Block, HEAD: Head}


def spec(config: LlamaConfig, seed: int) -> ModelSpec:
    """The runtime's view of the Llama-style ``config`` with weights keyed by ``seed``."""
    return decoder_spec(
        describe(config),
        make=lambda kind: LAYERS[kind](config),
        initialise=lambda module, index: initialise_layer(module, config, index, seed),
    )

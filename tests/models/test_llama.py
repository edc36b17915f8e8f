"""The Llama-style family: its mechanisms against independent formulations (Meta's complex-number
rotary embedding, grouped-query attention as repeated key/value heads, SwiGLU), the published
Llama 3 sizes, and its checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from oobleck.config import load_model_config
from oobleck.errors import ConfigError
from oobleck.models import architecture, model_spec
from oobleck.models.llama import model as llama
from oobleck.profiling import measure_profile

torch.set_num_threads(1)


def test_rotation_equals_metas_complex_form():
    """meta-llama/llama3 model.py: precompute_freqs_cis + apply_rotary_emb, reimplemented here."""
    b, t, h, d, theta = 2, 12, 3, 8, 500000.0
    x = torch.randn(b, t, h, d)
    freqs = 1.0 / (theta ** (torch.arange(0, d, 2)[: d // 2].float() / d))
    freqs_cis = torch.polar(torch.ones(t, d // 2), torch.outer(torch.arange(t).float(), freqs))
    expected = torch.view_as_real(torch.view_as_complex(x.reshape(b, t, h, -1, 2)) * freqs_cis[None, :, None, :])
    cos, sin = llama.rotary_angles(t, d, theta, x.device)
    torch.testing.assert_close(llama.rotate(x, cos, sin), expected.flatten(3), rtol=1e-6, atol=1e-6)
    # A rotation keeps each pair's length, and position 0 is not rotated.
    torch.testing.assert_close(llama.rotate(x, cos, sin).norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(llama.rotate(x, cos, sin)[:, 0], x[:, 0])


def test_grouped_query_attention_equals_repeated_key_value_heads():
    """Meta's repeat_kv: each key/value head serves n_head / n_kv_head consecutive query heads, so
    the layer equals multi-head attention whose key and value projections repeat those rows."""
    cfg = load_model_config("llama_tiny")
    attention = model_spec(cfg, 0).build_layer(1, None, True).attention
    group, width = cfg.n_head // cfg.n_kv_head, cfg.n_embd // cfg.n_head
    full = load_model_config("llama_tiny", n_kv_head=cfg.n_head)
    mha = model_spec(full, 0).build_layer(1, None, True).attention
    with torch.no_grad():
        mha.wq.weight.copy_(attention.wq.weight)
        mha.wo.weight.copy_(attention.wo.weight)
        for name in ("wk", "wv"):
            rows = getattr(attention, name).weight.view(cfg.n_kv_head, width, cfg.n_embd)
            getattr(mha, name).weight.copy_(rows.repeat_interleave(group, dim=0).reshape(cfg.n_embd, cfg.n_embd))
    x = torch.randn(2, cfg.seq_len, cfg.n_embd)
    torch.testing.assert_close(attention(x), mha(x), rtol=1e-5, atol=1e-6)


def test_swiglu_and_causality():
    cfg = load_model_config("llama_tiny")
    block = model_spec(cfg, 0).build_layer(1, None, True)
    ff = block.feed_forward
    x = torch.randn(2, 5, cfg.n_embd)
    torch.testing.assert_close(ff(x), F.silu(x @ ff.w1.weight.T) * (x @ ff.w3.weight.T) @ ff.w2.weight.T)
    # A token's output depends on earlier tokens only.
    x = torch.randn(1, cfg.seq_len, cfg.n_embd)
    changed = x.clone()
    changed[:, -1] += 1.0
    torch.testing.assert_close(block(x)[:, :-1], block(changed)[:, :-1])


@pytest.mark.parametrize(
    ("name", "billions", "rounding"),
    # The parameter counts Hugging Face shows for the released weights (meta-llama/Meta-Llama-3-8B,
    # Meta-Llama-3-70B, Llama-3.1-405B): 8.03B, 70.6B, 406B, to the digits shown.
    [("llama3_8b", 8.03, 0.005), ("llama3_70b", 70.6, 0.05), ("llama3_405b", 406, 0.5)],
)
def test_llama3_configs_have_their_published_sizes(name, billions, rounding):
    arch = architecture(load_model_config(name))
    assert arch.total_params() / 1e9 == pytest.approx(billions, abs=rounding)
    assert arch.family == "llama" and arch.tied == () and arch.seq_len == 8192 and arch.vocab_size == 128256


def test_the_activation_count_matches_what_autograd_saves():
    """The cost model's activations (flash attention: no T x T probabilities) against the bytes
    autograd saves in a real block and head on this CPU, whose attention kernel saves the same."""
    cfg = load_model_config("llama_tiny")
    measured = measure_profile(cfg, 2, "cpu", warmup=0, repeats=1, seed=0, threads=1)
    arch = architecture(cfg)
    for index in range(1, arch.num_layers - 1):
        expected = arch.layer_cost(index, 2, 4).activation_bytes
        assert measured.layers[index].activation_bytes == pytest.approx(expected, rel=0.1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_kv_head": 3}, "model.n_head=4 is not a multiple of model.n_kv_head=3"),
        ({"n_embd": 60, "n_head": 4}, "model.n_embd / model.n_head = 15 is odd"),
        ({"rope_theta": 0.0}, "model.rope_theta=0.0 must be > 0"),
        ({"ffn_hidden": 0}, "model.ffn_hidden=0 must be a positive integer"),
        ({"ffn_mult": 4}, "model.ffn_mult is not a config key"),
    ],
)
def test_bad_llama_config_is_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model_config("llama_tiny", **overrides)

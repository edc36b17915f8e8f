"""The layered GPT equals its single-process reference, and its init is a pure function of
(seed, layer index, config) across processes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from oobleck.errors import ConfigError
from oobleck.models import (
    build_layer,
    build_layers,
    build_reference_model,
    layer_name,
    load_model_config,
    loss_fn,
    num_layers,
    parameter_count,
    tied_parameters,
)

torch.set_num_threads(1)
SEED = 1234


def _tiny(**overrides):
    return load_model_config("gpt3_tiny", **{"n_layer": 3, "n_embd": 32, "n_head": 4, "seq_len": 16, **overrides})


def _batch(cfg, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=g)
    return ids, targets


def _digest(module) -> dict[str, str]:
    return {
        n: hashlib.sha256(p.detach().contiguous().numpy().tobytes()).hexdigest() for n, p in module.state_dict().items()
    }


def test_layer_count_and_names():
    cfg = _tiny()
    assert num_layers(cfg) == cfg.n_layer + 2
    assert [layer_name(cfg, i) for i in range(num_layers(cfg))] == ["embedding", "block0", "block1", "block2", "head"]
    with pytest.raises(ConfigError, match="layer index 5"):
        build_layer(cfg, 5, SEED)


def test_layer_shapes_and_param_counts():
    cfg = _tiny()
    ids, _ = _batch(cfg)
    x = ids
    for index, layer in enumerate(build_layers(cfg, SEED, range(num_layers(cfg)))):
        assert sum(p.numel() for p in layer.parameters()) == parameter_count(cfg, index)
        x = layer(x)
        expected = (3, cfg.seq_len, cfg.vocab_size if index == num_layers(cfg) - 1 else cfg.n_embd)
        assert tuple(x.shape) == expected and x.dtype == torch.float32


@pytest.mark.parametrize("tie", [True, False])
def test_layered_equals_reference_outputs_and_grads(tie):
    """Run the layers one after another (as stages would), sum the tied pair's gradients (as the
    runtime does across stages), and compare with the nn.Sequential reference with ONE tied weight."""
    cfg = _tiny(tie_embeddings=tie)
    ids, targets = _batch(cfg)
    reference = build_reference_model(cfg, SEED)
    layers = build_layers(cfg, SEED, range(num_layers(cfg)))

    ref_loss = loss_fn(reference(ids), targets)
    ref_loss.backward()
    x = ids
    for layer in layers:
        x = layer(x)
    loss = loss_fn(x, targets)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)

    grads = {(i, n): p.grad.clone() for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
    for tied in tied_parameters(cfg):
        (a, b), (na, nb) = tied.layers, tied.names
        total = grads[(a, na)] + grads[(b, nb)]
        grads[(a, na)] = grads[(b, nb)] = total
    ref_params = {}
    for i, layer in enumerate(reference):
        for n, p in layer.named_parameters(remove_duplicate=False):
            ref_params[(i, n)] = p
    assert ref_params.keys() == grads.keys()
    for key, param in ref_params.items():
        torch.testing.assert_close(grads[key], param.grad, rtol=1e-5, atol=1e-7, msg=f"grad of {key}")
    reference_params = list(reference.parameters())
    assert len(reference_params) == sum(len(list(l.parameters())) for l in layers) - len(tied_parameters(cfg))


def test_tied_parameters_start_identical_and_reference_shares_one_tensor():
    cfg = _tiny()
    (tied,) = tied_parameters(cfg)
    assert tied.layers == (0, num_layers(cfg) - 1)
    first, last = build_layer(cfg, tied.layers[0], SEED), build_layer(cfg, tied.layers[1], SEED)
    assert torch.equal(first.get_parameter(tied.names[0]), last.get_parameter(tied.names[1]))
    reference = build_reference_model(cfg, SEED)
    assert reference[0].get_parameter(tied.names[0]) is reference[-1].get_parameter(tied.names[1])
    assert tied_parameters(_tiny(tie_embeddings=False)) == ()
    untied_head = build_layer(_tiny(tie_embeddings=False), num_layers(cfg) - 1, SEED)
    assert not torch.equal(untied_head.get_parameter(tied.names[1]), first.get_parameter(tied.names[0]))


def test_init_depends_on_seed_and_index():
    cfg = _tiny()
    assert _digest(build_layer(cfg, 1, SEED)) == _digest(build_layer(cfg, 1, SEED))
    assert (
        _digest(build_layer(cfg, 1, SEED))["attn.c_attn.weight"]
        != _digest(build_layer(cfg, 2, SEED))["attn.c_attn.weight"]
    )
    assert (
        _digest(build_layer(cfg, 1, SEED))["attn.c_attn.weight"]
        != _digest(build_layer(cfg, 1, SEED + 1))["attn.c_attn.weight"]
    )
    # Global RNG state must not leak into the init.
    torch.manual_seed(99)
    first = _digest(build_layer(cfg, 2, SEED))
    torch.manual_seed(7)
    torch.rand(100)
    assert _digest(build_layer(cfg, 2, SEED)) == first


def test_init_bits_identical_in_another_process():
    """A fresh interpreter that builds ONLY layers 2 and the head gets the same bits as this
    process building the whole model."""
    cfg = _tiny()
    last = num_layers(cfg) - 1
    script = textwrap.dedent(
        f"""
        import hashlib, json, torch
        from oobleck.models import build_layer, load_model_config
        cfg = load_model_config("gpt3_tiny", n_layer=3, n_embd=32, n_head=4, seq_len=16)
        out = {{}}
        for index in (2, {last}):
            layer = build_layer(cfg, index, {SEED})
            out[index] = {{n: hashlib.sha256(p.contiguous().numpy().tobytes()).hexdigest()
                           for n, p in layer.state_dict().items()}}
        print(json.dumps(out))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    remote = {int(k): v for k, v in json.loads(result.stdout).items()}
    local = build_layers(cfg, SEED, range(num_layers(cfg)))
    assert remote[2] == _digest(local[2])
    assert remote[last] == _digest(local[last])


def test_loss_is_per_sample_mean_summed_over_samples():
    cfg = _tiny()
    logits = torch.randn(3, cfg.seq_len, cfg.vocab_size)
    _, targets = _batch(cfg)
    expected = 3 * F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
    torch.testing.assert_close(loss_fn(logits, targets), expected)
    # Splitting a batch into microbatches and summing gives the same total.
    torch.testing.assert_close(loss_fn(logits[:1], targets[:1]) + loss_fn(logits[1:], targets[1:]), expected)


def test_bad_model_config_is_a_config_error():
    with pytest.raises(ConfigError, match="n_head"):
        build_layer(_tiny(n_head=5), 1, SEED)
    with pytest.raises(ConfigError, match="model='nope'"):
        load_model_config("nope")

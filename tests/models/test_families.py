"""Every model family (GPT, Llama-style) behind the one seam: the layered model equals its
single-process reference, its init is a pure function of (seed, layer index, config) across
processes, a shell filled by ``initialise`` is the layer, and its cost model counts what torch runs."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from oobleck.config import load_model_config, model_names
from oobleck.errors import ConfigError
from oobleck.models import FAMILIES, architecture, layer_name, loss_fn, model_spec

pytestmark = pytest.mark.slow  # starts processes

torch.set_num_threads(1)
SEED = 1234
SMALL = {"n_layer": 3, "n_embd": 32, "n_head": 4, "seq_len": 16}
TINY = {"gpt": ("gpt3_tiny", SMALL), "llama": ("llama_tiny", {**SMALL, "n_kv_head": 2, "ffn_hidden": 96})}
FAMILY_NAMES = sorted(TINY)


def _tiny(family: str, **overrides):
    name, small = TINY[family]
    return load_model_config(name, **{**small, **overrides})


def _batch(cfg, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=g)
    return ids, targets


def _digest(module) -> dict[str, str]:
    return {
        n: hashlib.sha256(p.detach().contiguous().numpy().tobytes()).hexdigest() for n, p in module.state_dict().items()
    }


def test_every_family_is_registered_and_has_a_real_run_model():
    assert FAMILY_NAMES == sorted(FAMILIES)
    families = {architecture(load_model_config(name)).family for name in model_names()}
    assert families == set(FAMILIES)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_layer_names_shapes_and_param_counts(family):
    cfg = _tiny(family)
    spec = model_spec(cfg, SEED)
    assert spec.num_layers == cfg.n_layer + 2 and spec.architecture.family == family
    assert [layer_name(cfg, i) for i in range(spec.num_layers)] == ["embedding", "block0", "block1", "block2", "head"]
    with pytest.raises(ConfigError, match="layer index 5"):
        layer_name(cfg, 5)
    ids, _ = _batch(cfg)
    x = ids
    for index, layer in enumerate(spec.build_layers(range(spec.num_layers))):
        assert sum(p.numel() for p in layer.parameters()) == spec.architecture.params(index)
        assert not list(layer.buffers()), "a layer holds parameters only (the runtime places them)"
        x = layer(x)
        last = index == spec.num_layers - 1
        assert tuple(x.shape) == ((3, cfg.seq_len, cfg.vocab_size) if last else spec.boundary_shape(index, 3))
        assert x.dtype == (torch.float32 if last else spec.boundary_dtype)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_layered_equals_reference_outputs_and_grads(family, tie):
    """Run the layers one after another (as stages would), sum the tied pair's gradients (as the
    runtime does across stages), and compare with the nn.Sequential reference with ONE tied weight."""
    cfg = _tiny(family, tie_embeddings=tie)
    ids, targets = _batch(cfg)
    spec = model_spec(cfg, SEED)
    reference = spec.reference_model()
    layers = spec.build_layers(range(spec.num_layers))

    ref_loss = spec.loss(reference(ids), targets)
    ref_loss.backward()
    x = ids
    for layer in layers:
        x = layer(x)
    loss = spec.loss(x, targets)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)

    grads = {(i, n): p.grad.clone() for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
    assert len(spec.tied) == int(tie)
    for tied in spec.tied:
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
    assert len(reference_params) == sum(len(list(l.parameters())) for l in layers) - len(spec.tied)
    assert sum(p.numel() for p in reference_params) == spec.architecture.total_params()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_tied_parameters_start_identical_and_reference_shares_one_tensor(family):
    cfg = _tiny(family, tie_embeddings=True)
    spec = model_spec(cfg, SEED)
    (tied,) = spec.tied
    assert tied.layers == (0, spec.num_layers - 1) and spec.architecture.tied_pairs == (tied.layers,)
    first, last = spec.build_layer(tied.layers[0], None, True), spec.build_layer(tied.layers[1], None, True)
    assert torch.equal(first.get_parameter(tied.names[0]), last.get_parameter(tied.names[1]))
    reference = spec.reference_model()
    assert reference[0].get_parameter(tied.names[0]) is reference[-1].get_parameter(tied.names[1])
    untied = model_spec(_tiny(family, tie_embeddings=False), SEED)
    assert untied.tied == ()
    head = untied.build_layer(untied.num_layers - 1, None, True)
    assert not torch.equal(head.get_parameter(tied.names[1]), first.get_parameter(tied.names[0]))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_init_depends_on_seed_and_index_only(family):
    cfg = _tiny(family)
    build = lambda index, seed: model_spec(cfg, seed).build_layer(index, None, True)  # noqa: E731
    weight = next(n for n, p in build(1, SEED).named_parameters() if p.dim() == 2)
    assert _digest(build(1, SEED)) == _digest(build(1, SEED))
    assert _digest(build(1, SEED))[weight] != _digest(build(2, SEED))[weight]
    assert _digest(build(1, SEED))[weight] != _digest(build(1, SEED + 1))[weight]
    # Global RNG state must not leak into the init.
    torch.manual_seed(99)
    first = _digest(build(2, SEED))
    torch.manual_seed(7)
    torch.rand(100)
    assert _digest(build(2, SEED)) == first


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_shell_filled_by_initialise_is_the_layer(family):
    """What the runtime does (``layer_state``): a meta shell, parameters placed, then initialise."""
    spec = model_spec(_tiny(family), SEED)
    for index in range(spec.num_layers):
        shell = spec.build_layer(index, "meta", False)
        for name, param in list(shell.named_parameters()):
            owner_path, _, attr = name.rpartition(".")
            owner = shell.get_submodule(owner_path) if owner_path else shell
            setattr(owner, attr, torch.nn.Parameter(torch.empty(param.shape)))
        spec.initialise(shell, index)
        assert _digest(shell) == _digest(spec.build_layer(index, None, True))


def test_init_bits_identical_in_another_process():
    """A fresh interpreter that builds ONLY layer 2 and the head of each family gets the same bits
    as this process building the whole model."""
    script = textwrap.dedent(
        f"""
        import hashlib, json, torch
        from oobleck.models import model_spec
        from oobleck.config import load_model_config
        out = {{}}
        for family, (name, small) in {TINY!r}.items():
            spec = model_spec(load_model_config(name, **small), {SEED})
            for index in (2, spec.num_layers - 1):
                layer = spec.build_layer(index, None, True)
                out[f"{{family}}/{{index}}"] = {{n: hashlib.sha256(p.contiguous().numpy().tobytes()).hexdigest()
                                                for n, p in layer.state_dict().items()}}
        print(json.dumps(out))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    remote = json.loads(result.stdout)
    for family in FAMILY_NAMES:
        spec = model_spec(_tiny(family), SEED)
        local = spec.build_layers(range(spec.num_layers))
        for index in (2, spec.num_layers - 1):
            assert remote[f"{family}/{index}"] == _digest(local[index])


def test_loss_is_per_sample_mean_summed_over_samples():
    cfg = _tiny("gpt")
    logits = torch.randn(3, cfg.seq_len, cfg.vocab_size)
    _, targets = _batch(cfg)
    expected = 3 * F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
    torch.testing.assert_close(loss_fn(logits, targets), expected)
    # Splitting a batch into microbatches and summing gives the same total.
    torch.testing.assert_close(loss_fn(logits[:1], targets[:1]) + loss_fn(logits[1:], targets[1:]), expected)
    assert all(model_spec(_tiny(f), 0).loss is loss_fn for f in FAMILY_NAMES)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_cost_model_counts_the_flops_torch_runs(family):
    """Forward, input-gradient and weight-gradient FLOPs of a block and of the head, as torch's
    FLOP counter counts the matrix products of the real passes (attention in its math form, which
    the counter sees), split by torch's own split-backward helpers."""
    cfg = _tiny(family)
    spec = model_spec(cfg, SEED)
    arch = spec.architecture
    ids, targets = _batch(cfg, b=2)
    for index in (1, spec.num_layers - 1):
        layer = spec.build_layer(index, None, True)
        params = list(layer.parameters())
        x = torch.randn(spec.boundary_shape(index - 1, 2), requires_grad=True)
        with sdpa_kernel(SDPBackend.MATH):
            with FlopCounterMode(display=False) as forward:
                out = layer(x)
                out = spec.loss(out, targets) if index == spec.num_layers - 1 else out
            grad = None if index == spec.num_layers - 1 else [torch.randn_like(out)]
            with FlopCounterMode(display=False) as backward_input:
                _, groups = stage_backward_input([out], grad, [x], iter(params))
            with FlopCounterMode(display=False) as backward_weight:
                stage_backward_weight(iter(params), groups)
        cost = arch.layer_cost(index, 2, 4)
        assert forward.get_total_flops() == cost.forward_flops
        assert backward_input.get_total_flops() == cost.backward_input_flops
        assert backward_weight.get_total_flops() == cost.backward_weight_flops


def test_a_model_section_without_a_family_is_gpt():
    """Run dirs and profiles written before families existed have no model.family."""
    from omegaconf import OmegaConf

    from oobleck.config import from_container, to_container, validate
    from testing import tiny_config

    data = to_container(tiny_config())
    del data["model"]["family"]
    old = from_container(data)
    validate(old)
    assert architecture(old.model).family == "gpt"
    assert OmegaConf.to_container(old.model) == {
        k: v for k, v in to_container(tiny_config())["model"].items() if k != "family"
    }
    assert model_spec(old.model, 0).num_layers == 6


def test_bad_model_config_is_a_config_error():
    with pytest.raises(ConfigError, match="n_head"):
        _tiny("gpt", n_head=5)
    with pytest.raises(ConfigError, match="model='nope'"):
        load_model_config("nope")
    with pytest.raises(ConfigError, match="model.n_kv_head is not a config key; did you mean model.n_head"):
        load_model_config("gpt3_tiny", n_kv_head=2)
    with pytest.raises(ConfigError, match="model.family='mamba' is not a model family"):
        load_model_config("gpt3_tiny", family="mamba")

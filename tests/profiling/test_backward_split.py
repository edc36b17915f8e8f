"""The split backward in profiles: ``backward_input_s`` and ``backward_weight_s``.

The analytic profile gives each half its own FLOPs (a block's weight half is its linear layers'
products; the embedding has no input half; the head's halves are equal); a profile without them
(written before they existed, or by a profiler that does not split) splits ``backward_s`` in half.
"""

from __future__ import annotations

import json

import pytest

from oobleck.config import load_model_config
from oobleck.errors import ProfileError
from oobleck.models import architecture
from oobleck.planning.inputs import LayerProfile, ModelProfile
from oobleck.profiling import load_gpu_config
from oobleck.profiling.analytic import analytic_profile


def test_analytic_split_counts_each_half_of_the_backward():
    cfg = load_model_config("gpt3_2_7b")
    profile = analytic_profile(cfg, load_gpu_config("a100_40gb"), 1)
    embedding, *blocks, head = profile.layers
    assert embedding.backward_input_s == 0.0 and embedding.backward_weight_s == embedding.backward_s
    assert head.backward_input_s == head.backward_weight_s == pytest.approx(head.backward_s / 2)
    cost = architecture(cfg).layer_cost(1, 1, 2)
    weight_share = cost.backward_weight_flops / cost.backward_flops
    assert 0.4 < weight_share < 0.5  # attention's backward (no weights) goes to the input half
    for block in blocks:  # compute-bound on an A100: the halves' FLOPs add up to the backward's
        inputs, weights = block.backward_split
        assert inputs + weights == pytest.approx(block.backward_s, rel=1e-9)
        assert weights / block.backward_s == pytest.approx(weight_share, rel=1e-9)


def test_a_memory_bound_half_makes_the_split_backward_slower_than_the_whole():
    # gpt3_medium (C = 1024, T = 2048): the weight half's FLOPs no longer hide its memory traffic.
    block = analytic_profile(load_model_config("gpt3_medium"), load_gpu_config("a100_40gb"), 1).layers[1]
    inputs, weights = block.backward_split
    assert block.backward_s < inputs + weights < 1.1 * block.backward_s


def test_a_profile_without_the_split_halves_the_backward(tmp_path):
    layer = LayerProfile("l0", 0.1, 0.3, 40, 8, 8)
    assert layer.backward_split == pytest.approx((0.15, 0.15))
    assert LayerProfile("l0", 0.1, 0.3, 40, 8, 8, backward_weight_s=0.2).backward_split == pytest.approx((0.1, 0.2))
    assert LayerProfile("l0", 0.1, 0.3, 40, 8, 8, 0.25).backward_split == pytest.approx((0.25, 0.05))
    # A profile file written before the fields existed loads with them unset.
    data = ModelProfile("m", 1, "cpu", (LayerProfile("l0", 0.1, 0.3, 40, 8, 8, 0.2, 0.2),)).to_dict()
    for entry in data["layers"]:
        del entry["backward_input_s"], entry["backward_weight_s"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    loaded = ModelProfile.load(path).layers[0]
    assert loaded.backward_input_s is None and loaded.backward_split == pytest.approx((0.15, 0.15))


@pytest.mark.parametrize("value", [-0.1, float("nan"), True, "1"])
def test_a_bad_split_is_refused_naming_the_layer_and_the_field(value):
    with pytest.raises(ProfileError, match=r"layer 0 \(l0\): backward_input_s=.* must be a non-negative number"):
        ModelProfile("m", 1, "cpu", (LayerProfile("l0", 0.1, 0.3, 40, 8, 8, value, 0.1),))

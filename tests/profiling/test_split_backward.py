"""The measured split backward is robust to a loaded host: its passes are fractions of the fused
backward measured in the same repeats, and their sum is bounded (profile.split_backward_max_ratio)."""

from __future__ import annotations

import pytest

from oobleck.config import compose_config, load_model_config
from oobleck.errors import ProfileError
from oobleck.profiling import cache_key, measure_profile
from oobleck.profiling.measure import split_backward_passes


def test_a_repeat_slowed_by_other_load_moves_nothing():
    # Repeats 2 and 4 ran while another job held the core: fused and split alike 10x slower.
    backward = [1.0, 10.0, 1.0, 10.0, 1.0]
    inputs = [0.5, 5.0, 0.6, 6.0, 0.4]
    weights = [0.6, 6.0, 0.5, 5.0, 0.7]
    i, w = split_backward_passes(backward, inputs, weights)
    assert (i, w) == pytest.approx((0.5, 0.6))  # median fractions times the median fused backward
    # The medians of the raw times would have taken the loaded repeats' split into account alone.
    spiky = split_backward_passes([1.0] * 5, [0.5, 0.5, 8.0, 8.0, 8.0], [0.5] * 5)
    assert spiky[0] == pytest.approx(8.0)  # a split measured 8x slower on most repeats stays so...
    clamped = split_backward_passes([1.0] * 5, [0.5, 0.5, 8.0, 8.0, 8.0], [0.5] * 5, max_ratio=2.0)
    assert sum(clamped) == pytest.approx(2.0)  # ...unless bounded: both passes scaled alike
    assert clamped[0] / clamped[1] == pytest.approx(8.0 / 0.5)
    # Under the bound nothing changes.
    assert split_backward_passes(backward, inputs, weights, max_ratio=2.0) == pytest.approx((0.5, 0.6))


def test_bad_bounds_and_timings_are_named():
    with pytest.raises(ProfileError, match=r"profile.split_backward_max_ratio=0.0 must be > 0"):
        split_backward_passes([1.0], [0.5], [0.5], max_ratio=0.0)
    with pytest.raises(ProfileError, match="2 fused, 1 input and 2 weight"):
        split_backward_passes([1.0, 1.0], [0.5], [0.5, 0.5])


def test_a_measured_profile_honours_the_bound_and_the_cache_key_holds_it():
    model = load_model_config("gpt3_tiny")
    # A bound below the fused backward itself, so that it must bind on every layer.
    profile = measure_profile(model, 2, "cpu", warmup=0, repeats=3, seed=0, threads=1, split_backward_max_ratio=0.5)
    for layer in profile.layers:
        assert layer.backward_input_s + layer.backward_weight_s <= 0.5 * layer.backward_s * (1 + 1e-9)
    assert profile.metadata["split_backward_max_ratio"] == 0.5
    assert cache_key(model, 2, "cpu", "t", split_backward_max_ratio=2.0) != cache_key(
        model, 2, "cpu", "t", split_backward_max_ratio=0.5
    )
    assert compose_config().profile.split_backward_max_ratio == 2.0  # declared in conf/config.yaml

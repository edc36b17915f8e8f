"""Datasets are pure functions of (index, seed, config); the global batch sampler fixes each
step's samples whatever the plan, microbatching or resumption point."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck.config import load_model_config
from oobleck.data import (
    CORPUS_PATH,
    GlobalBatchSampler,
    build_dataset,
    byte_detokenize,
    byte_tokenize,
    collate,
)
from oobleck.errors import ConfigError
from testing import config_section


def _job(**overrides):
    return config_section("job", **overrides)


MODEL = load_model_config("gpt3_tiny")


def test_corpus_windows_are_the_shipped_text():
    dataset = build_dataset(_job(dataset="corpus"), MODEL)
    raw = CORPUS_PATH.read_bytes()
    T = MODEL.seq_len
    assert len(dataset) == (len(raw) - 1) // T
    assert 100_000 <= len(raw) <= 400_000  # small real text, shipped with the package
    for i in (0, 1, len(dataset) - 1):
        inputs, targets = dataset[i]
        assert inputs.dtype == torch.long and inputs.shape == (T,) and targets.shape == (T,)
        assert bytes(inputs.tolist()) == raw[i * T : i * T + T]
        assert torch.equal(targets[:-1], inputs[1:])
        assert targets[-1].item() == raw[i * T + T]
    with pytest.raises(IndexError):
        dataset[len(dataset)]
    assert byte_detokenize(byte_tokenize("assert x, 'ü'")) == "assert x, 'ü'"


def test_synthetic_is_seeded_and_in_vocabulary():
    model = load_model_config("gpt3_tiny", vocab_size=1000)
    a = build_dataset(_job(dataset="synthetic", seed=3, synthetic_samples=50), model)
    b = build_dataset(_job(dataset="synthetic", seed=3, synthetic_samples=50), model)
    c = build_dataset(_job(dataset="synthetic", seed=4, synthetic_samples=50), model)
    assert len(a) == 50
    for i in (0, 17, 49):
        assert torch.equal(a[i][0], b[i][0]) and torch.equal(a[i][1], b[i][1])
        assert torch.equal(a[i][1][:-1], a[i][0][1:])
    assert not torch.equal(a[0][0], c[0][0])
    assert not torch.equal(a[0][0], a[1][0])
    inputs, targets = collate(a, [3, 1, 4])
    assert inputs.shape == (3, model.seq_len) and int(inputs.max()) < 1000 and int(inputs.min()) >= 0
    assert torch.equal(inputs[1], a[1][0]) and torch.equal(targets[2], a[4][1])


def test_dataset_config_errors():
    with pytest.raises(ConfigError, match="model.vocab_size=100"):
        build_dataset(_job(dataset="corpus"), load_model_config("gpt3_tiny", vocab_size=100))
    with pytest.raises(ConfigError, match="model.seq_len=1000000"):
        build_dataset(_job(dataset="corpus"), load_model_config("gpt3_tiny", seq_len=1_000_000))
    with pytest.raises(ConfigError, match="job.global_batch_size=64 exceeds"):
        GlobalBatchSampler(num_samples=10, global_batch_size=64, seed=0)


def test_steps_fixed_across_instances_and_resumable():
    first = GlobalBatchSampler(num_samples=103, global_batch_size=8, seed=5)
    sequence = [first.step_indices(s) for s in range(40)]
    resumed = GlobalBatchSampler(num_samples=103, global_batch_size=8, seed=5)
    # Resume mid-run (and out of order): the same steps come back.
    for s in (27, 3, 39, 12, 12, 0):
        assert resumed.step_indices(s) == sequence[s]
    other_seed = GlobalBatchSampler(num_samples=103, global_batch_size=8, seed=6)
    assert other_seed.step_indices(0) != sequence[0]


def test_epochs_cover_samples_once_and_reshuffle():
    sampler = GlobalBatchSampler(num_samples=103, global_batch_size=8, seed=5)
    assert sampler.steps_per_epoch == 12
    for epoch in range(3):
        steps = [sampler.step_indices(epoch * 12 + s) for s in range(12)]
        flat = [i for step in steps for i in step]
        assert len(flat) == len(set(flat)) == 96 and all(0 <= i < 103 for i in flat)
    assert sampler.step_indices(0) != sampler.step_indices(12)  # epoch 1 is a new order


@settings(max_examples=40, deadline=None)
@given(
    step=st.integers(0, 500),
    seed=st.integers(0, 2**31),
    split=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=4),
)
def test_any_microbatching_of_any_plan_gives_the_step_set(step, seed, split):
    """However a plan cuts step s (microbatch size b, pipelines taking consecutive runs of
    microbatches), the union over pipelines is exactly step s's samples, each once."""
    B = 32
    sampler = GlobalBatchSampler(num_samples=1000, global_batch_size=B, seed=seed)
    expected = sampler.step_indices(step)
    for b in split:
        count = B // b
        got = [i for m in range(count) for i in sampler.microbatch_indices(step, m, b)]
        assert got == expected
        # A heterogeneous plan: pipelines own contiguous runs of microbatches of unequal length.
        cuts = sorted({0, count, *(min(count, k * (b + 1)) for k in range(1, 3))})
        per_pipeline = [
            [i for m in range(lo, hi) for i in sampler.microbatch_indices(step, m, b)] for lo, hi in zip(cuts, cuts[1:])
        ]
        assert sorted(i for p in per_pipeline for i in p) == sorted(expected)
    assert len(set(expected)) == B


def test_microbatch_errors():
    sampler = GlobalBatchSampler(num_samples=100, global_batch_size=12, seed=0)
    with pytest.raises(ConfigError, match="job.microbatch_size=5"):
        sampler.microbatch_indices(0, 0, 5)
    with pytest.raises(ValueError, match="microbatch=6"):
        sampler.microbatch_indices(0, 6, 2)

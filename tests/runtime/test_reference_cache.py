"""``testing.cached_reference``: single-process training computed once per process for each input,
equal to ``train_reference`` and keyed by everything that training reads."""

from __future__ import annotations

import torch

from oobleck.runtime.reference import train_reference
from testing import cached_reference, tiny_config
from testing.checks import _REFERENCES


def _same(a, b) -> bool:
    return a.losses == b.losses and all(
        torch.equal(a.layers[layer][name], b.layers[layer][name]) for layer in a.layers for name in a.layers[layer]
    )


def test_a_cached_reference_equals_training_and_is_computed_once():
    cfg = tiny_config(**{"job.steps": 2})
    first = cached_reference(cfg)
    assert _same(first, train_reference(cfg))
    stored = len(_REFERENCES)
    # A run of the same job on another cluster compares with the same training.
    again = cached_reference(tiny_config(**{"job.steps": 2, "cluster.nodes": 7}))
    assert len(_REFERENCES) == stored and _same(again, first)
    # Each caller has its own copy: changing one changes no other.
    again.losses[0] += 1.0
    next(iter(again.layers[0].values())).add_(1.0)
    assert _same(cached_reference(cfg), first)


def test_every_input_of_the_training_is_in_the_key():
    cfg = tiny_config(**{"job.steps": 2})
    base = cached_reference(cfg)
    variants = [
        cached_reference(tiny_config(**{"job.steps": 2, "job.lr": 1e-3})),
        cached_reference(tiny_config(**{"job.steps": 2, "job.global_batch_size": 14})),
        cached_reference(tiny_config(**{"job.steps": 2, "model.n_embd": 32})),
        cached_reference(cfg, batches=[1, 0]),
        cached_reference(cfg, microbatches=[[0, 1], [0, 1]]),
    ]
    for variant in variants:
        assert variant.losses != base.losses
    assert len(cached_reference(cfg, steps=1).losses) == 1

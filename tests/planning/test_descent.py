"""The seeds' descent (``bottleneck_search._descend``): a one-stage-per-node layout whose T is at
most the seed's, valid, within memory and priced as ``make_template`` prices it; and what it buys,
tighter starting budgets, changes no template value (the brute-force tests of ``test_templates.py``
check the values themselves)."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import oobleck.planning.threshold_sweep as sweep_module
from oobleck.planning.bottleneck_search import (
    _additive_times,
    _descend,
    _layout_seconds,
    _one_stage_per_node,
    _to_stages,
)
from oobleck.planning.pipeline_cost import pipeline_iteration_time
from oobleck.planning.stage_table import _StageTable
from oobleck.planning.synthetic import synthetic_profile
from oobleck.planning.templates import generate_templates, stage_memories_of
from testing.plans import cluster


def _one_stage_layouts(layers: int, nodes: int, gpus: int):
    """Every one-stage-per-node layout, right to left as the DPs return them."""
    for cuts in itertools.combinations(range(1, layers), nodes - 1):
        bounds = (0, *cuts, layers)
        yield [(bounds[i], bounds[i + 1], gpus) for i in range(nodes - 1, -1, -1)]


def _value(table, layout, gpus, r):
    return pipeline_iteration_time(_layout_seconds(table, layout, gpus), r * len(layout))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.integers(4, 9),
    gpus=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 10_000),
    memory=st.sampled_from([1e13, 6e9, 3e9]),
    r=st.sampled_from([1, 2, 4]),
)
def test_descent_is_a_valid_layout_no_worse_than_its_seed(layers, gpus, seed, memory, r):
    profile = synthetic_profile(layers, seed=seed, jitter=0.6, output_bytes=2e7)
    spec = cluster(layers, gpus, memory)
    table = _StageTable(profile, spec, gpus)
    for n, seed_layout in _one_stage_per_node(table, gpus, layers).items():
        value, layout = _descend(table, gpus, r, seed_layout)
        assert value <= _value(table, seed_layout, gpus, r)
        assert value == _value(table, layout, gpus, r)  # the T make_template computes
        assert len(layout) == n and all(g == gpus for _, _, g in layout)
        stages = _to_stages(layout, gpus)
        assert stages[0].start == 0 and stages[-1].end == layers
        assert all(a.end == b.start and a.start < a.end for a, b in zip(stages, stages[1:]))
        assert [s.node for s in stages] == list(range(n))
        assert all(m <= memory for m in stage_memories_of(profile, stages))
        best = min(
            (
                _value(table, other, gpus, r)
                for other in _one_stage_layouts(layers, n, gpus)
                if all(m <= memory for m in stage_memories_of(profile, _to_stages(other, gpus)))
            ),
            default=math.inf,
        )
        assert value >= best


def test_descent_improves_min_max_seeds():
    """The seeds minimise the slowest stage, not T: on a varied profile many are a few tenths of a
    percent above the best one-stage-per-node layout, and the descent closes most of that."""
    profile = synthetic_profile(40, seed=3, jitter=0.6, output_bytes=2e7)
    table = _StageTable(profile, cluster(20, 1), 1)
    improved = 0
    for seed_layout in _one_stage_per_node(table, 1, 20).values():
        value, _ = _descend(table, 1, 4, seed_layout)
        improved += value < _value(table, seed_layout, 1, 4)
    assert improved >= 4


def test_additive_form_equals_eq_1_to_4():
    rows = random.Random(0)
    for _ in range(200):
        stages = rows.randint(1, 9)
        seconds = [rows.choice([0.5, 1.0, 1.5, rows.random()]) for _ in range(stages)]
        r = rows.choice([1, 2, 4])
        got = float(_additive_times(np.array([seconds]), r)[0])
        assert got == pytest.approx(pipeline_iteration_time(seconds, r * stages), rel=1e-12)


def test_templates_do_not_depend_on_the_descent(monkeypatch):
    """Budgets only prune: without the descent (seeds as they are) every template has the same T."""
    profile = synthetic_profile(30, seed=3, jitter=0.6, output_bytes=2e7)
    spec = cluster(15, 2)
    table = _StageTable(profile, spec, 2)
    seeds = _one_stage_per_node(table, 2, 15).values()
    assert any(_descend(table, 2, 4, seed)[0] < _value(table, seed, 2, 4) for seed in seeds)
    with_descent = generate_templates(profile, spec, 1)
    monkeypatch.setattr(
        sweep_module, "_descend", lambda table, gpus, r, layout: (_value(table, layout, gpus, r), layout)
    )
    without = generate_templates(profile, spec, 1)
    assert with_descent.sizes == without.sizes
    for n in with_descent.sizes:
        assert with_descent[n].reference_iteration_s == pytest.approx(without[n].reference_iteration_s, rel=1e-12)

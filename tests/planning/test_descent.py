"""The searches' starting budgets: the seeds' descent (``bottleneck_search._descend``), the best
one-stage-per-node layout at a seed's bottleneck (``_least_t_one_stage_per_node``, against every
such layout) and the refinement of any layout (``_refine``). Each gives a valid layout within
memory, priced as ``make_template`` prices it, no worse than where it started; and what they buy,
tighter starting budgets, changes no template value (the brute-force tests of
``test_templates.py`` check the values themselves)."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_identical_layer_runs import memory_tight_case

import oobleck.planning.threshold_sweep as sweep_module
from oobleck.errors import PlanningError
from oobleck.planning.bottleneck_search import (
    _additive_times,
    _descend,
    _layout_seconds,
    _least_t_one_stage_per_node,
    _one_stage_per_node,
    _refine,
    _seed_layouts,
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


def _feasible(profile, table, layout, gpus, memory):
    stages = _to_stages(layout, gpus)
    return all(m <= memory for m in stage_memories_of(profile, stages))


def test_least_t_one_stage_per_node_is_the_best_at_its_bottleneck():
    """Against every one-stage-per-node layout within memory whose slowest stage is exactly W,
    for W the slowest stage of each of them: the least T, or none where none exists. Seeded
    cases rather than hypothesis: memory changes the answer (the k-th stage from the right keeps
    k microbatches in flight) in about one case in fifty, so many small cases are checked."""
    rng = random.Random(5)
    for _ in range(150):
        layers, gpus, r = rng.randint(4, 9), rng.choice([1, 2, 4]), rng.choice([1, 2, 4])
        memory = rng.choice([1e13, 3e9, 1.6e9, 1.2e9])
        jitter = rng.choice([0.0, 0.6])
        profile = synthetic_profile(layers, seed=rng.randint(0, 10_000), jitter=jitter, output_bytes=2e7)
        _check_least_t(profile, cluster(layers, gpus, memory), gpus, r, memory)


def _check_least_t(profile, spec, gpus, r, memory):
    layers = profile.num_layers
    table = _StageTable(profile, spec, gpus)
    for n in range(1, layers + 1):
        layouts = [
            other for other in _one_stage_layouts(layers, n, gpus) if _feasible(profile, table, other, gpus, memory)
        ]
        by_slowest: dict[float, float] = {}
        for other in layouts:
            W = max(_layout_seconds(table, other, gpus))
            by_slowest[W] = min(by_slowest.get(W, math.inf), _value(table, other, gpus, r))
        for W, best in by_slowest.items():
            found = _least_t_one_stage_per_node(table, gpus, r, W, n)
            assert n in found, (n, W)
            layout = found[n]
            assert len(layout) == n and all(g == gpus for _, _, g in layout)
            assert _feasible(profile, table, layout, gpus, memory)
            assert max(_layout_seconds(table, layout, gpus)) == W
            assert _value(table, layout, gpus, r) == pytest.approx(best, rel=1e-12)
        # A W no layout has as its slowest stage gives none.
        slower = max(by_slowest, default=0.0) * 2 + 1.0
        assert n not in _least_t_one_stage_per_node(table, gpus, r, slower, n)


def _random_layout(rng, layers, nodes, gpus):
    """A random layout (right to left): every node split into stages of random widths, the layers
    cut at random; None where there are fewer layers than stages."""
    widths = []
    for _ in range(nodes):
        left = gpus
        while left:
            g = rng.randint(1, left)
            widths.append(g)
            left -= g
    if len(widths) > layers:
        return None
    cuts = sorted(rng.sample(range(1, layers), len(widths) - 1))
    bounds = [0, *cuts, layers]
    return [(bounds[i], bounds[i + 1], widths[i]) for i in range(len(widths) - 1, -1, -1)]


def test_refine_is_a_valid_layout_no_worse_than_where_it_started():
    """From random layouts with several stages per node on memory-tight profiles: the refined
    layout covers the layers, fills every node it had, fits memory at its in-flight counts, is
    priced as make_template prices it, is no worse than its start and no better than the
    template (the optimum); and refining improves most of the starts."""
    rng = random.Random(7)
    checked = improved = 0
    while checked < 60:
        profile, spec = memory_tight_case(rng, rng.random() < 0.5, (6, 20), 900, [2.0e10, 3.0e10], [3e9, 6e9])
        G, nodes = spec.gpus_per_node, rng.randint(1, 3)
        start = _random_layout(rng, profile.num_layers, nodes, G)
        if start is None:
            continue
        table = _StageTable(profile, spec, G)
        if not _feasible(profile, table, start, G, spec.device_memory_bytes):
            continue
        checked += 1
        start_value = _value(table, start, G, 4)
        value, layout = _refine(table, G, 4, start)
        stages = _to_stages(layout, G)
        assert stages[0].start == 0 and stages[-1].end == profile.num_layers
        assert all(a.end == b.start and a.start < a.end for a, b in zip(stages, stages[1:]))
        assert stages[-1].node == nodes - 1
        for node in range(nodes):
            assert sum(s.gpus for s in stages if s.node == node) == G
        assert _feasible(profile, table, layout, G, spec.device_memory_bytes)
        assert value == _value(table, layout, G, 4)
        assert value <= start_value
        improved += value < start_value
        try:
            templates = generate_templates(profile, cluster(nodes, G, spec.device_memory_bytes, 150e9, 12.5e9), 0)
        except PlanningError:
            continue
        if nodes in templates.sizes:
            assert templates[nodes].reference_iteration_s <= value * (1 + 1e-12)
    assert improved >= checked // 2


def test_templates_do_not_depend_on_the_starting_budgets(monkeypatch):
    """Budgets only prune: with neither the one-stage-per-node DP nor the refinement every
    template has the same T, on memory-tight GPT-shaped profiles (equal layers) where both run."""
    rng = random.Random(11)
    calls = {"_refine": 0, "_least_t_one_stage_per_node": 0}

    def counting(name):
        real = getattr(sweep_module, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    for _ in range(6):
        profile, spec = memory_tight_case(rng, True, (10, 24), 900, [2.0e10, 3.0e10], [3e9])
        try:
            with monkeypatch.context() as patch:
                for name in calls:
                    patch.setattr(sweep_module, name, counting(name))
                with_budgets = generate_templates(profile, spec, 1)
        except PlanningError:
            continue
        with monkeypatch.context() as patch:
            patch.setattr(
                sweep_module, "_refine", lambda table, gpus, r, layout: (_value(table, layout, gpus, r), layout)
            )
            patch.setattr(sweep_module, "_least_t_one_stage_per_node", lambda *args: {})
            without = generate_templates(profile, spec, 1)
        assert with_budgets.sizes == without.sizes
        for n in with_budgets.sizes:
            assert with_budgets[n].reference_iteration_s == pytest.approx(without[n].reference_iteration_s, rel=1e-12)
    assert all(calls.values()), calls


def test_seed_layouts_kept_on_the_table_are_the_seeds():
    """Asked for every node count in turn (as n0's search asks) and then for fewer, the kept seeds
    are those of one ``_one_stage_per_node`` call for the most asked."""
    profile = synthetic_profile(30, seed=5, jitter=0.6, output_bytes=2e7)
    table = _StageTable(profile, cluster(30, 2, 3e9), 2)
    expected = _one_stage_per_node(_StageTable(profile, cluster(30, 2, 3e9), 2), 2, 30)
    for n in [*range(1, 31), 3]:
        kept = _seed_layouts(table, 2, n)
        assert table.seed_layouts is not None and table.seed_layouts[0] >= n
        assert {k: v for k, v in kept.items() if k <= n} == {k: v for k, v in expected.items() if k <= n}

"""Batch distribution and instantiation: exact against brute force, and the plan's invariants."""

from __future__ import annotations

import pytest
from conftest import cluster
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planning_brute import brute_force_distribution, brute_force_instantiation

from oobleck.errors import PlanningError
from oobleck.planning.cost import pipeline_time
from oobleck.planning.instantiate import distribute_microbatches, instantiate
from oobleck.planning.synthetic import synthetic_profile
from oobleck.planning.templates import generate_templates

pipelines = st.lists(st.lists(st.floats(min_value=0.01, max_value=3.0), min_size=1, max_size=5), min_size=1, max_size=3)


@settings(max_examples=80, deadline=None)
@given(pipelines, st.integers(min_value=0, max_value=7))
def test_distribution_matches_brute_force(stage_seconds, extra):
    total = len(stage_seconds) + extra
    split = distribute_microbatches(stage_seconds, total)
    assert sum(split) == total and min(split) >= 1
    value = max(pipeline_time(w, m) for w, m in zip(stage_seconds, split))
    expected, _ = brute_force_distribution(stage_seconds, total)
    assert value == pytest.approx(expected, rel=1e-12)


def test_distribution_balances_a_fast_and_a_slow_pipeline():
    # Same depth; the first is twice as fast, so it takes about twice the microbatches.
    split = distribute_microbatches([[0.1, 0.1], [0.2, 0.2]], 301)
    assert split[0] + split[1] == 301 and abs(split[0] - 2 * split[1]) <= 3


def test_too_few_microbatches():
    with pytest.raises(PlanningError, match="3 microbatches cannot feed 4 pipelines"):
        distribute_microbatches([[1.0]] * 4, 3)


@pytest.fixture(scope="module")
def small_templates():
    profile = synthetic_profile(6, seed=5, jitter=0.5, param_bytes=100_000_000, activation_bytes=10_000_000)
    return generate_templates(profile, cluster(9, gpus=2, memory=2.2e9, inter=2e8), 1)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    nodes=st.integers(min_value=2, max_value=9),
    microbatch=st.integers(min_value=1, max_value=3),
    batches=st.integers(min_value=2, max_value=24),
    f=st.integers(min_value=0, max_value=2),
)
def test_instantiation_matches_enumeration(small_templates, nodes, microbatch, batches, f):
    ids = list(range(100, 100 + nodes))
    expected = brute_force_instantiation(small_templates, ids, batches * microbatch, microbatch, f)
    try:
        plan = instantiate(small_templates, ids, batches * microbatch, microbatch, f)
    except PlanningError:
        assert expected == float("inf")
        return
    assert plan.predicted_iteration_s == pytest.approx(expected, rel=1e-9)
    _assert_plan_invariants(plan, ids, batches, f)


def _assert_plan_invariants(plan, ids, microbatches, f):
    assert len(plan.pipelines) >= f + 1
    assert plan.nodes == tuple(sorted(ids))  # every node used exactly once, none idle
    first = 0
    for index, pipeline in enumerate(plan.pipelines):
        assert pipeline.index == index and pipeline.first_microbatch == first and pipeline.microbatches >= 1
        assert len(pipeline.nodes) == pipeline.template.num_nodes
        first += pipeline.microbatches
    assert first == microbatches
    holders = plan.layer_holders()
    assert all(len({w[0] for w in holders[layer]}) >= f + 1 for layer in holders)


def test_plan_is_deterministic_and_uses_every_node(small_templates):
    ids = [7, 3, 11, 5, 9, 2, 8]
    a = instantiate(small_templates, ids, 48, 2, 1)
    b = instantiate(small_templates, list(reversed(ids)), 48, 2, 1)
    assert a == b
    _assert_plan_invariants(a, ids, 24, 1)


def test_instantiation_errors(small_templates):
    with pytest.raises(PlanningError, match="not.*multiple|multiple of"):
        instantiate(small_templates, range(4), 10, 3, 1)
    with pytest.raises(PlanningError, match="fewer than the f\\+1=3 pipelines"):
        instantiate(small_templates, range(6), 4, 2, 2)
    with pytest.raises(PlanningError, match="f=3 needs 4 pipelines"):
        instantiate(small_templates, range(3), 32, 2, 3)

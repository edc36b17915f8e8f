"""Batch distribution and instantiation: exact against brute force, and the plan's invariants."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planning_brute import brute_force_distribution, brute_force_instantiation

from oobleck.errors import PlanningError
from oobleck.planning.instantiate import build_plan, distribute_microbatches, instantiate
from oobleck.planning.outputs import PipelineTemplate, StageSpec
from oobleck.planning.pipeline_cost import pipeline_iteration_time, pipeline_time
from oobleck.planning.synthetic import synthetic_profile
from oobleck.planning.templates import TemplateSet, generate_templates
from testing.plans import cluster

pipelines = st.lists(st.lists(st.floats(min_value=0.01, max_value=3.0), min_size=1, max_size=5), min_size=1, max_size=3)
# Times that are not dyadic fractions (0.1, 0.3, 1/3, ...) make sums round: the planner must agree
# with itself to the last bit wherever it compares a time with a capacity.
non_dyadic = st.sampled_from([0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.1, 2.0, 4.0, 1 / 3, 2 / 3, 0.35])


@settings(max_examples=80, deadline=None)
@given(pipelines, st.integers(min_value=0, max_value=7))
def test_distribution_matches_brute_force(stage_seconds, extra):
    total = len(stage_seconds) + extra
    split = distribute_microbatches(stage_seconds, total)
    assert sum(split) == total and min(split) >= 1
    value = max(pipeline_time(w, m) for w, m in zip(stage_seconds, split))
    expected, _ = brute_force_distribution(stage_seconds, total)
    assert value == pytest.approx(expected, rel=1e-12)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.lists(non_dyadic, min_size=1, max_size=5), min_size=1, max_size=3),
    st.integers(min_value=0, max_value=6),
)
def test_distribution_matches_brute_force_on_rounding_times(stage_seconds, extra):
    total = len(stage_seconds) + extra  # often fewer microbatches than stages
    split = distribute_microbatches(stage_seconds, total)
    value = max(pipeline_time(w, m) for w, m in zip(stage_seconds, split))
    assert value == brute_force_distribution(stage_seconds, total)[0]


def hand_templates(times_by_nodes: dict[int, list[float]]) -> TemplateSet:
    """Templates with the given stage times (n stages for n nodes), one GPU per node and stage i on node i, over as many
    layers as the deepest template has stages (no parameters: no gradient sync)."""
    layers = max(len(w) for w in times_by_nodes.values())
    templates = {}
    for n, w in times_by_nodes.items():
        bounds = [round(i * layers / len(w)) for i in range(len(w) + 1)]
        stages = tuple(StageSpec(bounds[i], bounds[i + 1], i, 0, 1) for i in range(len(w)))
        m = 4 * len(w)
        templates[n] = PipelineTemplate(n, stages, tuple(w), (0.0,) * len(w), m, pipeline_iteration_time(w, m))
    return TemplateSet(
        min_nodes=min(templates),
        max_nodes=max(templates),
        templates=templates,
        num_layers=layers,
        layer_param_bytes=(0,) * layers,
    )


def test_reported_cases_are_optimal():
    # Issue 12: a stale bound in the finishing-time search gave 3 + 1 nodes at 6.0 s.
    templates = hand_templates({1: [0.1], 2: [4, 1], 3: [1, 4, 1]})
    plan = instantiate(templates, range(4), 2, 1, 1)
    assert (
        plan.predicted_iteration_s
        == 5.0
        == build_plan(templates, [2, 2], list(range(4)), 2, 1, 1).predicted_iteration_s
    )
    assert sorted(len(p.nodes) for p in plan.pipelines) == [2, 2]
    # time(3) rounds to 3.1999999999999997 while a separately computed threshold said 3.2.
    plan = instantiate(hand_templates({3: [2.0, 0.1, 0.5]}), range(3), 3, 1, 0)
    assert plan.predicted_iteration_s == pytest.approx(3.2, rel=1e-15)
    # One microbatch: the exact 1F1B time (4.499999999999999) is below a separately summed 4.5.
    plan = instantiate(hand_templates({4: [0.5, 2, 1, 1]}), range(4), 1, 1, 0)
    assert plan.predicted_iteration_s == pipeline_time([0.5, 2, 1, 1], 1)


@settings(max_examples=120, deadline=None)
@given(
    shapes=st.lists(st.lists(non_dyadic, min_size=1, max_size=4), min_size=1, max_size=4),
    nodes=st.integers(min_value=1, max_value=8),
    microbatches=st.integers(min_value=1, max_value=8),
    f=st.integers(min_value=0, max_value=2),
)
def test_hand_templates_match_enumeration(shapes, nodes, microbatches, f):
    templates = hand_templates({len(w): w for w in shapes})  # an n-node template has n stages
    _assert_matches_enumeration(templates, list(range(nodes)), microbatches, 1, f)


def _assert_matches_enumeration(templates, ids, global_batch, microbatch, f):
    """instantiate() finds the best multiset exhaustive enumeration finds, or none when none exists."""
    expected = brute_force_instantiation(templates, ids, global_batch, microbatch, f)
    try:
        plan = instantiate(templates, ids, global_batch, microbatch, f)
    except PlanningError:
        assert expected == float("inf")
        return
    assert plan.predicted_iteration_s == pytest.approx(expected, rel=1e-12, abs=0)
    _assert_plan_invariants(plan, ids, global_batch // microbatch, f)


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
    _assert_matches_enumeration(small_templates, list(range(100, 100 + nodes)), batches * microbatch, microbatch, f)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(min_value=0, max_value=10_000),
    nodes=st.integers(min_value=4, max_value=12),
    microbatches=st.integers(min_value=1, max_value=30),
    f=st.integers(min_value=0, max_value=2),
)
def test_generated_templates_match_enumeration(seed, nodes, microbatches, f):
    # Up to 12 nodes of a 10-layer model, with as few microbatches as pipelines or stages.
    profile = synthetic_profile(10, seed=seed, jitter=0.6, param_bytes=40_000_000, activation_bytes=1_000_000)
    try:
        templates = generate_templates(profile, cluster(nodes, memory=1.2e9, inter=5e8), f)
    except PlanningError:
        return
    _assert_matches_enumeration(templates, list(range(nodes)), microbatches, 1, f)


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


def test_banded_knapsack_matches_enumeration():
    """``_Knapsack.total`` keeps only sub-totals that can still be completed: over seeded random
    sizes and capacities (some unusable) it equals an enumeration of every multiset of exactly
    ``count`` sizes, the full DP's last total, and its choice attains it."""
    import importlib
    import itertools
    import random

    import numpy as np

    knapsack_of = importlib.import_module("oobleck.planning.count_search")._Knapsack
    rng = random.Random(30)
    compared = 0
    for _ in range(300):
        sizes = sorted(rng.sample(range(1, 9), rng.randint(1, 4)))
        nodes = rng.randint(1, 20)
        values = np.array(
            [knapsack_of.NEG if rng.random() < 0.2 else rng.randint(1, 30) for _ in sizes], dtype=np.int64
        )
        knapsack = knapsack_of(sizes, nodes)
        for count in range(1, 6):
            best = max(
                (
                    int(sum(values[i] for i in chosen))
                    for chosen in itertools.combinations_with_replacement(range(len(sizes)), count)
                    if sum(sizes[i] for i in chosen) == nodes
                ),
                default=None,
            )
            total = knapsack.total(values, count)
            assert total == knapsack.totals(values, count)[-1]
            if best is None or best <= knapsack_of.NEG // 2:
                assert total <= knapsack_of.NEG // 2
                continue
            compared += 1
            assert total == best
            chosen = knapsack.choice(values, count)
            assert len(chosen) == count and sum(chosen) == nodes
            assert sum(int(values[sizes.index(n)]) for n in chosen) == best
    assert compared > 100


def test_sync_figures_equal_the_per_template_sums():
    """``_Sync`` takes each stage's bytes from prefix sums: the same in-node all-reduce and bytes
    per node as summing every stage's layers, over seeded generated template sets (several GPUs
    per node, several stages per node)."""
    import random

    from oobleck.planning.gradient_sync import _intra_sync, _node_param_bytes, sync_of

    rng = random.Random(34)
    checked = 0
    for _ in range(20):
        profile = synthetic_profile(rng.randint(4, 14), seed=rng.randint(0, 10**6), jitter=0.6)
        spec = cluster(rng.randint(2, 8), rng.choice([2, 4]), rng.choice([1e13, 1e9, 1.6e9]))
        try:
            templates = generate_templates(profile, spec, 1)
        except PlanningError:
            continue
        sync = sync_of(templates, 1.5e11, 1.25e10)
        bytes_ = templates.layer_param_bytes
        for n, template in templates.templates.items():
            assert sync.intra_of[n] == _intra_sync(template, bytes_, 1.5e11)
            assert sync.node_bytes_of[n] == max(_node_param_bytes(template, bytes_))
            checked += len(template.stages) > template.num_nodes  # (nodes of several stages)
    assert checked > 5

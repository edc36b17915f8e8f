"""The cost model: Eq. 1-4, the exact 1F1B makespan, the planner's prediction and memory."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planning_brute import sweeping_1f1b_makespan

from oobleck.planning.pipeline_cost import (
    DEFAULT_FORWARD_FRACTION,
    exact_1f1b_makespan,
    pipeline_iteration_time,
    pipeline_time,
    ring_allreduce_seconds,
    stage_memory_bytes,
)
from oobleck.planning.synthetic import synthetic_profile

stage_times = st.lists(st.floats(min_value=0.01, max_value=5.0), min_size=1, max_size=6)


@pytest.mark.parametrize("stages,m", [(1, 1), (3, 3), (4, 16), (6, 7)])
def test_equal_stages_take_m_plus_s_minus_one(stages, m):
    w = [0.5] * stages
    assert pipeline_iteration_time(w, m) == pytest.approx((m + stages - 1) * 0.5)
    assert exact_1f1b_makespan(w, m) == pytest.approx((m + stages - 1) * 0.5)


def test_rightmost_bottleneck_counts():
    # k* = 2 (rightmost of the two slowest): T1 = 9, T2 = (8 - 4 + 2 - 1) * 3 = 15, T3 = 3 + 1 = 4.
    assert pipeline_iteration_time([2, 3, 3, 1], 8) == pytest.approx(28)


@settings(max_examples=60, deadline=None)
@given(stage_times, st.integers(min_value=1, max_value=12))
def test_prediction_is_nondecreasing_in_m(w, m):
    assert pipeline_time(w, m) <= pipeline_time(w, m + 1) + 1e-12
    assert pipeline_time(w, 0) == 0.0


def test_eq14_undercounts_an_early_bottleneck():
    # Issue 12: with m >= S Eq. 1-4 is not the 1F1B makespan; here it is a third of w0 short.
    assert pipeline_iteration_time([2, 1], 2) == 4.0
    assert exact_1f1b_makespan([2, 1], 2) == pytest.approx(13 / 3)


@settings(max_examples=80, deadline=None)
@given(stage_times, st.integers(min_value=1, max_value=16))
def test_what_cost_py_says_of_eq14_is_true(w, m):
    """Eq. 1-4 never exceeds the exact makespan; the gap to it is bounded independently of m;
    the planner's prediction is nondecreasing and never above the exact makespan."""
    exact = exact_1f1b_makespan(w, m)
    assert pipeline_iteration_time(w, m) <= exact + 1e-9
    assert pipeline_time(w, m) <= exact + 1e-9
    S, W = len(w), max(w)
    assert exact <= (m + S - 1) * W + 1e-9  # every stage raised to the slowest: the gap cannot grow with m
    if m >= S:
        assert pipeline_time(w, m) == pipeline_iteration_time(w, m)  # the same float operations


def test_equal_stages_are_exact():
    assert pipeline_time([0.3] * 4, 9) == pytest.approx(exact_1f1b_makespan([0.3] * 4, 9), rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(stage_times, st.integers(min_value=1, max_value=12))
def test_exact_makespan_bounds(w, m):
    exact = exact_1f1b_makespan(w, m)
    # Every microbatch passes every stage, and the bottleneck stage runs m forwards and backwards.
    assert exact >= sum(w) - 1e-9
    assert exact >= m * max(w) - 1e-9
    # 1F1B is never slower than running the microbatches one after another.
    assert exact <= m * sum(w) + 1e-9
    if m < len(w):
        assert pipeline_time(w, m) <= exact + 1e-12


def test_memory_counts_state_and_in_flight_activations():
    profile = synthetic_profile(4, seed=1)
    layers = profile.layers[1:3]
    state = 4 * sum(layer.param_bytes for layer in layers)  # 16 bytes per 4-byte parameter
    acts = sum(layer.activation_bytes for layer in layers)
    # Stage 1 of 4 keeps 3 microbatches in flight; 2 devices each keep half of each.
    assert stage_memory_bytes(profile, 1, 3, 2, 1, 4) == pytest.approx(state + acts * 3 / 2)


def test_ring_allreduce():
    assert ring_allreduce_seconds(1e9, 1, 1e9) == 0.0
    assert ring_allreduce_seconds(1e9, 4, 1e9) == pytest.approx(1.5)


@settings(max_examples=200, deadline=None)
@given(stage_times, st.integers(min_value=1, max_value=20), st.sampled_from([1 / 3, 0.5, 0.4]))
def test_exact_makespan_equals_the_sweeping_schedule(w, m, forward_fraction):
    """Advancing stages only when a neighbour progressed gives the same ends as sweeping every
    stage until none progresses: each end is max(clock, dependency) + duration either way."""
    assert exact_1f1b_makespan(w, m, forward_fraction) == sweeping_1f1b_makespan(w, m, forward_fraction)


def test_exact_makespan_equals_the_sweeping_schedule_on_deep_pipelines():
    import random

    rng = random.Random(30)
    for _ in range(40):
        w = [rng.choice([0.1, 0.3, 1 / 3, rng.uniform(0.01, 2.0)]) for _ in range(rng.randint(1, 40))]
        m = rng.randint(1, 60)
        assert exact_1f1b_makespan(w, m) == sweeping_1f1b_makespan(w, m, DEFAULT_FORWARD_FRACTION)


def test_one_microbatch_equals_the_sweeping_schedule():
    """One microbatch takes a shortcut (the forwards, then the backwards, added in the schedule's
    order): the same bits as sweeping the schedule, on deep pipelines and with zero-time stages."""
    import random

    rng = random.Random(301)
    for _ in range(300):
        w = [rng.choice([0.0, 0.1, 0.3, 1 / 3, 1e-9, rng.uniform(0.001, 3.0)]) for _ in range(rng.randint(1, 70))]
        fraction = rng.choice([DEFAULT_FORWARD_FRACTION, 0.5, 0.4, 0.37, 1.0])
        assert exact_1f1b_makespan(w, 1, fraction) == sweeping_1f1b_makespan(w, 1, fraction)

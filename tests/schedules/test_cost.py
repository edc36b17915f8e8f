"""Operation-level cost: list scheduling the lists the runtime executes, with the profile's times.

On plain 1F1B it is the planner's exact makespan (``exact_1f1b_makespan``: the longest path
through the 2 m S operations), hence Eq. 1-4 for equal stages and m >= S; shards take their share
of the rows; transfers delay the receiver by their bytes over the link's bandwidth; Bamboo's
modes and ReCycle's split backward are costed from the same lists.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plans import dxp_template, even_bounds, make_plan, make_template

from oobleck.planning.inputs import ClusterSpec, LayerProfile, ModelProfile
from oobleck.planning.outputs import Reroute, ShadowCopy
from oobleck.planning.pipeline_cost import exact_1f1b_makespan, pipeline_iteration_time
from oobleck.schedules import Schedule, build_schedule, check_schedule, plan_routes
from oobleck.schedules.cost import schedule_cost
from oobleck.schedules.lower import lower
from oobleck.schedules.recycle import rerouted_orders


def profile_of(stage_seconds, output_bytes: int = 0) -> ModelProfile:
    """One layer per stage: forward a third of w, backward two thirds (the planner's split)."""
    return ModelProfile(
        "m",
        2,
        "cpu",
        tuple(LayerProfile(f"l{i}", w / 3, 2 * w / 3, 4, 4, output_bytes) for i, w in enumerate(stage_seconds)),
    )


def one_pipeline(stages: int, m: int, gpus: int = 1, micro: int = 2):
    return make_plan(
        [(make_template([(i, i + 1, i, 0, gpus) for i in range(stages)]), m)], layers=stages, micro=micro, gpus=gpus
    )


@settings(max_examples=200, deadline=None)
@given(
    seconds=st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]), min_size=1, max_size=5),
    m=st.integers(1, 12),
)
def test_1f1b_cost_is_the_exact_makespan(seconds, m):
    plan = one_pipeline(len(seconds), m)
    cost = schedule_cost(plan, build_schedule(plan), profile_of(seconds))
    assert cost.makespan_s == pytest.approx(exact_1f1b_makespan(seconds, m), rel=1e-12)


@pytest.mark.parametrize("stages,m", [(1, 1), (2, 2), (3, 5), (4, 4), (4, 16)])
def test_1f1b_cost_is_eq_1_4_for_equal_stages(stages, m):
    plan = one_pipeline(stages, m)
    cost = schedule_cost(plan, build_schedule(plan), profile_of([1.5] * stages))
    assert cost.makespan_s == pytest.approx(pipeline_iteration_time([1.5] * stages, m)) == (m + stages - 1) * 1.5


def test_shards_take_their_share_and_transfers_delay_the_receiver():
    seconds = [3.0, 3.0]
    sharded = one_pipeline(2, 1, gpus=2, micro=2)
    assert schedule_cost(sharded, build_schedule(sharded), profile_of(seconds)).makespan_s == pytest.approx(3.0)
    plan = one_pipeline(2, 1)
    links = ClusterSpec(
        nodes=2, gpus_per_node=1, device_memory_bytes=1e9, intra_node_bandwidth=1e9, inter_node_bandwidth=100.0
    )
    free = schedule_cost(plan, build_schedule(plan), profile_of(seconds, output_bytes=50))
    paid = schedule_cost(plan, build_schedule(plan), profile_of(seconds, output_bytes=50), links)
    # One activation forward and one gradient back, 50 bytes each at 100 B/s.
    assert paid.makespan_s == pytest.approx(free.makespan_s + 2 * 0.5)


def _bamboo(mode: str, depth: int = 4, m: int = 8):
    bounds = even_bounds(depth, depth)
    plan = make_plan([(dxp_template(bounds, 1), m)], layers=depth, micro=2, gpus=1)
    shadows = tuple(ShadowCopy(0, i, ((i + 1) % depth,)) for i in range(depth))
    return replace(plan, shadows=shadows, redundancy=mode)


def test_bamboo_eager_hides_the_redundant_forward_in_bubbles_inline_does_not():
    profile = profile_of([1.0] * 4)
    cost = {}
    for mode in ("inline", "eager", "lazy"):
        plan = _bamboo(mode)
        schedule = build_schedule(plan)
        check_schedule(plan, schedule)
        cost[mode] = schedule_cost(plan, schedule, profile).makespan_s
    plain = one_pipeline(4, 8)
    assert cost["lazy"] == schedule_cost(plain, build_schedule(plain), profile).makespan_s
    assert cost["lazy"] == pytest.approx((8 + 3) * 1.0)
    # Inline adds each microbatch's redundant forward (a third of w) to the critical path; eager
    # runs it while the stage waits for gradients, which costs less.
    assert cost["lazy"] < cost["eager"] < cost["inline"]
    assert cost["inline"] - cost["lazy"] == pytest.approx((8 + 3) / 3)


def _rerouted(depth: int = 4, count: int = 2, m: int = 8) -> tuple:
    bounds = even_bounds(depth, depth)
    full = dxp_template(bounds, 1)
    lost = make_template([(bounds[i], bounds[i + 1], n, 0, 1) for n, i in enumerate([0, 1, 3])])
    plan = make_plan([(lost, m)] + [(full, m)] * (count - 1), layers=depth, micro=2, gpus=1)
    via = tuple(1 + k % (count - 1) for k in range(m))
    return replace(plan, reroutes=(Reroute(0, bounds[2], bounds[3], via),))


def test_recycle_split_backward_fills_the_peers_bubbles():
    plan = _rerouted(count=3)
    profile = profile_of([1.0] * 4)
    routes = plan_routes(plan)
    split = build_schedule(plan)
    whole = Schedule(tuple(map(tuple, lower(routes, rerouted_orders(routes, split=False)))), "recycle", 2, 4)
    check_schedule(plan, split)
    check_schedule(plan, whole)
    intact = make_plan([(dxp_template(even_bounds(4, 4), 1), 8)] * 3, layers=4, micro=2, gpus=1)
    healthy = schedule_cost(intact, build_schedule(intact), profile).makespan_s
    split_s = schedule_cost(plan, split, profile).makespan_s
    whole_s = schedule_cost(plan, whole, profile).makespan_s
    # Losing a stage costs time, and deferring weight gradients into bubbles costs less of it.
    assert healthy < split_s < whole_s

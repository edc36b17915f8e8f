"""ReCycle's re-routed orders are exactly those of the reference list scheduler.

``oobleck.schedules.recycle.rerouted_orders`` offers a slot a task only when its pick can have
changed; ``reference_recycle`` is the same scheduler written plainly, offering every free slot in
every pass. Both must return the same tasks in the same order on every slot, or fail with the same
error, on any routes that pass each slot at most once (every plan's do: a route's hops are distinct
stages): seeded random re-routed plans (several pipelines, depths, uneven layer splits, one or more
gaps per pipeline, microbatch counts below and above the depth, stage times with ties and
zero-second stages, whose tasks end when they start), routes no plan makes (slots at different
positions on different routes, where the in-flight limits hold every slot and are relaxed), the
schedule tests' plans, split and not.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import reference_recycle
from hypothesis import HealthCheck, given, settings
from plans import (
    crafted_routes,
    dxp_template,
    even_bounds,
    make_plan,
    make_template,
    rerouted_plan,
    seeded_rerouted_plan,
)

from oobleck.errors import PlanningError
from oobleck.planning.outputs import ExecutionPlan, Reroute
from oobleck.schedules import plan_routes
from oobleck.schedules.recycle import rerouted_orders
from oobleck.schedules.routes import Routes

SEEDS = 60
CRAFTED = 100


def assert_same_orders(plan: ExecutionPlan | Routes) -> None:
    routes = plan if isinstance(plan, Routes) else plan_routes(plan)
    for split in (True, False):
        try:
            expected = reference_recycle.rerouted_orders(routes, split=split)
        except PlanningError as error:
            with pytest.raises(PlanningError) as raised:
                rerouted_orders(routes, split=split)
            assert str(raised.value) == str(error)
            continue
        got = rerouted_orders(routes, split=split)
        assert list(got) == list(expected)
        for slot, order in expected.items():
            assert got[slot] == order, f"split={split}, slot {slot}"


def test_seeded_random_plans_get_the_reference_orders():
    for seed in range(SEEDS):
        assert_same_orders(seeded_rerouted_plan(random.Random(seed)))


def test_crafted_routes_get_the_reference_orders():
    for seed in range(CRAFTED):
        assert_same_orders(crafted_routes(random.Random(seed)))


def test_a_large_plan_gets_the_reference_orders():
    """Simulator scale: 8 stages, 4 pipelines of 32 microbatches, two gaps."""
    rng = random.Random(0)
    bounds = even_bounds(24, 8)
    full = make_template(
        [(bounds[i], bounds[i + 1], i, 0, 1) for i in range(8)], [rng.choice([1.0, 1.1]) for _ in range(8)]
    )
    lost = make_template([(bounds[i], bounds[i + 1], n, 0, 1) for n, i in enumerate([0, 1, 2, 4, 5, 6, 7])])
    other = make_template([(bounds[i], bounds[i + 1], n, 0, 1) for n, i in enumerate([0, 1, 2, 3, 4, 5, 6])])
    plan = make_plan([(lost, 32), (full, 32), (other, 32), (full, 32)], layers=24, micro=2, gpus=1)
    reroutes = (
        Reroute(0, bounds[3], bounds[4], tuple(rng.choice([1, 2, 3]) for _ in range(32))),
        Reroute(2, bounds[7], bounds[8], tuple((1, 3)[k % 2] for k in range(32))),
    )
    assert_same_orders(replace(plan, reroutes=reroutes))


def test_the_cost_tests_plan_gets_the_reference_orders():
    bounds = even_bounds(4, 4)
    lost = make_template([(bounds[i], bounds[i + 1], n, 0, 1) for n, i in enumerate([0, 1, 3])])
    plan = make_plan([(lost, 8)] + [(dxp_template(bounds, 1), 8)] * 2, layers=4, micro=2, gpus=1)
    assert_same_orders(replace(plan, reroutes=(Reroute(0, bounds[2], bounds[3], tuple(1 + k % 2 for k in range(8))),)))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rerouted_plan())
def test_the_generator_tests_plans_get_the_reference_orders(plan):
    assert_same_orders(plan)

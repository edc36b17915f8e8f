"""Lowering gives exactly the op lists of the reference lowering.

``oobleck.schedules.lower.lower`` works out each route's positions and each shard's neighbouring
rows once; ``reference_lower`` finds them anew for every task. Every rank's list must be identical
(same ops, same fields, same order), or both must fail alike, for 1F1B orders of heterogeneous and
sharded plans and of Bamboo's layouts, for ReCycle's re-routed orders (split and not), and for
routes no plan makes.
"""

from __future__ import annotations

import random

import pytest
import reference_lower
from hypothesis import HealthCheck, given, settings
from plans import bamboo_plan, crafted_routes, random_plan, rerouted_plan, seeded_rerouted_plan

from oobleck.schedules import one_f_one_b_orders, plan_routes
from oobleck.schedules.lower import Task, lower
from oobleck.schedules.ops import COMPUTE, OpKind
from oobleck.schedules.recycle import rerouted_orders
from oobleck.schedules.routes import Routes

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SEEDS = 25


def assert_same_ops(routes: Routes, orders: dict[tuple[int, int], list[Task]]) -> None:
    assert lower(routes, orders) == reference_lower.lower(routes, orders)


def assert_same_rerouted_ops(routes: Routes) -> None:
    for split in (True, False):
        assert_same_ops(routes, rerouted_orders(routes, split=split))


@SETTINGS
@given(random_plan())
def test_1f1b_ops_are_the_reference_ops(plan):
    assert_same_ops(plan_routes(plan), one_f_one_b_orders(plan))


@SETTINGS
@given(bamboo_plan())
def test_bamboo_layouts_1f1b_ops_are_the_reference_ops(plan):
    assert_same_ops(plan_routes(plan), one_f_one_b_orders(plan))


@SETTINGS
@given(rerouted_plan())
def test_rerouted_ops_are_the_reference_ops(plan):
    assert_same_rerouted_ops(plan_routes(plan))


def test_seeded_rerouted_and_crafted_ops_are_the_reference_ops():
    for seed in range(SEEDS):
        assert_same_rerouted_ops(plan_routes(seeded_rerouted_plan(random.Random(seed))))
        assert_same_rerouted_ops(crafted_routes(random.Random(seed)))


def test_arbitrary_orders_on_routes_that_revisit_slots_lower_as_the_reference_does():
    """Lowering takes any order: random tasks of the microbatches passing each slot, on routes that
    may pass a slot twice (a task then sits at the slot's first place on the route)."""
    for seed in range(SEEDS):
        rng = random.Random(seed)
        routes = crafted_routes(rng, repeats=True)
        passing = {
            slot: [r.microbatch for r in routes.routes if any((h.pipeline, h.stage) == slot for h in r.hops)]
            for slot in routes.slots
        }
        orders = {
            slot: [Task(rng.choice(sorted(COMPUTE)), rng.choice(mbs)) for _ in range(rng.randint(0, 12))]
            for slot, mbs in passing.items()
            if mbs
        }
        assert_same_ops(routes, orders)


def test_a_task_off_its_route_fails_as_the_reference_does():
    plan = seeded_rerouted_plan(random.Random(0))
    routes = plan_routes(plan)
    orders = rerouted_orders(routes)
    slot = next(iter(orders))
    stranger = next(r.microbatch for r in routes.routes if all((h.pipeline, h.stage) != slot for h in r.hops))
    orders[slot] = [*orders[slot], Task(OpKind.FORWARD, stranger)]
    with pytest.raises(ValueError) as expected:
        reference_lower.lower(routes, orders)
    with pytest.raises(ValueError) as got:
        lower(routes, orders)
    assert str(got.value) == str(expected.value)

"""ReCycle's re-routed orders are exactly those of the reference list scheduler.

``oobleck.schedules.recycle.rerouted_orders`` offers a slot a task only when its pick can have
changed; ``reference_recycle`` is the same scheduler written plainly, offering every free slot in
every pass.
Both must return the same tasks in the same order on every slot, or fail with the same error, on
any re-routed plan: seeded random ones (several pipelines, depths, uneven layer splits, one or
more gaps per pipeline, microbatch counts below and above the depth, stage times with ties and
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
from plans import dxp_template, even_bounds, make_plan, make_template, rerouted_plan

from oobleck.errors import PlanningError
from oobleck.planning.outputs import ExecutionPlan, Reroute
from oobleck.schedules import plan_routes
from oobleck.schedules.recycle import rerouted_orders
from oobleck.schedules.routes import Route, Routes

SEEDS = 100
CRAFTED = 150


def seeded_rerouted_plan(rng: random.Random, max_depth: int = 6, max_pipelines: int = 5) -> ExecutionPlan:
    """A D x P layout with an uneven layer split where some pipelines lost stages (every stage
    keeps a holder, every pipeline a stage); each pipeline has its own stage times."""
    depth = rng.randint(2, max_depth)
    count = rng.randint(2, max_pipelines)
    layers = rng.randint(depth, depth + 4)
    bounds = [0, *sorted(rng.sample(range(1, layers), depth - 1)), layers]
    lost = {(rng.randrange(count), rng.randrange(depth)) for _ in range(rng.randint(1, 2 * count))}
    lost = {(p, s) for p, s in lost if sum((q, s) in lost for q in range(count)) < count}
    lost = {(p, s) for p, s in lost if sum((p, t) in lost for t in range(depth)) < depth}
    if not lost:
        lost = {(0, rng.randrange(depth))}
    times = rng.choice([[1.0], [0.5, 1.0, 2.0], [0.0, 1.0, 1.5], [0.0, 0.25, 3.0]])
    gpus = rng.randint(1, 2)
    pipelines = []
    for p in range(count):
        kept = [s for s in range(depth) if (p, s) not in lost]
        stages = [(bounds[s], bounds[s + 1], node, 0, gpus) for node, s in enumerate(kept)]
        seconds = [rng.choice(times) for _ in kept]
        pipelines.append((make_template(stages, seconds), rng.randint(1, 3 * depth)))
    plan = make_plan(pipelines, layers=layers, micro=rng.randint(1, 3), gpus=gpus)
    reroutes = []
    for p, s in sorted(lost):
        keepers = [q for q in range(count) if (q, s) not in lost]
        m = pipelines[p][1]
        if rng.random() < 0.5:
            via = tuple(keepers[k % len(keepers)] for k in range(m))
        else:
            via = tuple(rng.choice(keepers) for _ in range(m))
        reroutes.append(Reroute(p, bounds[s], bounds[s + 1], via))
    return replace(plan, reroutes=tuple(reroutes))


def crafted_routes(rng: random.Random) -> Routes:
    """Routes no plan makes: each microbatch visits random distinct slots of a D x P layout in a
    random order, so slots sit at different positions on different routes (the in-flight limits
    then hold every slot at times, and the scheduler relaxes them)."""
    depth, count = rng.randint(1, 4), rng.randint(1, 4)
    template = dxp_template(even_bounds(depth, depth), 1)
    pipelines = [
        (
            replace(template, stage_seconds=tuple(rng.choice([0.0, 0.5, 1.0, 2.0]) for _ in range(depth))),
            rng.randint(1, 8),
        )
        for _ in range(count)
    ]
    plan = make_plan(pipelines, layers=depth, micro=1, gpus=1)
    slots = plan_routes(plan).slots
    keys = sorted(slots)
    routes = []
    for pipeline in plan.pipelines:
        for k in range(pipeline.microbatches):
            path = rng.sample(keys, rng.randint(1, min(len(keys), depth + 2)))
            routes.append(Route(pipeline.index, pipeline.first_microbatch + k, tuple(slots[s] for s in path)))
    return Routes(plan, tuple(routes), slots)


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
    for seed in range(2):
        rng = random.Random(seed)
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

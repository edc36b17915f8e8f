"""The cost from compute orders is the cost of the op lists, bit for bit.

``oobleck.schedules.cost.orders_cost`` (and ``plan_cost``, which the simulator's ReCycle uses)
times the lists ``lower`` would make from the slots' orders without making them. Every rank's end
and compute seconds must equal, as floats (``==``, not approximately), those ``schedule_cost``
gives for the lowered lists, or both must fail alike: on seeded re-routed plans (split backward
and not), on 1F1B orders of heterogeneous and sharded plans, on Bamboo's layouts (``plan_cost``
falls back to the ops), and on arbitrary orders over routes no plan makes, deadlocks included.
Profiles have irregular per-layer seconds and bytes, so sums in another order would differ in the
last bits; clusters have different bandwidths in and across nodes.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from plans import bamboo_plan, crafted_routes, random_plan, rerouted_plan, seeded_rerouted_plan

from oobleck.planning.inputs import ClusterSpec, LayerProfile, ModelProfile
from oobleck.planning.outputs import ExecutionPlan
from oobleck.schedules import Schedule, build_schedule, compute_pairs, plan_routes
from oobleck.schedules.cost import ScheduleCost, orders_cost, plan_cost, schedule_cost
from oobleck.schedules.lower import Task, lower
from oobleck.schedules.ops import COMPUTE, OpKind
from oobleck.schedules.recycle import rerouted_orders, rerouted_pairs
from oobleck.schedules.routes import Routes

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SEEDS = 60


def irregular_profile(layers: int, rng: random.Random) -> ModelProfile:
    """Per-layer seconds and bytes drawn at random; some layers give their own backward split."""
    profile = []
    for i in range(layers):
        forward, backward = rng.uniform(0.01, 1.0), rng.uniform(0.02, 2.0)
        split = (None, None) if rng.random() < 0.5 else (backward * rng.uniform(0.2, 0.8), None)
        profile.append(LayerProfile(f"l{i}", forward, backward, 4, 4, rng.randint(1, 10**6), *split))
    return ModelProfile("m", 2, "cpu", tuple(profile))


def links(rng: random.Random) -> ClusterSpec | None:
    if rng.random() < 0.2:
        return None  # free transfers
    inter = rng.uniform(1e5, 1e7)
    return ClusterSpec(
        nodes=64,
        gpus_per_node=4,
        device_memory_bytes=1e9,
        intra_node_bandwidth=inter * 37.3,
        inter_node_bandwidth=inter,
    )


def lowered_cost(routes: Routes, orders, profile: ModelProfile, cluster: ClusterSpec | None) -> ScheduleCost:
    plan = routes.plan
    schedule = Schedule(
        tuple(tuple(ops) for ops in lower(routes, orders)), "any", plan.microbatch_size, plan.num_layers
    )
    return schedule_cost(plan, schedule, profile, cluster)


def assert_same_cost(expected: ScheduleCost, got: ScheduleCost) -> None:
    assert got.rank_end_s == expected.rank_end_s
    assert got.rank_busy_s == expected.rank_busy_s
    assert got.makespan_s == expected.makespan_s


def assert_plan_cost_is_the_ops_cost(plan: ExecutionPlan, rng: random.Random) -> None:
    profile, cluster = irregular_profile(plan.num_layers, rng), links(rng)
    assert_same_cost(schedule_cost(plan, build_schedule(plan), profile, cluster), plan_cost(plan, profile, cluster))


def test_seeded_rerouted_plans_cost_the_same_from_orders_split_and_not():
    for seed in range(SEEDS):
        rng = random.Random(seed)
        plan = seeded_rerouted_plan(rng)
        assert_plan_cost_is_the_ops_cost(plan, rng)
        routes = plan_routes(plan)
        profile, cluster = irregular_profile(plan.num_layers, rng), links(rng)
        whole = lowered_cost(routes, rerouted_orders(routes, split=False), profile, cluster)
        assert_same_cost(whole, orders_cost(routes, rerouted_pairs(routes, split=False), profile, cluster))


def test_a_large_rerouted_plan_costs_the_same_from_orders():
    """Nearer simulator scale: 6 stages, 5 pipelines of up to 18 microbatches, several gaps."""
    for seed in range(3):
        rng = random.Random(1000 + seed)
        plan = seeded_rerouted_plan(rng, max_depth=6, max_pipelines=5)
        assert_plan_cost_is_the_ops_cost(plan, rng)


@SETTINGS
@given(rerouted_plan())
def test_drawn_rerouted_plans_cost_the_same_from_orders(plan):
    assert_plan_cost_is_the_ops_cost(plan, random.Random(plan.num_layers))


@SETTINGS
@given(random_plan())
def test_1f1b_plans_cost_the_same_from_orders(plan):
    """Heterogeneous pipelines, stages sharded over up to 3 devices, two stages sharing a node."""
    assert_plan_cost_is_the_ops_cost(plan, random.Random(plan.num_layers))


@SETTINGS
@given(bamboo_plan())
def test_bamboo_plans_are_costed_from_their_ops(plan):
    assert_plan_cost_is_the_ops_cost(plan, random.Random(plan.num_layers))
    with pytest.raises(ValueError, match="shadows"):
        compute_pairs(plan)


def test_arbitrary_orders_cost_the_same_or_deadlock_alike():
    """Random tasks of the microbatches passing each slot, on routes that may pass a slot twice:
    most deadlock (a receive whose message is never sent); both paths must say so."""
    finished = 0
    for seed in range(SEEDS):
        rng = random.Random(seed)
        routes = crafted_routes(rng, repeats=rng.random() < 0.5)
        passing = {
            slot: [r.microbatch for r in routes.routes if any((h.pipeline, h.stage) == slot for h in r.hops)]
            for slot in routes.slots
        }
        pairs = {
            slot: [(rng.choice(sorted(COMPUTE)), rng.choice(mbs)) for _ in range(rng.randint(0, 6))]
            for slot, mbs in passing.items()
            if mbs
        }
        tasks = {slot: [Task(kind, mb) for kind, mb in order] for slot, order in pairs.items()}
        profile, cluster = irregular_profile(routes.plan.num_layers, rng), links(rng)
        try:
            expected = lowered_cost(routes, tasks, profile, cluster)
        except ValueError as error:
            with pytest.raises(ValueError) as raised:
                orders_cost(routes, pairs, profile, cluster)
            assert str(raised.value) == str(error)
            continue
        assert_same_cost(expected, orders_cost(routes, pairs, profile, cluster))
        finished += 1
    assert finished > 0


def test_crafted_routes_cost_the_same_from_their_rerouted_orders():
    for seed in range(SEEDS):
        rng = random.Random(seed)
        routes = crafted_routes(rng)
        profile, cluster = irregular_profile(routes.plan.num_layers, rng), links(rng)
        for split in (True, False):
            expected = lowered_cost(routes, rerouted_orders(routes, split=split), profile, cluster)
            assert_same_cost(expected, orders_cost(routes, rerouted_pairs(routes, split=split), profile, cluster))


def test_rerouted_orders_are_the_pairs_as_tasks():
    routes = plan_routes(seeded_rerouted_plan(random.Random(7)))
    orders, pairs = rerouted_orders(routes), rerouted_pairs(routes)
    assert list(orders) == list(pairs)
    for slot, tasks in orders.items():
        assert [(task.kind, task.microbatch) for task in tasks] == pairs[slot]


def test_a_task_off_its_route_fails_as_lowering_does():
    plan = seeded_rerouted_plan(random.Random(0))
    routes = plan_routes(plan)
    pairs = rerouted_pairs(routes)
    slot = next(iter(pairs))
    stranger = next(r.microbatch for r in routes.routes if all((h.pipeline, h.stage) != slot for h in r.hops))
    pairs[slot] = [*pairs[slot], (OpKind.FORWARD, stranger)]
    tasks = {s: [Task(kind, mb) for kind, mb in order] for s, order in pairs.items()}
    profile = irregular_profile(plan.num_layers, random.Random(0))
    with pytest.raises(ValueError) as expected:
        lowered_cost(routes, tasks, profile, None)
    with pytest.raises(ValueError) as got:
        orders_cost(routes, pairs, profile, None)
    assert str(got.value) == str(expected.value)

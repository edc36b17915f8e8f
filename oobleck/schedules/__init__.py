"""Schedules as data: every rank's ordered operations for one training step, made from the plan.

Pure and torch-free (imports only ``oobleck.planning``): generators turn an ``ExecutionPlan`` into
a ``Schedule`` (``ops``), ``check`` proves it correct and deadlock-free before anything runs it,
``cost`` times it by list scheduling with the profile's per-operation times, and the runtime's one
interpreter (``oobleck.runtime.executor``) executes it. Which generator a plan gets follows from
the plan alone, so every rank derives the same lists:

- ``plan.reroutes`` (a ReCycle-style re-routed plan): ``recycle``, split backward, list-scheduled;
- ``plan.shadows`` (Bamboo-style redundancy): 1F1B plus the redundant forwards placed by
  ``plan.redundancy`` (``bamboo``: eager, lazy or inline);
- otherwise: non-interleaved 1F1B (``lower.one_f_one_b``).
"""

from __future__ import annotations

from oobleck.planning.outputs import ExecutionPlan
from oobleck.schedules.bamboo import place_redundant_forwards
from oobleck.schedules.check import ScheduleError, check_schedule
from oobleck.schedules.lower import Slot, Task, lower, one_f_one_b
from oobleck.schedules.ops import Op, OpKind, Schedule
from oobleck.schedules.recycle import rerouted_orders, rerouted_pairs
from oobleck.schedules.routes import Routes, plan_routes

__all__ = [
    "Op",
    "OpKind",
    "Routes",
    "Schedule",
    "ScheduleError",
    "build_schedule",
    "check_schedule",
    "checked_schedule",
    "compute_pairs",
    "one_f_one_b_orders",
    "plan_routes",
]


def build_schedule(plan: ExecutionPlan, routes: Routes | None = None) -> Schedule:
    """The schedule of ``plan`` (see the module docstring for which generator)."""
    routes = routes if routes is not None else plan_routes(plan)
    if plan.reroutes:
        ranks = lower(routes, rerouted_orders(routes))
        generator = "recycle"
    else:
        ranks = lower(routes, one_f_one_b_orders(plan))
        generator = "1f1b"
        if plan.shadows:
            ranks = place_redundant_forwards(plan, ranks, plan.redundancy)
            generator = f"bamboo-{plan.redundancy}"
    return Schedule(tuple(tuple(ops) for ops in ranks), generator, plan.microbatch_size, plan.num_layers)


def one_f_one_b_orders(plan: ExecutionPlan) -> dict[Slot, list[Task]]:
    """Every slot's 1F1B compute order (its pipeline's microbatches), as lowering takes them."""
    orders = {}
    for pipeline in plan.pipelines:
        microbatches = list(range(pipeline.first_microbatch, pipeline.first_microbatch + pipeline.microbatches))
        for stage in range(pipeline.template.num_stages):
            orders[(pipeline.index, stage)] = one_f_one_b(stage, pipeline.template.num_stages, microbatches)
    return orders


def compute_pairs(plan: ExecutionPlan, routes: Routes | None = None) -> dict[Slot, list[tuple[OpKind, int]]]:
    """Every slot's compute order in ``build_schedule(plan)``, as (kind, microbatch) pairs, for a
    plan without shadows (whose lists are these orders lowered: ``oobleck.schedules.cost.orders_cost``)."""
    if plan.shadows:
        raise ValueError("a plan with shadows has redundant forwards besides its compute orders")
    routes = routes if routes is not None else plan_routes(plan)
    if plan.reroutes:
        return rerouted_pairs(routes)
    return {slot: [(task.kind, task.microbatch) for task in tasks] for slot, tasks in one_f_one_b_orders(plan).items()}


def checked_schedule(plan: ExecutionPlan) -> Schedule:
    """The schedule of ``plan``, checked (``ScheduleError``, a ``PlanningError``, says what is wrong)."""
    schedule = build_schedule(plan)
    check_schedule(plan, schedule)
    return schedule

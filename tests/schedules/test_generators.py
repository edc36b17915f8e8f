"""Every generated schedule passes the static checks, over random plans of every kind.

The checks (``oobleck.schedules.check``) run every rank's list with blocking receives and
asynchronous sends, match every send with its receive in channel order, order each microbatch's
forward before its backward on every stage, complete every layer's gradients before its
reduction, and account for every row of every layer of every microbatch exactly once.
"""

from __future__ import annotations

import subprocess
import sys

from hypothesis import HealthCheck, given, settings
from plans import bamboo_plan, random_plan, rerouted_plan

from oobleck.schedules import Schedule, build_schedule, check_schedule, plan_routes
from oobleck.schedules.ops import GRADIENT, OpKind

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _checked(plan) -> Schedule:
    schedule = build_schedule(plan)
    check_schedule(plan, schedule)
    assert Schedule.from_dict(schedule.to_dict()) == schedule
    return schedule


@SETTINGS
@given(random_plan())
def test_1f1b_on_heterogeneous_and_sharded_plans(plan):
    schedule = _checked(plan)
    assert schedule.generator == "1f1b"
    assert not any(op.kind in (OpKind.BACKWARD_INPUT, OpKind.BACKWARD_WEIGHT) for ops in schedule.ranks for op in ops)


@SETTINGS
@given(bamboo_plan())
def test_bamboo_modes_on_dxp_plans_with_shadows(plan):
    schedule = _checked(plan)
    assert schedule.generator == f"bamboo-{plan.redundancy}"
    redundant = [op for ops in schedule.ranks for op in ops if op.kind is OpKind.REDUNDANT_FORWARD]
    forwards = [op for ops in schedule.ranks for op in ops if op.kind is OpKind.FORWARD]
    # One redundant forward per forward of every shadow holder, none in lazy mode.
    assert len(redundant) == (0 if plan.redundancy == "lazy" else len(forwards))
    assert all(op.keep == (plan.redundancy == "eager") for op in redundant)


@SETTINGS
@given(rerouted_plan())
def test_rerouted_plans_send_lost_stages_through_peers(plan):
    schedule = _checked(plan)
    assert schedule.generator == "recycle"
    routes = plan_routes(plan)
    for reroute in plan.reroutes:
        first = next(p for p in plan.pipelines if p.index == reroute.pipeline).first_microbatch
        for k, via in enumerate(reroute.via):
            hop = next(h for h in routes.by_microbatch[first + k].hops if h.start == reroute.start)
            assert hop.pipeline == via
            for rank in hop.ranks:  # the peer's ranks run the re-routed microbatch's split backward
                kinds = {op.kind for op in schedule.of(rank) if op.microbatch == first + k}
                assert {OpKind.FORWARD, OpKind.BACKWARD_INPUT, OpKind.BACKWARD_WEIGHT} <= kinds or not kinds


def test_the_final_gradient_op_is_marked_and_the_reduction_ends_the_list():
    from plans import make_plan, make_template

    plan = make_plan([(make_template([(0, 2, 0, 0, 1), (2, 4, 1, 0, 1)]), 3)], layers=4, micro=2, gpus=1)
    for ops in _checked(plan).ranks:
        gradient = [op for op in ops if op.kind in GRADIENT]
        assert gradient[-1].final and not any(op.final for op in gradient[:-1])
        assert ops[-1].kind is OpKind.REDUCE_GRAD


def test_the_package_imports_no_torch():
    code = "import sys, oobleck.schedules, oobleck.schedules.cost; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)

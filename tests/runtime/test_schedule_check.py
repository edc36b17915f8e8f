"""A worker checks its generation's whole schedule before its first step, and refuses one that
cannot run with the reason (no process needed: the check is the topology's and the plan's)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from oobleck.errors import RunError
from oobleck.planning.outputs import ShadowCopy
from oobleck.runtime.executor import rank_schedule
from oobleck.runtime.topology import build_topology
from oobleck.schedules import OpKind
from testing import hand_plan, template


def _plan():
    two = template([(0, 3, 0, 0, 1), (3, 6, 1, 0, 1)])
    return hand_plan([(two, (0, 1), 4), (two, (2, 3), 4)], batch=16, micro=2, layers=6, f=1, gpus=1)


def test_each_rank_runs_its_own_list_of_the_checked_schedule():
    plan = replace(_plan(), shadows=(ShadowCopy(0, 0, (3, 4, 5)),), redundancy="eager")
    ops = rank_schedule(build_topology(plan, (0, 0)))
    assert [op.microbatch for op in ops if op.kind is OpKind.REDUNDANT_FORWARD] == [0, 1, 2, 3]
    assert ops[-1].kind is OpKind.REDUCE_GRAD
    assert not any(op.kind is OpKind.REDUNDANT_FORWARD for op in rank_schedule(build_topology(plan, (2, 0))))


def test_a_schedule_that_cannot_run_is_refused_with_its_reason():
    plan = replace(_plan(), shadows=(ShadowCopy(0, 0, (3, 5)),))
    with pytest.raises(RunError, match=r"schedule cannot run: rank 0's shadow copy \[3, 5\] is not one contiguous"):
        rank_schedule(build_topology(plan, (0, 0)))

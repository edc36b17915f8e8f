"""The static checks catch each way a schedule can be wrong, naming the rank, the op and why.

Each test takes a correct schedule of a small plan, breaks one thing in one rank's list, and
expects ``ScheduleError`` with the reason.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from plans import make_plan, make_template

from oobleck.schedules import Schedule, ScheduleError, build_schedule, check_schedule
from oobleck.schedules.ops import Op, OpKind


@pytest.fixture
def plan():
    """Two pipelines: two stages, and one stage sharded over two devices (5 microbatches of 2)."""
    return make_plan(
        [
            (make_template([(0, 2, 0, 0, 1), (2, 4, 1, 0, 1)]), 3),
            (make_template([(0, 4, 0, 0, 2)]), 2),
        ],
        layers=4,
        micro=2,
        gpus=2,
    )


def _with(schedule: Schedule, rank: int, ops: list[Op]) -> Schedule:
    ranks = list(schedule.ranks)
    ranks[rank] = tuple(ops)
    return replace(schedule, ranks=tuple(ranks))


def _index(ops, kind, microbatch) -> int:
    return next(i for i, op in enumerate(ops) if op.kind is kind and op.microbatch == microbatch)


def test_a_correct_schedule_passes(plan):
    check_schedule(plan, build_schedule(plan))


def test_receives_out_of_channel_order(plan):
    schedule = build_schedule(plan)
    ops = list(schedule.of(1))  # RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1 ...: take microbatch 1 first
    first, second = ops[0:4], ops[4:8]
    ops[0:8] = second + first
    with pytest.raises(
        ScheduleError, match=r"channel act 0->1: message 0 is sent as .* \(0, 0, 2, 1\) but received as \(1, 0, 2, 1\)"
    ):
        check_schedule(plan, _with(schedule, 1, ops))


def test_a_send_without_its_receive(plan):
    schedule = build_schedule(plan)
    ops = [op for op in schedule.of(1) if not (op.kind is OpKind.RECV_F and op.microbatch == 2)]
    with pytest.raises(ScheduleError, match=r"activations received before it cover rows \[\], not \[0, 2\)"):
        check_schedule(plan, _with(schedule, 1, ops))


def test_a_deadlock(plan):
    schedule = build_schedule(plan)
    ops = list(schedule.of(0))
    # Wait for microbatch 0's gradient before sending its activations: rank 0 waits for the
    # gradient, rank 1 for the activations (the channels' orders are unchanged).
    receive = ops.pop(_index(ops, OpKind.RECV_B, 0))
    backward = ops.pop(_index(ops, OpKind.BACKWARD, 0))
    ops[1:1] = [receive, backward]
    with pytest.raises(
        ScheduleError, match=r"deadlocks with blocking receives: rank 0 at op 1 \(RECV_B0.*; rank 1 at op 0 \(RECV_F0"
    ):
        check_schedule(plan, _with(schedule, 0, ops))


def test_a_backward_before_its_forward(plan):
    schedule = build_schedule(plan)
    ops = list(schedule.of(3))  # shard 1 of the sharded stage: F3 B3 F4 B4
    f, b = _index(ops, OpKind.FORWARD, 3), _index(ops, OpKind.BACKWARD, 3)
    ops[f], ops[b] = ops[b], ops[f]
    with pytest.raises(
        ScheduleError, match=r"rank 3, op 0 \(B3\[0:4\)r1:2\): backward of microbatch 3 before its forward"
    ):
        check_schedule(plan, _with(schedule, 3, ops))


def test_gradients_after_the_reduction_or_a_wrong_final_op(plan):
    schedule = build_schedule(plan)
    ops = list(schedule.of(3))
    reduce = ops.pop()
    ops.insert(len(ops) - 1, reduce)
    with pytest.raises(ScheduleError, match="adds to gradients after the REDUCE_GRAD"):
        check_schedule(plan, _with(schedule, 3, ops))
    ops = [replace(op, final=False) for op in schedule.of(3)]
    with pytest.raises(ScheduleError, match=r"must be the one op marked final \(marked: \[\]\)"):
        check_schedule(plan, _with(schedule, 3, ops))


def test_a_microbatch_processed_twice_or_never(plan):
    schedule = build_schedule(plan)
    # Shard 1 of the sharded stage drops microbatch 4: its rows [1, 2) are never processed.
    ops = [op for op in schedule.of(3) if op.microbatch != 4 or op.kind is OpKind.REDUCE_GRAD]
    ops = [replace(op, final=False) for op in ops]
    last = max(i for i, op in enumerate(ops) if op.kind is OpKind.BACKWARD)
    ops[last] = replace(ops[last], final=True)
    with pytest.raises(
        ScheduleError, match=r"layer 0 of microbatch 4 gets forward over rows \[\(0, 1\)\], not exactly once"
    ):
        check_schedule(plan, _with(schedule, 3, ops))
    # Shard 0 takes all rows of microbatch 4 while shard 1 still takes its half.
    ops = [replace(op, hi=2) if op.microbatch == 4 else op for op in schedule.of(2)]
    with pytest.raises(ScheduleError, match=r"microbatch 4 gets forward over rows \[\(0, 2\), \(1, 2\)\]"):
        check_schedule(plan, _with(schedule, 2, ops))


def test_a_stage_computing_layers_it_does_not_hold(plan):
    schedule = build_schedule(plan)
    ops = [replace(op, end=3) if op.kind is OpKind.FORWARD else op for op in schedule.of(0)]
    with pytest.raises(ScheduleError, match=r"computes layers \[0, 3\) but holds \(0, 2\)"):
        check_schedule(plan, _with(schedule, 0, ops))


def test_a_redundant_forward_before_the_forward_it_reads():
    from oobleck.planning.outputs import ShadowCopy

    two = make_template([(0, 2, 0, 0, 1), (2, 4, 1, 0, 1)])
    plan = make_plan([(two, 2)], layers=4, micro=2, gpus=1)
    plan = replace(plan, shadows=(ShadowCopy(0, 0, (2, 3)), ShadowCopy(0, 1, (0, 1))), redundancy="inline")
    schedule = build_schedule(plan)
    ops = list(schedule.of(0))
    f, rf = _index(ops, OpKind.FORWARD, 0), _index(ops, OpKind.REDUNDANT_FORWARD, 0)
    ops.insert(f, ops.pop(rf))
    with pytest.raises(ScheduleError, match="reads the output of microbatch 0's forward, which has not run"):
        check_schedule(plan, _with(schedule, 0, ops))

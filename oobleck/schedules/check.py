"""Static checks of a schedule against its plan, run before any rank executes it.

``check_schedule`` raises ``ScheduleError`` naming the rank, the op and what is wrong when:

- a rank computes layers it does not hold, or rows outside a microbatch;
- a microbatch's forward does not precede its backward on a rank (or its input gradient its
  weight gradient), or a rank runs one of them twice or leaves one out;
- a compute op's inputs are not all received before it (the rows of its receives must tile its
  own), or a send goes out before the op that produces it;
- a redundant forward runs before the forward whose output it reads;
- a send has no receive, or a channel's messages are received in another order than sent (each
  channel is FIFO: a mismatch would hand one microbatch's tensor to another's op);
- the lists deadlock when run with blocking receives and asynchronous sends;
- a rank's gradients are not complete before its reduction: the op marked ``final`` is not its
  last B or W, or a B or W comes after its ``REDUCE_GRAD``;
- across all ranks, some layer of some microbatch is not forwarded (or backwarded) exactly once
  over its rows ``[0, b)``: every sample of the global batch is processed exactly once per step.
"""

from __future__ import annotations

from collections import defaultdict

from oobleck.errors import PlanningError
from oobleck.planning.outputs import ExecutionPlan
from oobleck.schedules.bamboo import shadow_range
from oobleck.schedules.ops import GRADIENT, RECEIVES, SENDS, Op, OpKind, Schedule
from oobleck.schedules.simulate import channel, run_lists

F, B, I, W, RF = (
    OpKind.FORWARD,
    OpKind.BACKWARD,
    OpKind.BACKWARD_INPUT,
    OpKind.BACKWARD_WEIGHT,
    OpKind.REDUNDANT_FORWARD,
)


class ScheduleError(PlanningError):
    """A schedule that would compute the wrong thing, or block, if it ran."""


def check_schedule(plan: ExecutionPlan, schedule: Schedule) -> None:
    """Raise ``ScheduleError`` if ``schedule`` is not a correct, deadlock-free schedule of ``plan``."""
    assignments = plan.assignments()
    if len(schedule.ranks) != len(assignments):
        raise ScheduleError(f"the schedule has {len(schedule.ranks)} ranks but the plan {len(assignments)}")
    for rank, ops in enumerate(schedule.ranks):
        _check_rank(plan, rank, ops)
    _check_channels(schedule)
    timeline = run_lists(schedule)
    if not timeline.finished:
        stuck = [
            f"rank {r} at op {timeline.stopped_at[r]} ({ops[timeline.stopped_at[r]]})"
            for r, ops in enumerate(schedule.ranks)
            if timeline.stopped_at[r] < len(ops)
        ]
        raise ScheduleError(
            "the schedule deadlocks with blocking receives: " + "; ".join(stuck) + f"\n{schedule.format()}"
        )
    _check_coverage(plan, schedule)


def _fail(rank: int, index: int, op: Op | None, why: str) -> ScheduleError:
    where = f"rank {rank}, op {index} ({op})" if op is not None else f"rank {rank}"
    return ScheduleError(f"{where}: {why}")


def _check_rank(plan: ExecutionPlan, rank: int, ops: tuple[Op, ...]) -> None:
    assignment = plan.assignments()[rank]
    own = (assignment.layers[0], assignment.layers[-1] + 1)
    shadow = shadow_range(plan, rank)
    b = plan.microbatch_size
    world = len(plan.assignments())
    state: dict[int, dict[OpKind, int]] = defaultdict(dict)  # microbatch -> kind -> op index
    received: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)  # (mb, act|grad) -> rows
    gradient_ops = [i for i, op in enumerate(ops) if op.kind in GRADIENT]
    reductions = [i for i, op in enumerate(ops) if op.kind is OpKind.REDUCE_GRAD]
    if len(reductions) != 1:
        raise _fail(rank, 0, None, f"needs exactly one REDUCE_GRAD, has {len(reductions)}")
    if gradient_ops and gradient_ops[-1] > reductions[0]:
        raise _fail(rank, gradient_ops[-1], ops[gradient_ops[-1]], "adds to gradients after the REDUCE_GRAD")
    finals = [i for i, op in enumerate(ops) if op.final]
    if gradient_ops and finals != [gradient_ops[-1]]:
        raise _fail(
            rank, gradient_ops[-1], ops[gradient_ops[-1]], f"must be the one op marked final (marked: {finals})"
        )
    for index, op in enumerate(ops):
        if op.kind is OpKind.REDUCE_GRAD:
            continue
        if not 0 <= op.lo < op.hi <= b:
            raise _fail(rank, index, op, f"rows [{op.lo}, {op.hi}) are not rows of a microbatch of {b}")
        if op.kind in SENDS or op.kind in RECEIVES:
            if not 0 <= op.peer < world or op.peer == rank:
                raise _fail(rank, index, op, f"peer {op.peer} is not another rank of the plan's {world}")
            _check_comm(rank, index, op, state, received)
            continue
        expected = shadow if op.kind is RF else own
        if (op.start, op.end) != expected:
            raise _fail(rank, index, op, f"computes layers [{op.start}, {op.end}) but holds {expected} for it")
        _check_compute(plan, rank, index, op, state, received)
    for mb, kinds in state.items():
        if F in kinds and B not in kinds and W not in kinds:
            raise _fail(rank, kinds[F], ops[kinds[F]], f"microbatch {mb} is never backwarded completely")


def _check_comm(rank: int, index: int, op: Op, state: dict, received: dict) -> None:
    kinds = state[op.microbatch]
    if op.kind is OpKind.RECV_F:
        received[(op.microbatch, "act")].append((op.lo, op.hi))
    elif op.kind is OpKind.RECV_B:
        received[(op.microbatch, "grad")].append((op.lo, op.hi))
    elif op.kind is OpKind.SEND_F and F not in kinds:
        raise _fail(rank, index, op, "sends activations before the forward that produces them")
    elif op.kind is OpKind.SEND_B and B not in kinds and I not in kinds:
        raise _fail(rank, index, op, "sends an input gradient before the backward that produces it")


def _check_compute(plan: ExecutionPlan, rank: int, index: int, op: Op, state: dict, received: dict) -> None:
    kinds = state[op.microbatch]
    mb = op.microbatch
    if op.kind in kinds:
        raise _fail(rank, index, op, f"runs {op.kind.value} of microbatch {mb} a second time")
    if op.kind is RF:
        if op.start > 0 and (F not in kinds):
            raise _fail(rank, index, op, f"reads the output of microbatch {mb}'s forward, which has not run")
    elif op.kind is F:
        if op.start > 0:
            _tiled(rank, index, op, received.pop((mb, "act"), []), "activations")
    elif op.kind in (B, I):
        if F not in kinds:
            raise _fail(rank, index, op, f"backward of microbatch {mb} before its forward")
        if B in kinds or I in kinds:
            raise _fail(rank, index, op, f"backward of microbatch {mb} a second time")
        if op.end < plan.num_layers:
            _tiled(rank, index, op, received.pop((mb, "grad"), []), "output gradients")
    elif op.kind is W:
        if I not in kinds:
            raise _fail(rank, index, op, f"weight gradient of microbatch {mb} before its input gradient")
    kinds[op.kind] = index


def _tiled(rank: int, index: int, op: Op, parts: list[tuple[int, int]], what: str) -> None:
    if sorted(parts) != parts or not parts or parts[0][0] != op.lo or parts[-1][1] != op.hi:
        raise _fail(rank, index, op, f"its {what} received before it cover rows {parts}, not [{op.lo}, {op.hi})")
    for (_, hi), (lo, _) in zip(parts, parts[1:]):
        if hi != lo:
            raise _fail(rank, index, op, f"its {what} received before it cover rows {parts}, not [{op.lo}, {op.hi})")


def _message(op: Op) -> tuple[int, int, int, int]:
    """What a send or receive moves: (microbatch, rows, the layer whose output (gradient) it is)."""
    boundary = op.end - 1 if op.kind in (OpKind.SEND_F, OpKind.RECV_B) else op.start - 1
    return op.microbatch, op.lo, op.hi, boundary


def _check_channels(schedule: Schedule) -> None:
    sends: dict[tuple[int, int, str], list[tuple[int, int, int, int]]] = defaultdict(list)
    receives: dict[tuple[int, int, str], list[tuple[int, int, int, int]]] = defaultdict(list)
    for rank, ops in enumerate(schedule.ranks):
        for op in ops:
            if op.kind in SENDS:
                sends[channel(rank, op)].append(_message(op))
            elif op.kind in RECEIVES:
                receives[channel(rank, op)].append(_message(op))
    for key in sorted(set(sends) | set(receives)):
        sent, taken = sends.get(key, []), receives.get(key, [])
        if sent == taken:
            continue
        src, dst, direction = key
        k = next((i for i, (a, c) in enumerate(zip(sent, taken)) if a != c), min(len(sent), len(taken)))
        mine = sent[k] if k < len(sent) else None
        theirs = taken[k] if k < len(taken) else None
        raise ScheduleError(
            f"channel {direction} {src}->{dst}: message {k} is sent as (microbatch, rows, layer) {mine} but "
            f"received as {theirs}: every send needs its receive, in the same order"
        )


def _check_coverage(plan: ExecutionPlan, schedule: Schedule) -> None:
    b, layers = plan.microbatch_size, plan.num_layers
    forward: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)
    backward: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)
    for ops in schedule.ranks:
        for op in ops:
            if op.kind is F:
                forward[op.microbatch].append((op.start, op.end, op.lo, op.hi))
            elif op.kind in (B, I):
                backward[op.microbatch].append((op.start, op.end, op.lo, op.hi))
    for what, done in (("forward", forward), ("backward", backward)):
        if set(done) != set(range(plan.num_microbatches)):
            missing = sorted(set(range(plan.num_microbatches)) - set(done))
            extra = sorted(set(done) - set(range(plan.num_microbatches)))
            raise ScheduleError(f"microbatches {missing} get no {what}; {extra} are not the plan's")
        for mb, parts in done.items():
            # Rectangles (layers x rows) that cover the microbatch's whole area and do not overlap
            # tile it exactly; only a failure pays for the per-layer account in the message.
            area = sum((end - start) * (hi - lo) for start, end, lo, hi in parts)
            if area != layers * b or _overlapping(parts):
                _explain(mb, parts, what, layers, b)


def _overlapping(parts: list[tuple[int, int, int, int]]) -> bool:
    ordered = sorted(parts)
    for i, (_, end, lo, hi) in enumerate(ordered):
        for other in ordered[i + 1 :]:
            if other[0] >= end:
                break
            if other[2] < hi and lo < other[3]:
                return True
    return False


def _explain(mb: int, parts: list[tuple[int, int, int, int]], what: str, layers: int, b: int) -> None:
    for layer in range(layers):
        covered = sorted((lo, hi) for start, end, lo, hi in parts if start <= layer < end)
        total = sum(hi - lo for lo, hi in covered)
        tiled = all(a[1] == c[0] for a, c in zip(covered, covered[1:]))
        if total != b or not tiled or not covered or covered[0][0] != 0:
            raise ScheduleError(
                f"layer {layer} of microbatch {mb} gets {what} over rows {covered}, not exactly once over [0, {b})"
            )

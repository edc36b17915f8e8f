"""REFERENCE (not used by the package): ``oobleck.schedules.lower.lower`` written the plain way,
finding each task's place on its route and its neighbouring shards' rows anew for every task. The
package works those out once per route and shard; the tests compare the op lists of the two on
many plans and they must be identical, so keep this copy as it is.
"""

from __future__ import annotations

from dataclasses import replace

from oobleck.schedules.lower import Slot, Task
from oobleck.schedules.ops import GRADIENT, Op, OpKind
from oobleck.schedules.routes import Hop, Routes, rows


def position(routes: Routes, slot: Slot, microbatch: int) -> int:
    """Where ``slot`` is on ``microbatch``'s route."""
    for index, hop in enumerate(routes.by_microbatch[microbatch].hops):
        if (hop.pipeline, hop.stage) == slot:
            return index
    raise ValueError(f"microbatch {microbatch} does not pass stage {slot[1]} of pipeline {slot[0]}")


def lower(routes: Routes, orders: dict[Slot, list[Task]]) -> list[list[Op]]:
    """Every rank's op list (indexed by rank) for the compute orders of every slot."""
    b = routes.microbatch_size
    result: list[list[Op]] = [[] for _ in routes.plan.assignments()]
    for slot, hop in routes.slots.items():
        for shard, rank in enumerate(hop.ranks):
            lo, hi = rows(b, len(hop.ranks), shard)
            ops = result[rank]
            if hi > lo:
                for task in orders.get(slot, []):
                    ops += _lower_task(routes, hop, rank, (lo, hi), task)
            result[rank] = _mark_final(ops)
            result[rank].append(Op(OpKind.REDUCE_GRAD, start=hop.start, end=hop.end))
    return result


def _lower_task(routes: Routes, hop: Hop, rank: int, mine: tuple[int, int], task: Task) -> list[Op]:
    route = routes.by_microbatch[task.microbatch]
    at = position(routes, (hop.pipeline, hop.stage), task.microbatch)
    last = len(route.hops) - 1
    mb, lo, hi = task.microbatch, mine[0], mine[1]
    compute = Op(task.kind, mb, hop.start, hop.end, lo, hi)

    def comm(kind: OpKind, offset: int) -> list[Op]:
        return [
            Op(kind, mb, hop.start, hop.end, a, c, peer=peer)
            for peer, (a, c) in routes.neighbours(hop, rank, route, at, offset)
        ]

    if task.kind is OpKind.FORWARD:
        before = comm(OpKind.RECV_F, -1) if at > 0 else []
        after = comm(OpKind.SEND_F, +1) if at < last else []
    elif task.kind in (OpKind.BACKWARD, OpKind.BACKWARD_INPUT):
        before = comm(OpKind.RECV_B, +1) if at < last else []
        after = comm(OpKind.SEND_B, -1) if at > 0 else []
    else:
        before, after = [], []
    return [*before, compute, *after]


def _mark_final(ops: list[Op]) -> list[Op]:
    last = max((i for i, op in enumerate(ops) if op.kind in GRADIENT), default=None)
    if last is not None:
        ops[last] = replace(ops[last], final=True)
    return ops

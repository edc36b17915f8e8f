"""From compute orders to complete op lists: receives, sends, the final gradient op, the reduction.

A generator decides, for every stage slot (pipeline, stage), the order of its compute tasks
(F, B, I, W of microbatches); every shard of the slot runs that order on its own rows. Lowering
adds the communication the way torch's ``_add_send_recv`` does for its IR, with our semantics:
a receive is blocking and sits right before the compute op that consumes it (one per overlapping
shard of the neighbouring hop, in shard order, so the parts concatenate in row order); a send is
asynchronous and sits right after the op that produced what it sends. Then the last op that adds
to the rank's weight gradients is marked ``final`` and a ``REDUCE_GRAD`` ends the list.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from oobleck.schedules.ops import GRADIENT, Op, OpKind
from oobleck.schedules.routes import Hop, Routes, rows


@dataclass(frozen=True)
class Task:
    """A compute task of a stage slot: ``kind`` (F, B, I or W) of ``microbatch``."""

    kind: OpKind
    microbatch: int


Slot = tuple[int, int]  # (pipeline, stage)


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


def one_f_one_b(stage: int, stages: int, microbatches: list[int]) -> list[Task]:
    """Non-interleaved 1F1B on stage ``stage`` of ``stages``: ``min(stages - stage - 1, m)``
    warm-up forwards, then one forward and one backward alternating, then the remaining backwards
    (torch's ``Schedule1F1B`` and DeepSpeed's ``TrainSchedule`` order)."""
    m = len(microbatches)
    warmup = min(stages - stage - 1, m)
    tasks = [Task(OpKind.FORWARD, microbatches[k]) for k in range(warmup)]
    for k in range(m - warmup):
        tasks.append(Task(OpKind.FORWARD, microbatches[warmup + k]))
        tasks.append(Task(OpKind.BACKWARD, microbatches[k]))
    tasks += [Task(OpKind.BACKWARD, microbatches[k]) for k in range(m - warmup, m)]
    return tasks

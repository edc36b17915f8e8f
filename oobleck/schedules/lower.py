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
from oobleck.schedules.routes import Hop, Route, Routes, rows


@dataclass(frozen=True)
class Task:
    """A compute task of a stage slot: ``kind`` (F, B, I or W) of ``microbatch``."""

    kind: OpKind
    microbatch: int


Slot = tuple[int, int]  # (pipeline, stage)


def positions(routes: Routes) -> dict[int, dict[Slot, int]]:
    """For each microbatch, where each slot is on its route (the first hop of that slot)."""
    result: dict[int, dict[Slot, int]] = {}
    for microbatch, route in routes.by_microbatch.items():
        where: dict[Slot, int] = {}
        for index, hop in enumerate(route.hops):
            where.setdefault((hop.pipeline, hop.stage), index)
        result[microbatch] = where
    return result


def lower(routes: Routes, orders: dict[Slot, list[Task]]) -> list[list[Op]]:
    """Every rank's op list (indexed by rank) for the compute orders of every slot."""
    b = routes.microbatch_size
    result: list[list[Op]] = [[] for _ in routes.plan.assignments()]
    where = positions(routes)
    for slot, hop in routes.slots.items():
        for shard, rank in enumerate(hop.ranks):
            lo, hi = rows(b, len(hop.ranks), shard)
            ops = result[rank]
            if hi > lo:
                shard_ops = _ShardLowering(routes, where, slot, hop, rank, (lo, hi))
                for task in orders.get(slot, []):
                    ops += shard_ops.of(task)
            result[rank] = _mark_final(ops)
            result[rank].append(Op(OpKind.REDUCE_GRAD, start=hop.start, end=hop.end))
    return result


class _ShardLowering:
    """The ops of one shard (``rank``, rows ``mine``) of a slot's tasks. Which shards of a
    neighbouring hop it exchanges rows with depends only on that hop, so each is worked out once."""

    def __init__(
        self, routes: Routes, where: dict[int, dict[Slot, int]], slot: Slot, hop: Hop, rank: int, mine: tuple[int, int]
    ) -> None:
        self.routes, self.where, self.slot, self.hop, self.rank = routes, where, slot, hop, rank
        self.by_microbatch = routes.by_microbatch
        self.start, self.end, self.lo, self.hi = hop.start, hop.end, mine[0], mine[1]
        # id of the neighbouring hop -> (peer, rows) pairs; the hops live in ``routes``, so ids are stable.
        self.peers: dict[int, list[tuple[int, tuple[int, int]]]] = {}

    def of(self, task: Task) -> list[Op]:
        mb, kind = task.microbatch, task.kind
        route = self.by_microbatch[mb]
        at = self.where[mb].get(self.slot)
        if at is None:
            raise ValueError(f"microbatch {mb} does not pass stage {self.slot[1]} of pipeline {self.slot[0]}")
        last = len(route.hops) - 1
        compute = Op(kind, mb, self.start, self.end, self.lo, self.hi)
        if kind is OpKind.FORWARD:
            before = self._comm(OpKind.RECV_F, mb, route, at, -1) if at > 0 else []
            after = self._comm(OpKind.SEND_F, mb, route, at, +1) if at < last else []
        elif kind in (OpKind.BACKWARD, OpKind.BACKWARD_INPUT):
            before = self._comm(OpKind.RECV_B, mb, route, at, +1) if at < last else []
            after = self._comm(OpKind.SEND_B, mb, route, at, -1) if at > 0 else []
        else:
            return [compute]
        return [*before, compute, *after]

    def _comm(self, kind: OpKind, mb: int, route: Route, at: int, offset: int) -> list[Op]:
        """``kind`` ops of microbatch ``mb`` with the shards of the hop ``offset`` away on its route."""
        other = route.hops[at + offset]
        peers = self.peers.get(id(other))
        if peers is None:
            peers = self.peers[id(other)] = self.routes.neighbours(self.hop, self.rank, route, at, offset)
        start, end = self.start, self.end
        return [Op(kind, mb, start, end, a, c, peer=peer) for peer, (a, c) in peers]


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

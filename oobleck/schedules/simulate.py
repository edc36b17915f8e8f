"""Run every rank's op list the way the runtime does: blocking receives, asynchronous sends.

One engine serves the static check (zero durations: does every list reach its end?) and the
operation-level cost (``oobleck.schedules.cost``: durations from the profile). Each rank executes
its ops in order; a compute op advances its clock by its duration; a send returns at once and its
message arrives ``delivery`` seconds later; a receive waits until the matching message (the next
one on its channel: channels are FIFO, one per sender, receiver and direction) has arrived.
Because a rank's progress depends only on messages already sent, the order in which ranks are
advanced does not change any time (the result is the longest path through the ops).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from oobleck.schedules.ops import RECEIVES, SENDS, Op, OpKind, Schedule

_DIRECTION = {OpKind.SEND_F: "act", OpKind.RECV_F: "act", OpKind.SEND_B: "grad", OpKind.RECV_B: "grad"}


def channel(rank: int, op: Op) -> tuple[int, int, str]:
    """(sender, receiver, direction) of a send or receive op of ``rank``."""
    if op.kind in SENDS:
        return rank, op.peer, _DIRECTION[op.kind]
    return op.peer, rank, _DIRECTION[op.kind]


@dataclass(frozen=True)
class Timeline:
    """What running the lists gave: per rank the time its last op ended and its compute seconds,
    and where each rank stopped (its list's length when it finished)."""

    end: tuple[float, ...]
    busy: tuple[float, ...]
    stopped_at: tuple[int, ...]
    finished: bool

    @property
    def makespan(self) -> float:
        return max(self.end, default=0.0)


def run_lists(
    schedule: Schedule,
    duration: Callable[[int, Op], float] = lambda rank, op: 0.0,
    delivery: Callable[[int, Op], float] = lambda rank, op: 0.0,
) -> Timeline:
    """Execute every rank's list (see the module docstring); ``finished`` is False on a deadlock."""
    ranks = schedule.ranks
    position = [0] * len(ranks)
    clock = [0.0] * len(ranks)
    busy = [0.0] * len(ranks)
    sent: dict[tuple[int, int, str], list[float]] = {}
    taken: dict[tuple[int, int, str], int] = {}
    progress = True
    while progress:
        progress = False
        for rank, ops in enumerate(ranks):
            while position[rank] < len(ops):
                op = ops[position[rank]]
                if op.kind in RECEIVES:
                    key = channel(rank, op)
                    index = taken.get(key, 0)
                    arrivals = sent.get(key, [])
                    if index >= len(arrivals):
                        break
                    clock[rank] = max(clock[rank], arrivals[index])
                    taken[key] = index + 1
                elif op.kind in SENDS:
                    sent.setdefault(channel(rank, op), []).append(clock[rank] + delivery(rank, op))
                else:
                    seconds = duration(rank, op)
                    clock[rank] += seconds
                    busy[rank] += seconds
                position[rank] += 1
                progress = True
    finished = all(position[r] == len(ops) for r, ops in enumerate(ranks))
    return Timeline(tuple(clock), tuple(busy), tuple(position), finished)

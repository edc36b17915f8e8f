"""Worker liveness, the controller's side: frozen workers and collectives nobody answered.

Every worker's heartbeat (``oobleck.runtime.liveness``) carries a counter and its wait state. The
controller reads them every ``cluster.heartbeat_interval_s`` (``Membership.check_workers``):

- a counter that has not moved for ``cluster.heartbeat_timeout_s`` is a frozen (or hung) worker:
  its node fails, as if it had been killed (``WorkerBeats`` keeps when each counter last moved);
- a rank of the current generation that has waited longer than ``cluster.collective_timeout_s``
  is waiting on ranks that did not answer. Following "waits on" from it (the ranks each waiting
  rank waits on) ends at ranks that are not waiting: computing, stuck in a call, without a fresh
  heartbeat, or still in an older generation. Those did not answer, and their nodes fail
  (``unanswered``). When every rank reached is itself waiting (the waits form a cycle: ranks
  waiting on each other's different operations, or a node cut off from the others' data plane:
  every rank then waits on another) no rank can be blamed from the waits alone; the controller
  then asks the data plane itself (``Membership.unreachable``) and stops the run, saying which wait
  timed out, only when that blames nobody either;
- a worker of the current generation that has left it and waits for the next one
  (``Beat.awaiting``) for longer than ``cluster.collective_timeout_s``, although the controller
  never ended the generation, is *stranded* (``stranded``): the controller ends the generation and
  publishes the next one on the same plan.

Pure functions over parsed beats, so the rules are tested without processes
(``tests/elastic/test_watchdog.py``).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Beat:
    """One heartbeat of a worker."""

    count: int
    generation: int  # the generation the worker lives in (-1 before its first)
    rank: int  # its rank there (-1: not used by that generation's plan)
    wait: str | None  # what its main thread waits on; None while it computes
    peers: tuple[int, ...] | None  # the ranks it waits on; None: every rank of the generation
    waited_s: float  # how long it has waited so far
    awaiting: int | None = None  # the generation it waits for, having left its own (None: it has not)


def parse_beat(value: bytes | str) -> Beat:
    """The beat a heartbeat value holds (``ValueError``, ``TypeError`` or ``KeyError`` when it is
    not one: the value is then dropped where it is read)."""
    data: Any = json.loads(value)
    peers = data["peers"]
    awaiting = data.get("awaiting")
    return Beat(
        count=int(data["count"]),
        generation=int(data["generation"]),
        rank=int(data["rank"]),
        wait=None if data["wait"] is None else str(data["wait"]),
        peers=None if peers is None else tuple(int(p) for p in peers),
        waited_s=float(data["waited_s"]),
        awaiting=None if awaiting is None else int(awaiting),
    )


@dataclass(frozen=True)
class Verdict:
    """A collective that timed out: who waited on what, and the ranks that did not answer."""

    waiter: int
    what: str
    waited_s: float
    culprits: tuple[int, ...]  # empty: the waits form a cycle, nobody to blame


def unanswered(beats: Mapping[int, Beat | None], generation: int, timeout_s: float) -> Verdict | None:
    """The ranks a wait longer than ``timeout_s`` is stuck on (see the module docstring).

    ``beats``: every rank of ``generation`` -> its latest fresh beat (None: none, or a stale one).
    """
    waiting = {
        rank: beat
        for rank, beat in beats.items()
        if beat is not None
        and beat.generation == generation
        and beat.rank == rank
        and beat.wait is not None
        and beat.awaiting is None
    }
    stuck = [rank for rank, beat in waiting.items() if beat.waited_s > timeout_s]
    if not stuck:
        return None
    first = max(stuck, key=lambda rank: (waiting[rank].waited_s, -rank))
    world = sorted(beats)
    seen, queue, culprits = {first}, deque([first]), set()
    while queue:
        rank = queue.popleft()
        peers = waiting[rank].peers
        for peer in world if peers is None else peers:
            if peer in seen or peer not in beats:
                continue
            seen.add(peer)
            if peer in waiting:
                queue.append(peer)
            else:
                culprits.add(peer)
    beat = waiting[first]
    return Verdict(first, beat.wait or "", beat.waited_s, tuple(sorted(culprits)))


def stranded(beats: Mapping[int, Beat | None], generation: int, timeout_s: float) -> tuple[int, ...]:
    """The ranks of ``generation`` that left it and have waited longer than ``timeout_s`` for the
    next one (``beats`` as for ``unanswered``); the caller knows it never ended ``generation``."""
    return tuple(
        sorted(
            rank
            for rank, beat in beats.items()
            if beat is not None
            and beat.generation == generation
            and beat.rank == rank
            and beat.awaiting is not None
            and beat.waited_s > timeout_s
        )
    )


class WorkerBeats:
    """The counters of the workers the controller watches, and when each last moved (its clock)."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, float]] = {}  # key -> (count, when it last changed)

    def update(self, key: str, beat: Beat | None, now: float) -> None:
        """Record a read of ``key`` (None: missing or not verified, which does not count as a beat)."""
        previous = self._seen.get(key)
        if beat is None:
            if previous is None:
                self._seen[key] = (-1, now)
            return
        if previous is None or beat.count != previous[0]:
            self._seen[key] = (beat.count, now)

    def since(self, key: str) -> float | None:
        """When ``key``'s counter last moved."""
        seen = self._seen.get(key)
        return seen[1] if seen is not None else None

    def forget(self, key: str) -> None:
        self._seen.pop(key, None)

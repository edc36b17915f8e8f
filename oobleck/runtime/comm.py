"""Generation-scoped communication: one rank's process groups of a generation and the operations on them.

A generation's process groups all live under ``PrefixStore("g<g>", store)``. They are built in a
helper thread and every operation's wait goes through the generation's ``Waiter``
(``oobleck.runtime.waits``), so an abort interrupts both; an aborted generation's groups are
handed to the reaper (``oobleck.runtime.reaper``), never destroyed in-line.

Point-to-point channels are two-rank groups used with ``broadcast`` (root = sender): gloo's
``send``/``recv`` works have no future (``Work::getFuture not implemented``) and would have to be
busy-polled, and ``wait(timeout)`` on them closes the pair when it expires. One channel per
(sender, receiver, direction) keeps each channel's messages in microbatch order on both sides.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from oobleck.runtime import keys
from oobleck.runtime.store_client import make_store
from oobleck.runtime.waits import Aborted, Waiter, is_completed


@dataclass(frozen=True)
class GroupSpec:
    """A process group of a generation: a unique name and the sorted global ranks in it."""

    name: str
    ranks: tuple[int, ...]


class Communicator:
    """The process groups of one generation, as seen by one rank."""

    def __init__(
        self,
        generation: int,
        rank: int,
        specs: list[GroupSpec],
        *,
        host: str,
        port: int,
        timeout_s: float,
        waiter: Waiter,
        space: keys.KeySpace,
    ) -> None:
        self.generation = generation
        self.rank = rank
        self.waiter = waiter
        self.backend = waiter.backend
        self.groups: dict[str, tuple[Any, tuple[int, ...]]] = {}
        self._specs = [s for s in sorted(specs, key=lambda s: s.name) if rank in s.ranks]
        self._host, self._port = host, port
        self._timeout_s = timeout_s
        # Torch's rendezvous keys of this generation's groups live under a prefix only the run can
        # name, so no other client can pre-empt them.
        self._prefix = space.name(keys.prefix(generation))
        self._store: Any = None
        self.inflight: list[tuple[str, Any]] = []  # (group name, issued work), pruned as they complete

    def build(self) -> None:
        """Create every group this rank belongs to (in a global name order, so no two ranks wait
        on each other in opposite orders), in a helper thread so an abort can interrupt it."""
        future = run_in_thread(self._build_all, f"groups-g{self.generation}")
        peers = tuple(sorted({r for spec in self._specs for r in spec.ranks} - {self.rank}))
        self.waiter.future(future, f"creating the process groups of generation {self.generation}", peers)

    def _build_all(self) -> None:
        # A private store connection: if this thread is abandoned mid-rendezvous it may block on
        # it until the timeout, and must not hold the connection the main thread uses.
        store = make_store(self._host, self._port, self._timeout_s)
        self._store = store
        base = dist.PrefixStore(self._prefix, store)
        built: dict[str, tuple[Any, tuple[int, ...]]] = {}
        for spec in self._specs:
            if self.waiter.watch.aborted.is_set():
                raise Aborted()  # what was built is dropped here, in this helper thread
            group_store = dist.PrefixStore(spec.name, base)
            group_rank = spec.ranks.index(self.rank)
            built[spec.name] = (
                self.backend.new_group(group_store, group_rank, len(spec.ranks), self._timeout_s),
                spec.ranks,
            )
        if self.waiter.watch.aborted.is_set():
            raise Aborted()
        self.groups = built

    def has(self, name: str) -> bool:
        return name in self.groups

    def group_rank(self, name: str, global_rank: int) -> int:
        return self.groups[name][1].index(global_rank)

    # Operations: each returns a work; callers wait with ``self.waiter.work``.
    def _issued(self, name: str, work: Any, ranks: tuple[int, ...]) -> Any:
        if len(self.inflight) > 64:
            self.inflight = [(n, w) for n, w in self.inflight if not is_completed(w)]
        self.inflight.append((name, work))
        self.waiter.expect(work, tuple(r for r in ranks if r != self.rank))
        return work

    def allreduce(self, name: str, tensor: torch.Tensor) -> Any:
        group, ranks = self.groups[name]
        return self._issued(name, group.allreduce([tensor]), ranks)

    def broadcast(self, name: str, tensor: torch.Tensor, root_global_rank: int) -> Any:
        group, ranks = self.groups[name]
        options = dist.BroadcastOptions()
        options.rootRank = ranks.index(root_global_rank)
        options.rootTensor = 0
        return self._issued(name, group.broadcast([tensor], options), ranks)

    def probe_link(self, name: str, sender_global_rank: int, nbytes: int) -> tuple[float, float]:
        """Seconds for a raw gloo ``send``/``recv`` of ``nbytes`` from ``sender_global_rank`` to
        the other rank of the two-rank group ``name``, as the receiver sees it: ``(into fresh
        memory, into the same memory again)``. The link's own speed between these two processes,
        the peer figure for a state copy (which lands in fresh memory). Each repeat starts
        together on both sides (a one-element broadcast first). For benchmarks only: raw
        send/recv works have no future, so these waits are bounded by the group's timeout but
        cannot be aborted."""
        group, ranks = self.groups[name]
        peer = ranks.index(ranks[1 - ranks.index(self.rank)])
        start = torch.zeros(1, device=self.backend.device)
        buf = None
        seconds = []
        for _ in range(2):
            self.waiter.work(self.broadcast(name, start, sender_global_rank), f"starting the link probe on {name}")
            began = time.perf_counter()
            if buf is None:
                buf = torch.empty(max(1, nbytes // 4), device=self.backend.device)
            if self.rank == sender_global_rank:
                group.send([buf], peer, 0).wait()
            else:
                group.recv([buf], peer, 0).wait()
            seconds.append(time.perf_counter() - began)
        return seconds[0], seconds[1]

    def allreduce_wait(self, name: str, tensor: torch.Tensor, what: str) -> None:
        self.waiter.work(self.allreduce(name, tensor), what)

    def release(self) -> list[tuple[list[Any], list[Any]]]:
        """Hand over every group object (and the store connection) for parking, as parcels of
        (objects, their pending works): each group with its own works only. A group parked until
        every work of the generation completes can hold up a peer's group whose work waits on it,
        while that peer's other groups hold up this one's: both then sit until the timeout. Per
        group, a group with nothing pending is dropped at once, which fails the peer's unmatched
        work on it fast (a gradient bucket one side launched before the abort, say)."""
        pending: dict[str, list[Any]] = {}
        for name, work in self.inflight:
            if not is_completed(work):
                pending.setdefault(name, []).append(work)
        groups = [g for g, _ in self.groups.values()]
        self.backend.release(groups)
        parcels: list[tuple[list[Any], list[Any]]] = [
            ([group], pending.get(name, [])) for name, (group, _) in self.groups.items()
        ]
        if self._store is not None:
            parcels.append(([self._store], []))
        self.groups = {}
        self._store = None
        self.inflight = []
        self.waiter.forget_peers()
        return parcels


def channel_name(src: int, dst: int, kind: str) -> str:
    """A two-rank P2P channel: ``kind`` is ``act`` (forward) or ``grad`` (backward) or ``xfer``."""
    return f"p2p/{kind}/{src}-{dst}"


def run_in_thread(fn: Callable[[], Any], name: str) -> concurrent.futures.Future:
    """Run a blocking call in a fresh daemon thread (one that an abort may abandon)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        try:
            future.set_result(fn())
        except BaseException as error:  # handed to the waiting thread
            future.set_exception(error)

    threading.Thread(target=target, daemon=True, name=name).start()
    return future

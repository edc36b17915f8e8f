"""Generation-scoped communication: process groups, abortable waits and the abort watcher.

A generation's process groups all live under ``PrefixStore("g<g>", store)``. Every wait is on an
event that either the operation (through its future) or the abort watcher sets, so a worker
blocked on a peer that died (or on a peer that has itself moved on) wakes up as soon as the
controller aborts the generation, without polling (on NCCL, whose futures complete when an op is
enqueued rather than run, the wait polls the op's CUDA event instead: ``oobleck.runtime.backend``
holds every gloo/NCCL difference). Aborted groups are never destroyed in-line: gloo's destructor
waits for pending operations until the group timeout (measured, see /work/shared/notes), so they
are parked and released by one reaper thread after that timeout.

A wait that outlasts ``cluster.collective_timeout_s`` does not end the run on its own: the
worker's heartbeat (``oobleck.runtime.liveness``) says what it waits on and on which ranks, the
controller turns the ranks that did not answer into a failure, and the abort that follows ends the
wait like any other; only if no abort comes within the grace does the worker give up.

Point-to-point channels are two-rank groups used with ``broadcast`` (root = sender): gloo's
``send``/``recv`` works have no future (``Work::getFuture not implemented``) and would have to be
busy-polled, and ``wait(timeout)`` on them closes the pair when it expires. One channel per
(sender, receiver, direction) keeps each channel's messages in microbatch order on both sides.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from oobleck.errors import RunError
from oobleck.runtime import keys
from oobleck.runtime.backend import Backend
from oobleck.runtime.liveness import Liveness
from oobleck.runtime.sealed_store import SealedStore

# Polling a device-side op (see ``Waiter.poll``): the first re-check comes quickly (a collective
# of a small tensor finishes in tens of microseconds on a GPU), then the pause doubles up to a
# millisecond, so a long wait costs the host little and a finished op is seen within ~1 ms.
_POLL_FIRST_S = 20e-6
_POLL_MAX_S = 1e-3
# Works whose peers a waiter remembers at most (a generation issues a few per microbatch and
# waits for each; only works abandoned without a wait could pile up).
_MAX_EXPECTED = 4096


class Aborted(Exception):
    """The controller aborted the current generation (a membership change, or a stop)."""


@dataclass(frozen=True)
class GroupSpec:
    """A process group of a generation: a unique name and the sorted global ranks in it."""

    name: str
    ranks: tuple[int, ...]


def make_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A plain client connection to a TCPStore."""
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def connect(host: str, port: int, timeout_s: float, space: keys.KeySpace) -> SealedStore:
    """A client connection to the controller's TCPStore, in the run's key space."""
    return SealedStore(make_store(host, port, timeout_s), space)


# The abort watch's store wait is cut into slices only because a TCPStore wait needs a timeout;
# c10d logs two warning lines for every slice that times out, so short slices (it was 30 s) fill
# a long run's logs with them. A slice bounds nothing: the watch lasts the generation.
ABORT_WATCH_SLICE = timedelta(hours=1)


class AbortWatch:
    """Waits (on its own store connection, in one thread at a time) for ``abort/<g>``.

    When the key appears it sets ``aborted`` and every pending wait event, so blocked waits in
    the main thread return at once. A lost store connection (the controller is gone, so no step
    can commit any more) ends the watch the same way.
    """

    def __init__(self, host: str, port: int, timeout_s: float, space: keys.KeySpace) -> None:
        self._store = connect(host, port, timeout_s, space)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending: set[threading.Event] = set()
        self.generation = -1
        self.aborted = threading.Event()

    def watch(self, generation: int) -> None:
        if self._thread is not None:
            # The previous generation was aborted (that is how we got here), so its thread is
            # returning; join it so one connection is never used by two threads.
            self._thread.join(timeout=30.0)
        with self._lock:
            self.generation = generation
            self.aborted = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(generation, self.aborted), daemon=True, name=f"abort-watch-g{generation}"
        )
        self._thread.start()

    def _run(self, generation: int, flag: threading.Event) -> None:
        # Only the controller can name this key (keys.KeySpace), so its existence is the abort.
        key = keys.abort(generation)
        while True:
            try:
                self._store.wait([key], ABORT_WATCH_SLICE)
                break
            except dist.DistStoreError:  # this slice timed out: keep watching
                continue
            except Exception:  # the store is unreachable: retrying would spin, so end as an abort
                break
        with self._lock:
            flag.set()
            for event in list(self._pending):
                event.set()

    def register(self, event: threading.Event) -> None:
        with self._lock:
            self._pending.add(event)
            if self.aborted.is_set():
                event.set()

    def unregister(self, event: threading.Event) -> None:
        with self._lock:
            self._pending.discard(event)


class Reaper:
    """Drops abandoned process groups once none of their operations is pending any more (peers
    that died or released their side make them fail fast), or at the latest after the group
    timeout, when gloo has failed them itself."""

    def __init__(self, delay_s: float, poll_s: float = 0.2) -> None:
        self.delay_s = delay_s
        self.poll_s = poll_s
        self._parked: list[tuple[float, list[Any], list[Any]]] = []
        self._dropping = 0  # items taken off the list and being destroyed (gloo's destructors may block)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name="group-reaper")
        self._thread.start()

    def park(self, items: list[Any], pending: list[Any] = ()) -> None:  # type: ignore[assignment]
        with self._lock:
            self._parked.append((time.monotonic() + self.delay_s, items, list(pending)))

    def parked(self) -> int:
        """Items waiting for their time to be dropped."""
        with self._lock:
            return sum(len(items) for _, items, _ in self._parked)

    def dropping(self) -> int:
        """Items taken off the list and being destroyed now (a gloo destructor may block)."""
        with self._lock:
            return self._dropping

    def overdue_s(self) -> float:
        """How long past its deadline the longest-waiting parked item is (0.0: none is late).

        How many items are parked follows the pace of failures (a frozen peer keeps a group's
        works pending until the group timeout); an item left here long past its deadline is what
        a leak looks like."""
        now = time.monotonic()
        with self._lock:
            return max([0.0, *(now - deadline for deadline, _, _ in self._parked)])

    def _run(self) -> None:
        while True:
            time.sleep(self.poll_s)
            now = time.monotonic()
            with self._lock:
                ready = [p for p in self._parked if p[0] <= now or all(_completed(w) for w in p[2])]
                self._parked = [p for p in self._parked if p not in ready]
                self._dropping = sum(len(items) for _, items, _ in ready)
            del ready  # may block in gloo's destructor; this thread exists for that
            with self._lock:
                self._dropping = 0


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:
        return True


class Waiter:
    """Abortable waits on collective works and plain futures for one generation.

    Each wait is marked in the worker's ``Liveness`` (what, on which ranks: ``expect`` records a
    work's peers when it is issued) so the controller can see who waits on whom. A wait that
    times out, or an op that fails, waits ``peer_grace_s`` more for the controller's abort. How a
    collective's completion is seen is the backend's (``oobleck.runtime.backend``)."""

    def __init__(
        self,
        watch: AbortWatch,
        timeout_s: float,
        peer_grace_s: float,
        backend: Backend,
        liveness: Liveness | None = None,
    ) -> None:
        self.watch = watch
        self.timeout_s = timeout_s
        self.peer_grace_s = peer_grace_s
        self.backend = backend
        self.liveness = liveness
        self._peers: dict[int, tuple[int, ...]] = {}  # id(work) -> the ranks it waits on

    def expect(self, work: Any, peers: tuple[int, ...]) -> None:
        """``work`` (just issued) completes only when ``peers`` take part."""
        if self.liveness is not None:
            if len(self._peers) > _MAX_EXPECTED:
                self._peers.clear()  # works issued and never waited: the map is best-effort
            self._peers[id(work)] = peers

    def forget_peers(self) -> None:
        self._peers.clear()

    def _marked(self, what: str, peers: tuple[int, ...] | None) -> Any:
        return self.liveness.waiting(what, peers) if self.liveness is not None else contextlib.nullcontext()

    def _wait_event(self, event: threading.Event, what: str) -> None:
        self.watch.register(event)
        try:
            if not event.wait(self.timeout_s) and not self.watch.aborted.is_set():
                self.await_abort(
                    what, TimeoutError(f"did not complete within cluster.collective_timeout_s={self.timeout_s}")
                )
        finally:
            self.watch.unregister(event)
        if not _done(event):
            raise Aborted()

    def work(self, work: Any, what: str) -> None:
        """Wait until a collective ``work`` has run, the way its backend tells; a failed op waits
        for the controller's abort."""
        with self._marked(what, self._peers.pop(id(work), None)):
            self.backend.wait(self, work, what)

    def wait_future_of(self, work: Any, what: str) -> None:
        """Wait on ``work``'s future (it completes when the op has run: gloo)."""
        future = work.get_future()
        event = _DoneEvent()
        future.add_done_callback(lambda _f: event.done())
        self._wait_event(event, what)
        try:
            future.value()
        except Exception as error:
            self.await_abort(what, error)

    def poll(self, work: Any, what: str) -> None:
        """Wait until ``work`` has run on the device, the generation is aborted, or the timeout.

        For works whose future completes when the op is *enqueued* (NCCL, see
        ``oobleck.runtime.backend``): waiting on the future would return at once and the host
        would block later, in a CUDA sync (``.item()``, ``.cpu()``) that no abort can reach if a
        peer is gone. ``is_completed()`` queries the op's CUDA end event without blocking.
        """
        deadline = time.monotonic() + self.timeout_s
        pause = _POLL_FIRST_S
        while not _completed(work):
            if self.watch.aborted.is_set():
                raise Aborted()
            if time.monotonic() > deadline:
                self.await_abort(
                    what, TimeoutError(f"did not complete within cluster.collective_timeout_s={self.timeout_s}")
                )
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)
        try:
            work.wait()  # orders the current stream after the op; raises if the op failed
        except Exception as error:
            self.await_abort(what, error)

    def future(self, future: concurrent.futures.Future, what: str, peers: tuple[int, ...] | None = None) -> Any:
        with self._marked(what, peers):
            event = _DoneEvent()
            future.add_done_callback(lambda _f: event.done())
            self._wait_event(event, what)
            try:
                return future.result()
            except Aborted:
                raise
            except RunError:
                raise
            except Exception as error:
                self.await_abort(what, error)

    def await_abort(self, what: str, error: BaseException) -> NoReturn:
        """A peer vanished or did not answer: the controller turns that into a failure (from the
        agent's report, a stopped heartbeat, or this wait's age in our heartbeat), so the abort
        must follow shortly; raises ``Aborted`` when it does, ``RunError`` if it does not."""
        if self.watch.aborted.wait(self.peer_grace_s):
            raise Aborted() from error
        raise RunError(
            f"{what} failed ({error}) and the controller did not reconfigure within {self.peer_grace_s} s"
        ) from error


class _DoneEvent(threading.Event):
    """An event that remembers whether the operation (not an abort) set it."""

    def __init__(self) -> None:
        super().__init__()
        self.completed = False

    def done(self) -> None:
        self.completed = True
        self.set()


def _done(event: threading.Event) -> bool:
    return bool(getattr(event, "completed", False))


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
            self.inflight = [(n, w) for n, w in self.inflight if not _completed(w)]
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
            if not _completed(work):
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

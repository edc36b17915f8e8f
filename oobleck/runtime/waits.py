"""Abortable waits of a generation: the abort watch and the ``Waiter`` every blocking wait goes through.

Every wait is on an event that either the operation (through its future) or the abort watcher
sets, so a worker blocked on a peer that died (or on a peer that has itself moved on) wakes up as
soon as the controller aborts the generation, without polling (on NCCL, whose futures complete
when an op is enqueued rather than run, the wait polls the op's CUDA event instead:
``oobleck.runtime.backend`` holds every gloo/NCCL difference).

A wait that outlasts ``cluster.collective_timeout_s`` does not end the run on its own: the
worker's heartbeat (``oobleck.runtime.liveness``) says what it waits on and on which ranks, the
controller turns the ranks that did not answer into a failure, and the abort that follows ends the
wait like any other; only if no abort comes within the grace does the worker give up.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as dist

from oobleck.errors import RunError
from oobleck.runtime import keys
from oobleck.runtime.backend import Backend
from oobleck.runtime.liveness import Liveness
from oobleck.runtime.store_client import connect

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


# The abort watch's store wait is cut into slices only because a TCPStore wait needs a timeout;
# c10d logs two warning lines for every slice that times out, so short slices (tens of seconds)
# would fill a long run's logs with them. A slice bounds nothing: the watch lasts the generation.
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


def is_completed(work: Any) -> bool:
    """Whether ``work`` has completed (a work that can no longer say counts as completed)."""
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
        while not is_completed(work):
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

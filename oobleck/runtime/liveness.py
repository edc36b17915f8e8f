"""A worker's liveness: a heartbeat thread, and what the worker is waiting on.

The agent's heartbeat only proves that the agent lives; a worker frozen by ``kill -STOP``, or hung
in a call that never returns, would go unseen while its peers wait for it. So every worker beats
too: a thread on its own store connection (in the run's key space, ``oobleck.runtime.keys``)
writes ``keys.heartbeat(node, rank, incarnation)`` every ``cluster.heartbeat_interval_s``, holding
a counter and the worker's *wait state*: the generation and rank it is in, and, while the main
thread waits on a collective, a peer or a store key, what it waits on, on which ranks, and for how
long; or, once it has left its generation, which generation it waits for (``awaiting``). The
controller (``oobleck.elastic.watchdog``) reads every worker's beat: a counter that stops is a
frozen worker; a wait longer than ``cluster.collective_timeout_s`` names the ranks that did not
answer, and both are failures recovered like any other; a worker of the current generation that
waits for the next one, which the controller never published, gets it published.

``DataPlaneProbe`` answers the other question a wait cannot: is the worker reachable where its
process groups connect? It listens on the address gloo binds to and accepts (and closes) every
connection; a node cut off from the others' data plane, whose heartbeats still flow through the
store, does not answer, and the controller blames it (``Membership.unreachable``). Marking a wait is two attribute writes, so the hot path
(every microbatch's send and receive) pays nothing measurable.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any


class Liveness:
    """One worker's heartbeat (see the module docstring)."""

    def __init__(self, store: Any, key: str, interval_s: float) -> None:
        self._store = store  # this thread's own connection (a SealedStore)
        self._key = key
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self.generation = -1
        self.rank = -1
        self._count = 0
        # (what, peers or None for every rank of the generation, monotonic start): one tuple, so
        # the heartbeat thread always reads a consistent state without a lock
        self._wait: tuple[str, tuple[int, ...] | None, float] | None = None
        self._awaiting: int | None = None  # the generation it waits for, having left its own
        self.beat()  # the key exists before the worker registers
        self._thread = threading.Thread(target=self._run, daemon=True, name="heartbeat")
        self._thread.start()

    def enter(self, generation: int, rank: int) -> None:
        """The worker now lives in ``generation`` as ``rank`` (-1: not used by its plan)."""
        self._wait = None
        self._awaiting = None
        self.generation, self.rank = generation, rank

    @contextmanager
    def waiting(self, what: str, peers: Sequence[int] | None = None) -> Iterator[None]:
        """Mark the main thread as waiting on ``peers`` (None: every rank of the generation)."""
        outer = self._wait
        self._wait = (what, tuple(peers) if peers is not None else None, outer[2] if outer else time.monotonic())
        try:
            yield
        finally:
            self._wait = outer

    @contextmanager
    def awaiting(self, generation: int) -> Iterator[None]:
        """Mark the main thread as waiting for ``generation`` to be published (it left its own)."""
        self._awaiting = generation
        try:
            with self.waiting(f"generation {generation}", ()):
                yield
        finally:
            self._awaiting = None

    def state(self) -> dict[str, Any]:
        wait = self._wait
        return {
            "count": self._count,
            "generation": self.generation,
            "rank": self.rank,
            "wait": wait[0] if wait else None,
            "peers": list(wait[1]) if wait and wait[1] is not None else None,
            "waited_s": round(time.monotonic() - wait[2], 3) if wait else 0.0,
            "awaiting": self._awaiting,
        }

    def beat(self) -> None:
        self._count += 1
        self._store.set(self._key, json.dumps(self.state()))

    def _run(self) -> None:
        while not self._stopping.wait(self._interval_s):
            try:
                self.beat()
            except Exception:  # the store is gone: the run is over, the worker notices elsewhere
                return

    def stop(self) -> None:
        self._stopping.set()


class DataPlaneProbe:
    """A listening socket on the data-plane address (``host``: the address the worker's process
    groups bind to; "" for the host's default interface, advertised by host name). ``address`` goes
    into the worker's registration record."""

    def __init__(self, host: str) -> None:
        self._server = socket.create_server((host or "0.0.0.0", 0))
        self.address = f"{host or socket.gethostname()}:{self._server.getsockname()[1]}"
        self._thread = threading.Thread(target=self._run, daemon=True, name="data-plane-probe")
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:
                return
            connection.close()

    def close(self) -> None:
        try:
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()

"""A worker's liveness: a heartbeat thread, and what the worker is waiting on.

The agent's heartbeat only proves that the agent lives; a worker frozen by ``kill -STOP``, or hung
in a call that never returns, would go unseen while its peers wait for it. So every worker beats
too: a thread on its own store connection writes ``keys.heartbeat(node, rank, incarnation)`` every
``cluster.heartbeat_interval_s``, signed with the run's secret, holding a counter and the worker's
*wait state*: the generation and rank it is in, and, while the main thread waits on a collective,
a peer or a store key, what it waits on, on which ranks, and for how long. The controller
(``oobleck.elastic.watchdog``) reads every worker's beat: a counter that stops is a frozen worker;
a wait longer than ``cluster.collective_timeout_s`` names the ranks that did not answer, and both
are failures recovered like any other. Marking a wait is two attribute writes, so the hot path
(every microbatch's send and receive) pays nothing measurable.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from oobleck.runtime import keys


class Liveness:
    """One worker's heartbeat (see the module docstring)."""

    def __init__(self, store: Any, key: str, secret: str, interval_s: float) -> None:
        self._store = store  # this thread's own connection
        self._key = key
        self._secret = secret
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self.generation = -1
        self.rank = -1
        self._count = 0
        # (what, peers or None for every rank of the generation, monotonic start): one tuple, so
        # the heartbeat thread always reads a consistent state without a lock
        self._wait: tuple[str, tuple[int, ...] | None, float] | None = None
        self.beat()  # the key exists before the worker registers
        self._thread = threading.Thread(target=self._run, daemon=True, name="heartbeat")
        self._thread.start()

    def enter(self, generation: int, rank: int) -> None:
        """The worker now lives in ``generation`` as ``rank`` (-1: not used by its plan)."""
        self._wait = None
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

    def state(self) -> dict[str, Any]:
        wait = self._wait
        return {
            "count": self._count,
            "generation": self.generation,
            "rank": self.rank,
            "wait": wait[0] if wait else None,
            "peers": list(wait[1]) if wait and wait[1] is not None else None,
            "waited_s": round(time.monotonic() - wait[2], 3) if wait else 0.0,
        }

    def beat(self) -> None:
        self._count += 1
        self._store.set(self._key, keys.sign(self._secret, json.dumps(self.state())))

    def _run(self) -> None:
        while not self._stopping.wait(self._interval_s):
            try:
                self.beat()
            except Exception:  # the store is gone: the run is over, the worker notices elsewhere
                return

    def stop(self) -> None:
        self._stopping.set()

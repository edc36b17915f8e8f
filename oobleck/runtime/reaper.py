"""Where an aborted generation's process groups go: parked, and dropped by one reaper thread.

Aborted groups are never destroyed in-line: gloo's destructor waits for pending operations until
the group timeout (measured, see /work/shared/notes), so they are parked and released by one
reaper thread once their works are done, or after that timeout.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from oobleck.runtime.waits import is_completed


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
                ready = [p for p in self._parked if p[0] <= now or all(is_completed(w) for w in p[2])]
                self._parked = [p for p in self._parked if p not in ready]
                self._dropping = sum(len(items) for _, items, _ in ready)
            del ready  # may block in gloo's destructor; this thread exists for that
            with self._lock:
                self._dropping = 0

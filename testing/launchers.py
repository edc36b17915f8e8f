"""Launchers for the tests of the launcher seam: ``LocalLauncher`` that records what it started,
and one whose signals land late.

Named by ``cluster._target_=testing.launchers.RecordingLauncher``; worker processes import it too
(their launcher class gives their gloo address), so the checkout must be on their ``sys.path``.
"""

from __future__ import annotations

import threading
from typing import ClassVar

from oobleck.elastic.local import LocalLauncher


class RecordingLauncher(LocalLauncher):
    """Starts nodes as ``LocalLauncher`` does and records each node id it started, in order."""

    started: ClassVar[list[int]] = []

    def start(self, node: int) -> None:
        RecordingLauncher.started.append(node)
        super().start(node)


class LateSignalLauncher(LocalLauncher):
    """``LocalLauncher`` whose signals reach a node ``DELAY_S`` after they are sent, as a busy
    Slurm controller's scancel may (``Launcher.signals_land_at_once`` false)."""

    signals_land_at_once = False
    DELAY_S: ClassVar[float] = 3.0

    def send_signal(self, node: int, sig: int) -> None:
        late = threading.Timer(self.DELAY_S, LocalLauncher.send_signal, args=(self, node, sig))
        late.daemon = True
        late.start()

"""A launcher for the tests of the launcher seam: ``LocalLauncher`` that records what it started.

Named by ``cluster._target_=testing.launchers.RecordingLauncher``; worker processes import it too
(their launcher class gives their gloo address), so the checkout must be on their ``sys.path``.
"""

from __future__ import annotations

from typing import ClassVar

from oobleck.elastic.local import LocalLauncher


class RecordingLauncher(LocalLauncher):
    """Starts nodes as ``LocalLauncher`` does and records each node id it started, in order."""

    started: ClassVar[list[int]] = []

    def start(self, node: int) -> None:
        RecordingLauncher.started.append(node)
        super().start(node)

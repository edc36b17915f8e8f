"""What the controller needs from a way of starting nodes: start an agent for a node id, signal a
whole node (SIGKILL = the node crashes, SIGSTOP = it freezes), and reap everything at the end.

``LocalLauncher`` (processes on this machine) and ``SlurmLauncher`` (one job step per node)
implement ``start`` and ``send_signal``; killing and shutting down are the same for both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from abc import ABC, abstractmethod

from oobleck.elastic.protocol import SECRET_ENV
from oobleck.errors import RunError

REAP_TIMEOUT_S = 10.0


class Launcher(ABC):
    """Starts node agents; ``processes`` maps node id -> the local process standing for the node."""

    def __init__(self, secret: str = "") -> None:
        self.processes: dict[int, subprocess.Popen] = {}
        self.secret = secret

    def agent_environment(self) -> dict[str, str]:
        """The environment an agent starts with: this process's, plus the run's secret."""
        return {**os.environ, SECRET_ENV: self.secret}

    @abstractmethod
    def start(self, node: int) -> None:
        """Start the agent of node id ``node``."""

    @abstractmethod
    def send_signal(self, node: int, sig: int) -> None:
        """Deliver ``sig`` to every process of the node (agent and workers), without waiting."""

    def can_kill(self, node: int) -> bool:
        return node in self.processes

    def kill(self, node: int, sig: int = signal.SIGKILL) -> None:
        process = self.processes.get(node)
        if process is None:
            return
        self.send_signal(node, sig)
        if sig == signal.SIGKILL:
            self._reap(process)

    def shutdown(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for agents to exit, then kill what is left of every node."""
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for node, process in self.processes.items():
            try:
                self.send_signal(node, signal.SIGKILL)  # workers too, even if the agent exited
            except (ProcessLookupError, PermissionError, RunError):
                pass
            self._reap(process)

    @staticmethod
    def _reap(process: subprocess.Popen) -> None:
        try:
            process.wait(timeout=REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            try:
                process.wait(timeout=REAP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass

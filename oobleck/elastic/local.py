"""Starting node agents as local processes (``cluster.kind=local``), and finding stray ones.

Each agent is the leader of a new session, so a node is one process group: killing the node is
``killpg(agent pid, SIGKILL)`` and takes its workers with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class LocalLauncher:
    """Starts ``python -m oobleck.elastic.agent`` for a node id; kills and reaps nodes."""

    def __init__(self, controller: str, run_id: str) -> None:
        self.controller = controller
        self.run_id = run_id
        self.processes: dict[int, subprocess.Popen] = {}

    def start(self, node: int) -> None:
        command = [sys.executable, "-m", "oobleck.elastic.agent", "--controller", self.controller, "--node-id", str(node), "--run-id", self.run_id]
        self.processes[node] = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)

    def can_kill(self, node: int) -> bool:
        return node in self.processes

    def kill(self, node: int, sig: int = signal.SIGKILL) -> None:
        process = self.processes.get(node)
        if process is None:
            return
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            try:
                process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass

    def shutdown(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for agents to exit, then kill what is left (whole groups)."""
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for node, process in self.processes.items():
            try:
                os.killpg(process.pid, signal.SIGKILL)  # workers too, even if the agent exited
            except (ProcessLookupError, PermissionError):
                pass
            try:
                process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass

    # Defined last: as a class attribute, the name would shadow the signal module in the
    # default arguments above.
    def signal(self, node: int, sig: int) -> None:
        """Deliver ``sig`` to the node's whole process group, without waiting."""
        process = self.processes.get(node)
        if process is None:
            return
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass


def run_processes(run_id: str) -> list[int]:
    """Pids of live agents and workers of the run tagged ``run_id`` (a /proc scan, no psutil)."""
    pids = []
    needle = f"--run-id\0{run_id}\0".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids

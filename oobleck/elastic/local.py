"""Starting node agents as local processes (``cluster.kind=local``), and finding stray ones.

Each agent is the leader of a new session, so a node is one process group: killing the node is
``killpg(agent pid, SIGKILL)`` and takes its workers with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from oobleck.elastic.launcher import Launcher


class LocalLauncher(Launcher):
    """Starts ``python -m oobleck.elastic.agent`` for a node id, each in its own session."""

    def __init__(self, controller: str, run_id: str, secret: str = "") -> None:
        super().__init__(secret)
        self.controller = controller
        self.run_id = run_id

    def start(self, node: int) -> None:
        command = [sys.executable, "-m", "oobleck.elastic.agent", "--controller", self.controller, "--node-id", str(node), "--run-id", self.run_id]
        self.processes[node] = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True, env=self.agent_environment())

    def send_signal(self, node: int, sig: int) -> None:
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
    return sorted(_tagged(run_id))


def node_processes(run_id: str) -> dict[int, dict[str, list[int]]]:
    """The run's live processes by node id: ``{"agent": [pid], "workers": [pids by local rank]}``."""
    agents: dict[int, list[int]] = {}
    workers: dict[int, list[tuple[int, int]]] = {}
    for pid, argv in sorted(_tagged(run_id).items()):
        node = _flag(argv, "--node-id")
        if node is None:
            continue
        if "oobleck.elastic.agent" in argv:
            agents.setdefault(node, []).append(pid)
        else:
            workers.setdefault(node, []).append((_flag(argv, "--local-rank") or 0, pid))
    return {
        node: {"agent": agents.get(node, []), "workers": [pid for _, pid in sorted(workers.get(node, []))]}
        for node in sorted(set(agents) | set(workers))
    }


def _flag(argv: list[str], name: str) -> int | None:
    index = argv.index(name) + 1 if name in argv else len(argv)
    return int(argv[index]) if index < len(argv) and argv[index].isdigit() else None


def _tagged(run_id: str) -> dict[int, list[str]]:
    """Live (not zombie) processes whose command line carries ``--run-id run_id``: pid -> argv."""
    found: dict[int, list[str]] = {}
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
            found[int(entry.name)] = cmdline.decode(errors="replace").split("\0")
    return found

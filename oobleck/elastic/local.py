"""Starting node agents as local processes (``cluster.kind=local``), and finding stray ones.

Each agent leads a process group of its own, so a node is one process group: killing the node is
``killpg(agent pid, SIGKILL)`` and takes its workers with it. Agents exec their workers
(``python -m``), or, with ``cluster.fork_workers``, have the run's fork server fork them
(``oobleck.elastic.forkserver``): then a worker joins its agent's process group from the server,
which only works within one session, so agents lead a process group in the controller's session
rather than a session of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from oobleck.elastic.forkserver import ForkServer, own_process_group
from oobleck.elastic.launcher import Launcher


class LocalLauncher(Launcher):
    """Starts ``python -m oobleck.elastic.agent`` for a node id, each leading a process group."""

    def __init__(
        self, controller: str, run_id: str, secret: str = "", *, fork_server: ForkServer | None = None
    ) -> None:
        """``fork_server``: agents ask it for their workers (its owner, ``launch``, closes it);
        without one they exec them."""
        super().__init__(secret)
        self.controller = controller
        self.run_id = run_id
        self.fork_server = fork_server

    @property
    def worker_server(self) -> str:
        """Where agents ask for forked workers ("" when they exec them)."""
        return self.fork_server.address if self.fork_server is not None else ""

    def start(self, node: int) -> None:
        command = [
            sys.executable,
            "-m",
            "oobleck.elastic.agent",
            "--controller",
            self.controller,
            "--node-id",
            str(node),
            "--run-id",
            self.run_id,
        ]
        # A session of its own keeps a terminal out of the node entirely; forked workers need the
        # controller's session (see the module docstring), where a process group does the same.
        grouping: dict[str, Any] = own_process_group() if self.fork_server is not None else {"start_new_session": True}
        self.processes[node] = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, env=self.agent_environment(), **grouping
        )

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
    tag = run_id.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z" or tag not in cmdline:
            continue
        argv = [arg for arg in cmdline.decode(errors="replace").split("\0") if arg]
        if len(argv) == 1:  # a forked worker's title (oobleck.elastic.forkserver): one string
            argv = argv[0].split(" ")
        if "--run-id" in argv[:-1] and argv[argv.index("--run-id") + 1] == run_id:
            found[int(entry.name)] = argv
    return found

"""Starting node agents as local processes (``cluster.kind=local``), and finding stray ones.

``LocalLauncher`` (``_target_`` of ``conf/cluster/local.yaml``) runs every node on this machine:
each node's workers bind gloo to the controller's address, or to an address of their own
(``cluster.node_address_base``), and CPU workers are forked from one process that imported torch
once (``cluster.fork_workers``). Each agent leads a process group of its own, so a node is one process group: killing the node is
``killpg(agent pid, SIGKILL)`` and takes its workers with it. Agents exec their workers
(``python -m``), or, with ``cluster.fork_workers``, have the run's fork server fork them
(``oobleck.elastic.forkserver``): then a worker joins its agent's process group from the server,
which only works within one session, so agents lead a process group in the controller's session
rather than a session of their own.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
from pathlib import Path
from typing import Any

from oobleck.elastic.forkserver import own_process_group
from oobleck.errors import ConfigError, RunError
from oobleck.launcher import Launcher


class LocalLauncher(Launcher):
    """Starts ``python -m oobleck.elastic.agent`` for a node id, each leading a process group.
    Agents ask the fork server (its owner, ``launch``, closes it) for their workers when there is
    one, else they exec them."""

    kind = "local"
    single_machine = True
    per_node_addresses = True

    @classmethod
    def check_config(cls, cluster: Any) -> None:
        super().check_config(cluster)
        if cluster.node_address_base is not None:
            cls.worker_address(cluster, 0)  # raises ConfigError when the base is unusable

    @classmethod
    def check_devices(cls, cluster: Any) -> None:
        super().check_devices(cluster)
        if cluster.device != "cuda":
            return
        import torch

        if torch.cuda.device_count() < int(cluster.gpus_per_node):
            raise RunError(
                f"cluster.gpus_per_node={cluster.gpus_per_node} but this machine has {torch.cuda.device_count()} CUDA devices"
            )
        if int(cluster.nodes) > 1 and cluster.backend == "auto":
            # A worker takes device cuda:<local rank>, so every local "node" puts its workers on the
            # same GPUs, and NCCL refuses two ranks of one communicator on one device ("Duplicate GPU
            # detected", ncclInvalidUsage, in its init). gloo does not; an explicit nccl is the
            # user's word that this NCCL allows it.
            raise RunError(
                f"cluster.kind=local with cluster.device=cuda runs on one machine's GPUs, but cluster.nodes={cluster.nodes} "
                "local nodes would all use devices cuda:0.. (NCCL refuses two ranks on one GPU); use cluster.backend=gloo "
                "(collectives staged through host memory), cluster.nodes=1 (cluster.gpus_per_node up to the device "
                "count), cluster=slurm, or cluster.device=cpu"
            )

    @classmethod
    def forks_workers(cls, cluster: Any) -> bool:
        """``cluster.fork_workers`` with CPU workers. CUDA workers are exec'd: a process forked after
        CUDA was initialised cannot use it, and torch's imports may initialise it
        (``torch.cuda.is_available()``), so the server cannot promise not to."""
        return bool(cluster.fork_workers) and cluster.device == "cpu"

    @classmethod
    def worker_address(cls, cluster: Any, node: int) -> str:
        """The controller's address (one loopback address for all), or with
        ``cluster.node_address_base`` set, that address plus ``node`` (an address of each node's
        own lets a traffic shaper give each node its own link)."""
        base = cluster.node_address_base
        if base is None:
            return str(cluster.master_addr)
        try:
            return str(ipaddress.IPv4Address(str(base)) + node)
        except (ValueError, ipaddress.AddressValueError) as error:
            raise ConfigError(
                f"cluster.node_address_base={base} does not give node {node} an IPv4 address ({error}); use e.g. 127.0.1.0"
            ) from None

    def start(self, node: int) -> None:
        # A session of its own keeps a terminal out of the node entirely; forked workers need the
        # controller's session (see the module docstring), where a process group does the same.
        grouping: dict[str, Any] = own_process_group() if self.fork_server is not None else {"start_new_session": True}
        self.processes[node] = subprocess.Popen(
            self.agent_command(node), stdin=subprocess.DEVNULL, env=self.agent_environment(), **grouping
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
    """Live (not zombie) processes whose command line carries ``--run-id run_id``: pid -> argv.

    A child a worker forks (``subprocess`` before its ``exec``) carries the worker's command line
    for a moment; it is left out (its parent is a tagged process with the same command line), so
    that a scan never takes a short-lived copy for a second worker of the node.
    """
    found: dict[int, tuple[list[str], int]] = {}
    tag = run_id.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if state == "Z" or tag not in cmdline:
            continue
        argv = [arg for arg in cmdline.decode(errors="replace").split("\0") if arg]
        if len(argv) == 1:  # a forked worker's title (oobleck.elastic.forkserver): one string
            argv = argv[0].split(" ")
        if "--run-id" in argv[:-1] and argv[argv.index("--run-id") + 1] == run_id:
            found[int(entry.name)] = (argv, int(parent))
    return {pid: argv for pid, (argv, parent) in found.items() if parent not in found or found[parent][0] != argv}

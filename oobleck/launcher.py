"""Launchers: how a run's nodes start, and what that means for where their workers run.

A cluster config names its launcher class with ``_target_`` (``conf/cluster/<name>.yaml``), as a
strategy config names its strategy; ``cluster.kind`` stays the cluster's public name and must be
the one its class launches (a cluster file without ``_target_`` gets the launcher of its
``kind``). The class answers, in any process and before any process starts, what depends on
where nodes run, so nothing else branches on the kind:

- ``check_config(cluster)``: the cluster settings suit this launcher (``check_cluster``, the
  section's checks that ``oobleck.config.validate`` calls, runs it before what every launcher needs);
- ``check_environment(cluster)``: the run can start nodes from here (a Slurm launcher: inside an
  allocation, with ``srun`` and ``scancel``); checked before anything of the run is created;
- ``check_devices(cluster)``: the devices the workers need exist where the controller runs;
- ``forks_workers(cluster)``: whether agents fork their workers from one process that imported
  torch once (``oobleck.elastic.forkserver``);
- ``worker_address(cluster, node)``: the address node's workers bind gloo to ("": the host's own);
- ``single_machine``: every node runs on the controller's machine;
- ``signals_land_at_once``: a signal has reached the node when ``send_signal`` returns (else the
  controller also has the node's agent signal itself, so a fault lands at its named step).

An instance (made by the controller) starts a node's agent, signals a whole node (SIGKILL: the
node crashes, SIGSTOP: it freezes) and reaps everything at the end: ``oobleck.elastic.local``
(processes on this machine) and ``oobleck.elastic.slurm`` (one Slurm job step per node) implement
``start`` and ``send_signal``; killing and shutting down are the same for both. This module is
the interface only; it imports nothing of the project but its errors and value checks.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from oobleck.checks import choice, positive
from oobleck.errors import ConfigError, RunError

REAP_TIMEOUT_S = 10.0
# The launcher of a cluster file that names none: its kind's (a user's own cluster file, or the
# config saved in a run dir by a version whose cluster files had no ``_target_``).
KIND_LAUNCHERS = {"local": "oobleck.elastic.local.LocalLauncher", "slurm": "oobleck.elastic.slurm.SlurmLauncher"}


class Launcher(ABC):
    """Starts node agents; ``processes`` maps node id -> the local process standing for the node."""

    kind: ClassVar[str]  # the cluster.kind it launches
    single_machine: ClassVar[bool] = False  # every node runs on the controller's machine
    per_node_addresses: ClassVar[bool] = False  # supports cluster.node_address_base
    controller_host: ClassVar[str] = "this machine"  # where the controller runs, for messages
    gpu_hint: ClassVar[str] = ""  # how to get GPUs there, for messages (ends with "or ")
    # Whether ``send_signal`` has reached the node's processes when it returns. Where it has not
    # (Slurm's scancel goes through slurmctld and slurmd: milliseconds to seconds), the controller
    # also asks the node's agent to signal its own process group, so that an injected fault lands
    # at the step it names on every launcher, not when a busy scheduler gets to it.
    signals_land_at_once: ClassVar[bool] = True

    def __init__(
        self,
        cluster: Any,
        controller: str,
        run_id: str,
        *,
        environment: Mapping[str, str] | None = None,
        fork_server: Any = None,
    ) -> None:
        """``controller``: HOST:PORT of the controller's agent port; ``environment``: added to this
        process's for every agent (the run's secret); ``fork_server``: where agents ask for forked
        workers (a launcher whose ``forks_workers`` is true; None: they exec them)."""
        self.cluster = cluster
        self.controller = controller
        self.run_id = run_id
        self.environment = dict(environment or {})
        self.fork_server = fork_server
        self.processes: dict[int, subprocess.Popen] = {}

    # ------------------------------------------------------------------ questions
    @classmethod
    def check_config(cls, cluster: Any) -> None:
        """Refuse cluster settings this launcher cannot run (one ``ConfigError`` naming the key)."""
        if cluster.kind != cls.kind:
            raise ConfigError(
                f"cluster.kind={cluster.kind} but cluster._target_={cls.__module__}.{cls.__qualname__} launches "
                f"{cls.kind} clusters; choose the cluster with cluster=<name> (conf/cluster/) rather than cluster.kind"
            )
        if cluster.fork_workers and not cls.single_machine:
            raise ConfigError(
                f"cluster.fork_workers=true needs cluster.kind=local (got {cluster.kind}: each node execs its own "
                "workers); set cluster.fork_workers=false"
            )
        if cluster.node_address_base is not None and not cls.per_node_addresses:
            raise ConfigError(
                f"cluster.node_address_base={cluster.node_address_base} needs cluster.kind=local (got {cluster.kind}); "
                "set cluster.node_address_base=null"
            )

    @classmethod
    def check_environment(cls, cluster: Any, environ: Mapping[str, str] | None = None) -> None:
        """Refuse to start where this launcher cannot start nodes (``RunError`` saying what to do);
        a launcher that starts processes on this machine can always start them."""
        return None

    @classmethod
    def check_devices(cls, cluster: Any) -> None:
        """Refuse ``cluster.device=cuda`` where the controller sees no CUDA device."""
        if cluster.device != "cuda":
            return
        import torch

        if not torch.cuda.is_available():
            raise RunError(
                f"cluster.device=cuda but CUDA is not available on {cls.controller_host}; "
                f"{cls.gpu_hint}use cluster.device=cpu"
            )

    @classmethod
    def forks_workers(cls, cluster: Any) -> bool:
        """Whether agents fork their workers from the run's fork server."""
        return False

    @classmethod
    def worker_address(cls, cluster: Any, node: int) -> str:
        """The address node's workers bind gloo to ("": the host's default interface)."""
        return ""

    # ------------------------------------------------------------------ nodes
    @property
    def worker_server(self) -> str:
        """Where agents ask for forked workers ("" when they exec them)."""
        return self.fork_server.address if self.fork_server is not None else ""

    def agent_environment(self) -> dict[str, str]:
        """The environment an agent starts with: this process's, plus ``environment``."""
        return {**os.environ, **self.environment}

    def agent_command(self, node: int) -> list[str]:
        """``python -m oobleck.elastic.agent`` for node id ``node`` of this run."""
        return [
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


def launcher_class(cluster: Any) -> type[Launcher]:
    """The class ``cluster._target_`` names (its ``kind``'s without one); one clear error otherwise."""
    target = _target(cluster)
    if not target:
        raise ConfigError(
            f"cluster.kind={cluster.kind!r} has no launcher: conf/cluster/<name>.yaml must name its class with "
            f"_target_ (e.g. {KIND_LAUNCHERS['local']}), or use one of the kinds {', '.join(KIND_LAUNCHERS)}"
        )
    module, _, attribute = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(f"cluster._target_={target} cannot be imported ({error}); check the class path") from None
    if not (isinstance(cls, type) and issubclass(cls, Launcher)):
        raise ConfigError(f"cluster._target_={target} is not an oobleck.launcher.Launcher subclass")
    return cls


def _target(cluster: Any) -> str | None:
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cluster, DictConfig):
        named = None if OmegaConf.is_missing(cluster, "_target_") else cluster.get("_target_")
    else:
        named = getattr(cluster, "_target_", None)
    if named and str(named) != "???":
        return str(named)
    return KIND_LAUNCHERS.get(str(cluster.kind))


def check_cluster(cluster: Any) -> None:
    """The ``cluster:`` section's checks (one ``ConfigError`` naming the key): its launcher's own
    (``check_config``), then what every launcher needs."""
    launcher_class(cluster).check_config(cluster)  # the kind, and what only some launchers support
    choice("cluster.device", cluster.device, ("cpu", "cuda"))
    choice("cluster.backend", cluster.backend, ("auto", "nccl", "gloo"))
    if cluster.backend == "nccl" and cluster.device != "cuda":
        raise ConfigError(
            f"cluster.backend=nccl needs cluster.device=cuda (got {cluster.device}); use cluster.backend=auto or gloo"
        )
    positive("cluster.nodes", cluster.nodes)
    positive("cluster.gpus_per_node", cluster.gpus_per_node)
    for key in (
        "heartbeat_interval_s",
        "heartbeat_timeout_s",
        "collective_timeout_s",
        "data_plane_probe_timeout_s",
        "startup_timeout_s",
    ):
        positive(f"cluster.{key}", getattr(cluster, key))
    positive("cluster.failure_settle_s", cluster.failure_settle_s, allow_zero=True)
    if cluster.heartbeat_timeout_s <= cluster.heartbeat_interval_s:
        raise ConfigError(
            f"cluster.heartbeat_timeout_s={cluster.heartbeat_timeout_s} must exceed "
            f"cluster.heartbeat_interval_s={cluster.heartbeat_interval_s}"
        )
    if not 0 <= cluster.master_port <= 65535:
        raise ConfigError(f"cluster.master_port={cluster.master_port} must be in 0..65535 (0 picks a free port)")

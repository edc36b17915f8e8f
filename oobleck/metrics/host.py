"""The host a run ran on and how busy it was: summary.json's ``host`` object (also in the wandb config).

A measured time says little about a strategy when the run's own processes outnumber the cores or
other jobs load the machine: the operating system's scheduler then sets it. So every run records
the cores it could use, the load average when it started and when it ended (the 1, 5 and 15
minute averages of runnable processes, ``os.getloadavg``), and how many processes of its own
shared this host (``run_processes``: the controller, the fork server that starts local workers,
and each node's agent and workers; ``training_processes``: the workers that compute every step).
Two flags say what a reader must not ignore: ``overloaded`` (a 1-minute load average above the
usable cores, at the start or the end) and ``oversubscribed`` (more training processes than
usable cores: every comparison on a 2-core machine with more than two workers is). On Slurm only
the controller's own node is this host: one node's agent and workers.

Pure: ``HostSnapshot.now`` reads the machine, ``host_record`` only combines.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HostSnapshot:
    """The host's cores and load at one moment."""

    hostname: str
    cpu_count: int  # logical CPUs of the machine
    usable_cpus: int  # CPUs this process may run on (its affinity: a cgroup or taskset may allow fewer)
    load_avg: tuple[float, float, float]  # runnable processes averaged over 1, 5 and 15 minutes

    @classmethod
    def now(cls) -> HostSnapshot:
        count = os.cpu_count() or 1
        try:
            usable = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not on Linux
            usable = count
        try:
            one, five, fifteen = os.getloadavg()
            load = (round(one, 2), round(five, 2), round(fifteen, 2))
        except OSError:  # no load average on this platform
            load = (float("nan"),) * 3
        return cls(socket.gethostname(), count, usable, load)

    def as_start(self) -> dict[str, Any]:
        """What is known when the run starts (the wandb config's ``host`` until the end)."""
        return {
            "hostname": self.hostname,
            "cpu_count": self.cpu_count,
            "usable_cpus": self.usable_cpus,
            "load_avg_start": list(self.load_avg),
        }


def run_processes(*, nodes_on_host: int, gpus_per_node: int, fork_server: bool) -> int:
    """The run's own processes on this host: the controller, the fork server, and per node its
    agent and its workers."""
    return 1 + int(fork_server) + nodes_on_host * (1 + gpus_per_node)


def host_record(
    start: HostSnapshot, end: HostSnapshot, *, run_processes: int, training_processes: int
) -> dict[str, Any]:
    """summary.json's ``host`` object (module docstring)."""
    peak_load = max(start.load_avg[0], end.load_avg[0])
    return {
        **start.as_start(),
        "load_avg_end": list(end.load_avg),
        "run_processes": run_processes,
        "training_processes": training_processes,
        "overloaded": bool(peak_load > start.usable_cpus),
        "oversubscribed": bool(training_processes > start.usable_cpus),
    }

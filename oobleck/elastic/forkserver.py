"""Worker processes forked from a process that imported torch once (``cluster.fork_workers``).

Every ``python -m oobleck.runtime.worker`` spends about 1.5 s of CPU importing torch before it does
anything; a local cluster boots one worker per simulated node at once, so on a 2-core machine four
nodes take ~6 s to start and a join pays the import again. With ``cluster.fork_workers=true``
(local clusters only) the launcher starts one *fork server* per run: a single-threaded process
that imports torch and the worker's modules once, then forks a worker for each agent's request.
A forked worker is a separate process with the same life as an exec'd one:

- it joins its agent's process group (``setpgid``): a node kill (``killpg``) takes it with the node;
- it runs with the agent's environment, working directory and standard streams (passed over the
  socket), and its command line (``/proc/<pid>/cmdline``: ``ps``, ``run_processes``) is the one
  ``python -m`` would have had;
- the agent learns its exit status as from ``Popen.wait``: the exit code, or minus the signal
  that killed it.

Agents talk to the server over a Unix socket in a private directory (the request carries the run's
secret in the environment). The server leads a process group of its own and ignores SIGINT (a
terminal's Ctrl-C is the controller's to handle); it exits when the launcher's pipe closes (the
controller died) and is killed when the run ends. Slurm nodes exec their workers: one node per
machine has nothing to share.

``oobleck.run`` and ``launch`` fork the server from themselves (``ForkServer(run_id,
from_this_process=True)``): the launcher imports torch anyway (its store is torch's TCPStore), so a
server forked once that import is done starts with it (1.3-4 s of CPU less per local run, measured,
than a server that imports torch again). That needs a process running no Python thread but its main
one (a fork copies only the calling thread, and a lock another thread held stays locked in the copy
forever); anywhere else (a test process, a launcher that already started its controller) the server
is exec'd.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

from oobleck.elastic.forked_worker import EXITED_POLL_S
from oobleck.elastic.forkserver_loop import serve

# What a worker imports that costs: torch above all, and torch._dynamo, which the optimizer's
# constructor imports on first use (~1 s of CPU more). The worker module itself is not preloaded:
# it runs as __main__, as under ``python -m``, and importing it first would make it a second copy.
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.optim",
    "oobleck.config",
    "oobleck.runtime.checkpointing",
    "oobleck.runtime.comm",
    "oobleck.runtime.executor",
    "oobleck.runtime.transfer",
)
# What the launcher imports anyway, before a server forked from it (``from_this_process``).
LAUNCHER_PRELOAD = ("torch", "torch.distributed")
CLOSE_TIMEOUT_S = 5.0  # a killed server is reaped within this


def own_process_group() -> dict[str, Any]:
    """``Popen`` arguments that start a process as the leader of a new process group in this
    session (Python 3.11+; on 3.10 the agent and the server call ``setpgid`` themselves first)."""
    return {"process_group": 0} if sys.version_info >= (3, 11) else {}


def forks_workers(cfg: Any) -> bool:
    """Whether a run forks its workers: its launcher says (``Launcher.forks_workers``; on a local
    cluster, ``cluster.fork_workers`` with CPU workers)."""
    from oobleck.launcher import launcher_class

    return launcher_class(cfg.cluster).forks_workers(cfg.cluster)


def fork_server_for(cfg: Any, run_id: str, *, from_this_process: bool = False) -> ForkServer | None:
    """The run's fork server if it forks its workers (``forks_workers``), else None;
    ``from_this_process``: see ``ForkServer``."""
    return ForkServer(run_id, from_this_process=from_this_process) if forks_workers(cfg) else None


class ForkServer:
    """The launcher's side: starts the server process and says where agents reach it. Start it
    before the controller (``oobleck.run`` does so first thing): its imports then overlap the
    controller's start; agents that ask before it is ready wait in the socket's backlog."""

    def __init__(self, run_id: str, *, from_this_process: bool = False) -> None:
        """Start the server for the run tagged ``run_id``: forked from this process when
        ``from_this_process`` and this process runs no other Python thread (``can_fork_here``),
        after importing ``LAUNCHER_PRELOAD`` here; else exec'd (``python -m oobleck.elastic.forkserver``)."""
        self.directory = tempfile.mkdtemp(prefix="oobleck-fork-")  # 0700: only this user connects
        self.address = os.path.join(self.directory, "socket")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.address)
        listener.listen(128)  # agents may connect before the server has imported torch
        alive_read, self._alive = os.pipe()
        self.forked = from_this_process and can_fork_here()
        self.process: subprocess.Popen | ForkedServerProcess
        if self.forked:
            for name in LAUNCHER_PRELOAD:
                importlib.import_module(name)
            self.process = ForkedServerProcess(_fork_server(listener, alive_read, run_id))
        else:
            command = [
                sys.executable,
                "-m",
                "oobleck.elastic.forkserver",
                *server_arguments(listener.fileno(), alive_read, run_id),
            ]
            # A process group of its own: a terminal's Ctrl-C is the controller's to handle, not
            # the server's (its workers join their agents' groups, which needs only the same session).
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, pass_fds=(listener.fileno(), alive_read), **own_process_group()
            )
        listener.close()
        os.close(alive_read)

    def close(self) -> None:
        """End the server and remove its socket. Called once the run's nodes are down: the server
        holds nothing worth a graceful exit (a worker it forked outlives it, as an orphan would)."""
        if self._alive >= 0:
            os.close(self._alive)
            self._alive = -1
        if self.process.poll() is None:
            self.process.kill()  # it may still be importing torch (an early error): no waiting on it
        self.process.wait(timeout=CLOSE_TIMEOUT_S)
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


def server_arguments(listen_fd: int, alive_fd: int, run_id: str) -> list[str]:
    """The server's command-line arguments; a forked server takes them as its title, so that
    ``ps`` and ``oobleck.elastic.local.run_processes`` find it as they find an exec'd one."""
    return ["--listen-fd", str(listen_fd), "--alive-fd", str(alive_fd), "--run-id", run_id]


def can_fork_here() -> bool:
    """Whether this process may fork a server from itself: no Python thread but the main one (native
    pools such as OpenBLAS's register fork handlers; the server forks its workers with them too)."""
    alone = threading.active_count() == 1 and threading.current_thread() is threading.main_thread()
    return alone and os.path.isdir("/proc/self/fd")  # Linux: the child closes what it inherited by that list


def _fork_server(listener: socket.socket, alive_fd: int, run_id: str) -> int:
    """Fork the server from this process; returns its pid. The child drops what it inherited of
    the launcher (handlers, logging, exit functions, streams, descriptors) and serves."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        try:
            os.setpgid(pid, pid)  # as the child does: the group exists before the parent goes on
        except OSError:
            pass  # the child got there first
        return pid
    code = 1
    try:
        _drop_the_launcher((listener.fileno(), alive_fd))
        import setproctitle

        arguments = server_arguments(listener.fileno(), alive_fd, run_id)
        setproctitle.setproctitle(" ".join(["python", "-m", __name__, *arguments]))
        code = main(arguments)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _drop_the_launcher(keep: tuple[int, ...]) -> None:
    """In a server forked from the launcher: its own process group, default signal handlers, no
    exit function, logging handler or stream wrapper of the launcher's (its console log would
    copy the workers' output into the run's log), and only descriptors 0-2 and ``keep`` open."""
    os.setpgid(0, 0)
    for number in signal.valid_signals():
        try:
            if signal.getsignal(number) not in (signal.SIG_DFL, signal.SIG_IGN, None):
                signal.signal(number, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # SIGKILL, SIGSTOP and the like
    signal.set_wakeup_fd(-1)
    atexit._clear()
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        if isinstance(logger, logging.Logger):
            logger.handlers.clear()
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2 and int(fd) not in keep)
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass  # the listing's own descriptor, closed already


class ForkedServerProcess:
    """A server forked from this process, seen through the part of ``subprocess.Popen`` that
    ``ForkServer`` and its tests use."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout or 0.0)
            time.sleep(EXITED_POLL_S)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oobleck.elastic.forkserver", description=__doc__.splitlines()[0])
    parser.add_argument("--listen-fd", type=int, required=True, help="a listening Unix socket (from the launcher)")
    parser.add_argument(
        "--alive-fd", type=int, required=True, help="a pipe the launcher holds open while the run lasts"
    )
    parser.add_argument("--run-id", default="", help="the run's tag (lets tools find its processes)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)  # Python 3.10: Popen could not start it in a group of its own
    for name in PRELOAD:
        importlib.import_module(name)
    serve(socket.socket(fileno=args.listen_fd), args.alive_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())

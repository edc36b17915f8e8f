"""The agent's side of the fork server: a worker forked on request, seen as a ``subprocess.Popen``.

``ForkedWorker`` sends the request (``oobleck.elastic.forkserver_loop`` says what it carries) and
learns the worker's pid, then its exit code from the server; if the server is gone first, it
watches the worker's pid until that process is gone too.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from typing import Any

from oobleck.elastic.forkserver_loop import MAX_REQUEST_BYTES

EXITED_POLL_S = 0.05  # after losing the server, how often a worker's agent checks it is gone


class ForkedWorker:
    """The agent's handle on a forked worker: the part of ``subprocess.Popen`` the agent uses."""

    def __init__(self, address: str, argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> None:
        """Fork ``python <argv>`` (``argv``: ``["-m", module, args...]``, also its command line)
        with ``env`` (default: this process's), this process's working directory, standard streams
        and process group. Raises ``OSError`` if the server does not answer within ``timeout_s``."""
        env = dict(os.environ) if env is None else env
        title = " ".join(["python", *argv])
        request = {"argv": argv, "title": title, "env": env, "cwd": os.getcwd(), "pgid": os.getpgrp()}
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)  # bounds the connect and the reply (the server's imports)
        self._sock.connect(address)
        socket.send_fds(self._sock, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        reply = self._sock.makefile("rb")
        line = reply.readline(MAX_REQUEST_BYTES)
        if not line:
            raise OSError(f"the fork server at {address} closed the connection before starting the worker")
        started = json.loads(line)
        if "error" in started:
            raise OSError(f"the fork server could not start the worker: {started['error']}")
        self.pid = int(started["pid"])
        self.returncode: int | None = None
        self._exited = threading.Event()
        self._sock.settimeout(None)
        threading.Thread(target=self._await_exit, args=(reply,), daemon=True, name=f"forked-worker-{self.pid}").start()

    def _await_exit(self, reply: Any) -> None:
        try:
            line = reply.readline(MAX_REQUEST_BYTES)
        except OSError:
            line = b""
        if line:
            self.returncode = int(json.loads(line)["code"])
        else:  # the server is gone (the run is ending): the worker's status is lost with it
            while _alive(self.pid):
                time.sleep(EXITED_POLL_S)
            self.returncode = -signal.SIGKILL
        self._sock.close()
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie does not: its new parent may never reap it)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"

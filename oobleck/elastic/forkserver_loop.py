"""The fork server's loop: a worker forked for each agent's request, its exit reported back.

A request is one JSON line (the program as ``["-m", module, args...]``, its title, environment,
working directory and the agent's process group) sent with the worker's stdin, stdout and stderr
as descriptors; the reply is a line with the worker's pid (or why it could not start), and later
one with its exit code (as ``Popen.wait`` has it). The forked child drops the server's
descriptors and handlers, takes on the agent's context and runs the module as ``python -m``
would (``oobleck.elastic.forkserver`` starts the server; ``oobleck.elastic.forked_worker`` is the
agent's side).
"""

from __future__ import annotations

import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import traceback
from typing import Any

REQUEST_TIMEOUT_S = 10.0  # an agent that connects sends its request at once
MAX_REQUEST_BYTES = 1 << 20


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One request: a JSON line, and the worker's stdin, stdout and stderr (closed on an error)."""
    conn.settimeout(REQUEST_TIMEOUT_S)
    data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, 3)
    try:
        while not data.endswith(b"\n"):
            more = conn.recv(MAX_REQUEST_BYTES)
            if not more or len(data) > MAX_REQUEST_BYTES:
                raise OSError("incomplete request")
            data += more
        if len(fds) != 3:
            raise OSError(f"a request carries the worker's stdin, stdout and stderr; got {len(fds)} descriptors")
        return json.loads(data), fds
    except (OSError, ValueError):
        for fd in fds:
            os.close(fd)
        raise


def _become_worker(request: dict[str, Any], fds: list[int]) -> int:
    """In the forked child: take on the agent's context, run the program, return its exit code."""
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # a background process group may still print
    os.setpgid(0, int(request["pgid"]))
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    # The title first: setproctitle finds the argv area by the environment that follows it, which
    # replacing os.environ would change.
    import setproctitle

    setproctitle.setproctitle(request["title"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # An exec'd interpreter would put the requester's PYTHONPATH first on its path.
    for entry in reversed([e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    argv = list(request["argv"])  # ["-m", module, args...] as after the interpreter
    if len(argv) < 2 or argv[0] != "-m":
        raise ValueError(f"a request runs a module: ['-m', module, ...], not {argv[:2]}")
    sys.argv = [argv[1], *argv[2:]]
    try:
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as done:
        code = done.code
        if code is None or isinstance(code, int):
            return int(code or 0)
        print(code, file=sys.stderr)
        return 1


def _run_child(request: dict[str, Any], fds: list[int]) -> None:
    """The forked child's whole life: like an interpreter's exit (threads joined, atexit run)."""
    code = 1
    try:
        code = _become_worker(request, fds)
    except BaseException:
        traceback.print_exc()
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # as multiprocessing's forked children do
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve(listener: socket.socket, alive_fd: int) -> None:
    """Fork a worker per request until ``alive_fd`` closes; report each exit to its requester."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd says a child exited
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "request")
    selector.register(alive_fd, selectors.EVENT_READ, "alive")
    selector.register(wake_read, selectors.EVENT_READ, "child")
    requesters: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select():
            if key.data == "alive":
                if not os.read(alive_fd, 1):
                    return
            elif key.data == "child":
                os.read(wake_read, 4096)
                _reap(requesters)
            else:
                conn, _ = listener.accept()
                try:
                    request, fds = _read_request(conn)
                except (OSError, ValueError) as error:
                    _reply(conn, {"error": f"bad request: {error}"})
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:  # the child: drop everything of the server's before becoming the worker
                    signal.set_wakeup_fd(-1)
                    selector.close()
                    for sock in (listener, conn, *requesters.values()):
                        sock.close()
                    for fd in (alive_fd, wake_read, wake_write):
                        os.close(fd)
                    _run_child(request, fds)
                for fd in fds:
                    os.close(fd)
                # The child joins its agent's group itself too; doing it here as well (as shells do
                # for job control) means the group holds it before the agent learns its pid, so a
                # node kill right after the start cannot miss it.
                try:
                    os.setpgid(pid, int(request["pgid"]))
                except OSError:
                    pass  # the child got there first (EACCES), or the agent is gone: the child says so
                requesters[pid] = conn
                _reply(conn, {"pid": pid})
        _reap(requesters)  # a SIGCHLD that arrived while a request was served


def _reap(requesters: dict[int, socket.socket]) -> None:
    while requesters:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = requesters.pop(pid, None)
        if conn is not None:
            _reply(conn, {"code": os.waitstatus_to_exitcode(status)})
            conn.close()


def _reply(conn: socket.socket, message: dict[str, Any]) -> None:
    try:
        conn.settimeout(REQUEST_TIMEOUT_S)
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass  # the agent is gone (its node was killed): nobody is waiting for this

"""The agent <-> controller wire format: one JSON object per line over a TCP connection.

Kept free of torch so agents stay light. Every message is checked against ``SCHEMAS`` on arrival
(``parse``): a malformed line or a message with a missing or mistyped field is a
``ProtocolError``, and the controller drops that client instead of acting on it.

Agent to controller: ``hello`` (node id, pid, host, the run's secret: the first message, and the
only one accepted before it), ``hb`` (heartbeat), ``exit`` (a worker's local rank, exit code and
the incarnation it belonged to). Controller to agent: ``start`` (store address, workers per node,
run id, heartbeat interval, incarnation, the worker program's module), ``restart`` (stop every worker, start fresh ones of a
new incarnation), ``kill`` (fault injection), ``shutdown``.

Trust model: the agent port accepts only clients that present the run's secret (a random token
the launcher hands each agent in its environment, ``SECRET_ENV``), so another user's process on a
shared host cannot pose as a node; the secret is not a defence against someone who can read the
agents' environment (root, or the same user).
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import socket
import threading
from typing import Any

from oobleck.runtime.keys import SECRET_ENV  # noqa: F401 (torch-free; agents read it here)

MAX_LINE_BYTES = 1 << 16  # no legitimate message comes near this

_INT = (int,)
_NUM = (int, float)
SCHEMAS: dict[str, dict[str, tuple[type, ...]]] = {
    "hello": {"node": _INT, "pid": _INT, "host": (str,), "secret": (str,)},
    "hb": {"node": _INT, "time": _NUM},
    "exit": {"node": _INT, "local_rank": _INT, "code": _INT, "incarnation": _INT},
    "start": {
        "store": (str,),
        "gpus": _INT,
        "run_id": (str,),
        "heartbeat_s": _NUM,
        "incarnation": _INT,
        "worker_module": (str,),
        "fork_server": (str,),
    },
    "restart": {"incarnation": _INT},
    "kill": {"signal": (str,)},
    "shutdown": {},
}


class ProtocolError(ValueError):
    """A line that is not a valid message (the reason says what is wrong)."""


def new_secret() -> str:
    return secrets.token_hex(16)


def new_run_id() -> str:
    """The tag of a run on every agent and worker command line (``--run-id``), so tools and tests
    can find its processes; ``OOBLECK_RUN_ID`` lets a caller choose it."""
    return os.environ.get("OOBLECK_RUN_ID") or secrets.token_hex(6)


def same_secret(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def parse(line: str) -> dict[str, Any]:
    """The message a line holds, checked against its schema."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: nested too deep, e.g. "[" * 60000
        raise ProtocolError(f"not JSON: {line[:80]!r}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"not a JSON object: {line[:80]!r}")
    kind = message.get("type")
    schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    for name, types in schema.items():
        value = message.get(name)
        if isinstance(value, bool) or not isinstance(value, types):
            raise ProtocolError(f"{kind} message: field {name!r}={value!r} is missing or not a {types[0].__name__}")
    return message


class Channel:
    """A line-delimited JSON connection; ``send`` is thread-safe, ``recv`` is for one reader."""

    def __init__(self, sock: socket.socket, preread: bytes = b"") -> None:
        """``preread``: bytes already read from ``sock`` after the last line taken (the agent port
        reads the hello itself); they come before what ``sock`` still holds."""
        self.sock = sock
        self._reader = sock.makefile("rb")
        self._lock = threading.Lock()
        self._preread = preread

    def send(self, message: dict[str, Any]) -> bool:
        data = (json.dumps(message) + "\n").encode()
        try:
            with self._lock:
                self.sock.sendall(data)
            return True
        except OSError:
            return False

    def recv(self) -> dict[str, Any] | None:
        """The next valid message; None when the peer closed the connection; ``ProtocolError``
        for a line that is not one."""
        head = b""
        if self._preread:
            head, newline, rest = self._preread.partition(b"\n")
            if newline:
                self._preread = rest
                head += newline
            else:
                self._preread = b""
        try:
            complete = head.endswith(b"\n") or len(head) > MAX_LINE_BYTES
            line = head if complete else head + self._reader.readline(MAX_LINE_BYTES + 1 - len(head))
        except (OSError, ValueError):
            return None
        if not line:
            return None
        if len(line) > MAX_LINE_BYTES:
            raise ProtocolError(f"line longer than {MAX_LINE_BYTES} bytes")
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("line is not UTF-8") from None
        return parse(text)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._reader.close()
        except OSError:
            pass
        self.sock.close()

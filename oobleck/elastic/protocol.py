"""The agent <-> controller wire format: one JSON object per line over a TCP connection.

Kept free of torch so agents stay light. Messages, agent to controller: ``hello`` (node id, pid,
host), ``hb`` (heartbeat), ``exit`` (a worker's local rank and exit code). Controller to agent:
``start`` (store address, workers per node, run id), ``shutdown``.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any, Optional


class Channel:
    """A line-delimited JSON connection; ``send`` is thread-safe, ``recv`` is for one reader."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._reader = sock.makefile("r", encoding="utf-8")
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> bool:
        data = (json.dumps(message) + "\n").encode()
        try:
            with self._lock:
                self.sock.sendall(data)
            return True
        except OSError:
            return False

    def recv(self) -> Optional[dict[str, Any]]:
        """The next message, or None when the peer closed the connection."""
        try:
            line = self._reader.readline()
        except (OSError, ValueError):
            return None
        if not line:
            return None
        return json.loads(line)

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

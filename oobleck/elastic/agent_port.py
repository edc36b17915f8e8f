"""The agent port: where the run's node agents connect to the controller (line-JSON, ``protocol``).

A connection must first say hello with the run's secret and its node id; from then on each of
its messages becomes one ``(kind, node, (channel, message), time)`` item on the queue the
controller's loop drains (``Membership.drain``), and its close (or a message that is not valid) a
``("lost", node, channel, time)`` item. A client that does not present the secret, sends a message
that is not valid, or says nothing within ``HELLO_TIMEOUT_S`` is dropped with one log line; it can
neither crash the controller nor take a node down. A connection that speaks for another node, or
says hello twice, is dropped, and its node is reported lost.
"""

from __future__ import annotations

import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from oobleck.elastic.protocol import Channel, ProtocolError, same_secret
from oobleck.errors import RunError

# A connection must say hello within this long (an agent does at once); one that does not is
# dropped, so idle connections cannot pile up threads and descriptors in the controller.
HELLO_TIMEOUT_S = 10.0
LISTEN_BACKLOG = 64  # agents connecting at once: every node of a large run


class AgentPort:
    """The listening socket and one reader thread per connection (see the module docstring)."""

    def __init__(self, cluster: Any, secret: str, messages: queue.Queue, closing: Callable[[], bool]) -> None:
        """Listen on ``cluster.master_addr``, one port above the store's (any free port when the
        store's is picked); ``closing`` says the run is ending (silent closes are then expected)."""
        self.host = str(cluster.master_addr)
        self.secret = secret
        self.messages = messages
        self.closing = closing
        port = int(cluster.master_port) + 1 if int(cluster.master_port) else 0
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind((self.host, port))
        except OSError as error:
            server.close()
            raise RunError(
                f"cannot open the agent port {cluster.master_addr}:{port} ({error}); "
                "set cluster.master_port=<free port> (the agent port is the next one) or 0"
            ) from None
        server.listen(LISTEN_BACKLOG)
        self.server = server
        threading.Thread(target=self._accept, daemon=True, name="agent-accept").start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.server.getsockname()[1]}"

    def close(self) -> None:
        # close() alone neither wakes the accept thread (blocked in accept, it keeps this object
        # alive) nor ends the LISTEN state; shutdown does both.
        try:
            self.server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.server.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self.server.accept()
            except OSError:
                return
            sock.settimeout(HELLO_TIMEOUT_S)
            threading.Thread(target=self._read_agent, args=(Channel(sock), peer), daemon=True).start()

    def _drop(self, channel: Channel, peer: Any, why: str) -> None:
        print(f"oobleck: dropped an agent connection from {peer[0]}:{peer[1]}: {why}", file=sys.stderr, flush=True)
        channel.close()

    def _read_agent(self, channel: Channel, peer: Any) -> None:
        node: int | None = None
        while True:
            try:
                message = channel.recv()
            except ProtocolError as error:
                if node is not None:
                    self.messages.put(("lost", node, channel, time.time()))
                self._drop(channel, peer, str(error))
                return
            if message is None:
                if node is not None:
                    self.messages.put(("lost", node, channel, time.time()))
                elif not self.closing():
                    self._drop(channel, peer, f"closed or silent for {HELLO_TIMEOUT_S} s before saying hello")
                return
            if node is None:
                if message["type"] != "hello":
                    return self._drop(channel, peer, f"{message['type']} before hello")
                if not same_secret(message["secret"], self.secret):
                    return self._drop(channel, peer, "wrong or missing run secret")
                node = int(message["node"])
                channel.sock.settimeout(None)  # an agent may stay quiet between heartbeats
                self.messages.put(("hello", node, (channel, message), time.time()))
            elif message["type"] == "hello" or int(message.get("node", node)) != node:
                self.messages.put(("lost", node, channel, time.time()))
                return self._drop(channel, peer, f"node {node}'s agent spoke for another node or said hello twice")
            else:
                self.messages.put((message["type"], node, (channel, message), time.time()))

"""The agent port: where the run's node agents connect to the controller (line-JSON, ``protocol``).

A connection must first say hello with the run's secret and its node id; from then on each of
its messages becomes one ``(kind, node, (channel, message), time)`` item on the queue the
controller's loop drains (``Membership.drain``), and its close (or a message that is not valid) a
``("lost", node, channel, time)`` item. A client that does not present the secret, sends a message
that is not valid, or says nothing within ``HELLO_TIMEOUT_S`` is dropped; it can neither crash the
controller nor take a node down. A connection that speaks for another node, or says hello twice,
is dropped, and its node is reported lost.

The handshake is bounded: connections that have not said hello yet cost no thread (one
``selectors`` loop reads every hello, each with its deadline), at most ``MAX_PENDING_HELLOS`` wait
at once (a new one beyond that drops the oldest), and only the first ``MAX_DROP_LINES`` drops are
logged, one line each (then one line saying later drops are only counted, ``AgentPort.dropped``).
A thread is started per agent once it has said hello with the run's secret.
"""

from __future__ import annotations

import queue
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from oobleck.elastic.protocol import MAX_LINE_BYTES, Channel, ProtocolError, parse, same_secret
from oobleck.errors import RunError

# A connection must say hello within this long (an agent does at once); one that does not is
# dropped, so idle connections cannot pile up descriptors in the controller.
HELLO_TIMEOUT_S = 10.0
LISTEN_BACKLOG = 64  # agents connecting at once: every node of a large run
# Connections waiting to say hello at once; far above any run's node count (each agent connects
# once), so only a flood of idle connections reaches it.
MAX_PENDING_HELLOS = 256
MAX_DROP_LINES = 20  # dropped connections logged one line each; later ones are counted
# The handshake loop's longest sleep: how soon it sees that the port is closing.
HANDSHAKE_TICK_S = 0.5
READ_CHUNK = 4096


@dataclass
class _Pending:
    """A connection that has not said hello yet."""

    peer: Any
    deadline: float
    received: bytearray = field(default_factory=bytearray)


def listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: any free port) and listening with ``backlog``;
    ``OSError`` if it cannot be (the port in use), with nothing left open."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind((host, port))
        server.listen(backlog)
    except OSError:
        server.close()
        raise
    return server


def bind_agent_listener(cluster: Any) -> socket.socket:
    """The agent port's listening socket on ``cluster.master_addr``, one port above the store's
    (any free port when the store's is picked): a port in use is one clear error."""
    port = int(cluster.master_port) + 1 if int(cluster.master_port) else 0
    try:
        return listening_socket(str(cluster.master_addr), port, LISTEN_BACKLOG)
    except OSError as error:
        raise RunError(
            f"cannot open the agent port {cluster.master_addr}:{port} ({error}); "
            "set cluster.master_port=<free port> (the agent port is the next one) or 0"
        ) from None


class AgentPort:
    """The listening socket, the handshake loop, and one reader thread per agent (see the module
    docstring)."""

    def __init__(
        self,
        cluster: Any,
        secret: str,
        messages: queue.Queue,
        closing: Callable[[], bool],
        listener: socket.socket | None = None,
    ) -> None:
        """Listen on ``listener`` (``bind_agent_listener``'s, bound before the run started
        anything), or bind one now; ``closing`` says the run is ending (silent closes are then
        expected)."""
        self.host = str(cluster.master_addr)
        self.secret = secret
        self.messages = messages
        self.closing = closing
        self.dropped = 0  # connections dropped, logged or not
        server = bind_agent_listener(cluster) if listener is None else listener
        server.setblocking(False)
        self.server = server
        self._closed = threading.Event()
        self._pending: dict[socket.socket, _Pending] = {}  # in order of arrival
        self._selector = selectors.DefaultSelector()
        self._selector.register(server, selectors.EVENT_READ)
        threading.Thread(target=self._handshakes, daemon=True, name="agent-handshakes").start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.server.getsockname()[1]}"

    def pending(self) -> int:
        """Connections waiting to say hello now."""
        return len(self._pending)

    def close(self) -> None:
        # shutdown ends the LISTEN state at once; the handshake loop sees the flag within a tick.
        self._closed.set()
        try:
            self.server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.server.close()

    # ------------------------------------------------------------------ handshakes
    def _handshakes(self) -> None:
        try:
            while not self._closed.is_set():
                timeout = HANDSHAKE_TICK_S
                if self._pending:
                    soonest = min(p.deadline for p in self._pending.values())
                    timeout = max(0.0, min(timeout, soonest - time.monotonic()))
                try:
                    ready = self._selector.select(timeout)
                except (OSError, ValueError):
                    return
                for key, _ in ready:
                    if key.fileobj is self.server:
                        self._accept_all()
                    else:
                        self._read_hello(key.fileobj)  # type: ignore[arg-type]
                now = time.monotonic()
                for sock, pending in list(self._pending.items()):
                    if pending.deadline <= now:
                        self._drop_pending(sock, f"silent for {HELLO_TIMEOUT_S} s before saying hello")
        finally:
            for sock in list(self._pending):
                self._forget(sock)
                sock.close()
            self._selector.close()

    def _accept_all(self) -> None:
        while True:
            try:
                sock, peer = self.server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # the port is closing
                return
            if len(self._pending) >= MAX_PENDING_HELLOS:
                oldest = next(iter(self._pending))
                self._drop_pending(oldest, f"{MAX_PENDING_HELLOS} connections were waiting to say hello")
            sock.setblocking(False)
            self._pending[sock] = _Pending(peer, time.monotonic() + HELLO_TIMEOUT_S)
            self._selector.register(sock, selectors.EVENT_READ)

    def _read_hello(self, sock: socket.socket) -> None:
        pending = self._pending.get(sock)
        if pending is None:
            return
        try:
            data = sock.recv(READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            return self._drop_pending(sock, f"closed before saying hello ({error})")
        if not data:
            return self._drop_pending(sock, "closed before saying hello", quiet=self.closing())
        pending.received += data
        line, newline, rest = bytes(pending.received).partition(b"\n")
        if not newline:
            if len(pending.received) > MAX_LINE_BYTES:
                self._drop_pending(sock, f"line longer than {MAX_LINE_BYTES} bytes")
            return
        if len(line) > MAX_LINE_BYTES:
            return self._drop_pending(sock, f"line longer than {MAX_LINE_BYTES} bytes")
        try:
            message = parse(line.decode("utf-8"))
        except UnicodeDecodeError:
            return self._drop_pending(sock, "line is not UTF-8")
        except ProtocolError as error:
            return self._drop_pending(sock, str(error))
        if message["type"] != "hello":
            return self._drop_pending(sock, f"{message['type']} before hello")
        if not same_secret(message["secret"], self.secret):
            return self._drop_pending(sock, "wrong or missing run secret")
        self._forget(sock)
        sock.setblocking(True)  # an agent may stay quiet between heartbeats: no timeout from here
        node = int(message["node"])
        channel = Channel(sock, preread=rest)
        self.messages.put(("hello", node, (channel, message), time.time()))
        threading.Thread(
            target=self._read_agent, args=(channel, pending.peer, node), daemon=True, name=f"agent-{node}"
        ).start()

    def _forget(self, sock: socket.socket) -> None:
        self._pending.pop(sock, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass

    def _drop_pending(self, sock: socket.socket, why: str, *, quiet: bool = False) -> None:
        pending = self._pending.get(sock)
        self._forget(sock)
        try:
            sock.close()
        except OSError:
            pass
        if not quiet and pending is not None:
            self._log_drop(pending.peer, why)

    def _log_drop(self, peer: Any, why: str) -> None:
        self.dropped += 1
        if self.dropped <= MAX_DROP_LINES:
            print(f"oobleck: dropped an agent connection from {peer[0]}:{peer[1]}: {why}", file=sys.stderr, flush=True)
        if self.dropped == MAX_DROP_LINES:
            print(
                f"oobleck: {MAX_DROP_LINES} agent connections dropped; later drops are counted, not logged",
                file=sys.stderr,
                flush=True,
            )

    # ------------------------------------------------------------------ agents
    def _read_agent(self, channel: Channel, peer: Any, node: int) -> None:
        while True:
            try:
                message = channel.recv()
            except ProtocolError as error:
                self.messages.put(("lost", node, channel, time.time()))
                self._log_drop(peer, str(error))
                channel.close()
                return
            if message is None:
                self.messages.put(("lost", node, channel, time.time()))
                return
            if message["type"] == "hello" or int(message.get("node", node)) != node:
                self.messages.put(("lost", node, channel, time.time()))
                self._log_drop(peer, f"node {node}'s agent spoke for another node or said hello twice")
                channel.close()
                return
            self.messages.put((message["type"], node, (channel, message), time.time()))

"""The agent port's handshake is bounded (issue 28, item 7): idle connections that never say hello
cost no thread, wait at most ``HELLO_TIMEOUT_S`` each, at most ``MAX_PENDING_HELLOS`` wait at once,
and only the first ``MAX_DROP_LINES`` drops are logged. An agent with the run's secret still gets
in while they wait, and what it sent right after its hello is not lost."""

from __future__ import annotations

import json
import queue
import socket
import threading
import time

import pytest

from oobleck.elastic import agent_port
from oobleck.elastic.agent_port import MAX_DROP_LINES, MAX_PENDING_HELLOS, AgentPort
from testing import config_section

pytestmark = pytest.mark.slow  # starts processes

SECRET = "the run's secret"
WAIT_S = 30.0  # hang guard


def _port(messages: queue.Queue) -> AgentPort:
    cluster = config_section("cluster", master_addr="127.0.0.1", master_port=0)
    return AgentPort(cluster, SECRET, messages, closing=lambda: False)


def _connect(port: AgentPort) -> socket.socket:
    host, _, number = port.address.rpartition(":")
    return socket.create_connection((host, int(number)), timeout=WAIT_S)


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(0.0)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_idle_connections_cost_no_thread_and_are_capped(capfd):
    messages: queue.Queue = queue.Queue()
    port = _port(messages)
    threads = threading.active_count()
    idle = []
    try:
        for _ in range(MAX_PENDING_HELLOS + 40):
            idle.append(_connect(port))
        _until(lambda: port.dropped == 40, f"the oldest 40 dropped (dropped {port.dropped})")
        assert port.pending() == MAX_PENDING_HELLOS
        assert threading.active_count() == threads  # not one thread per idle connection
        assert all(_closed_by_peer(sock) for sock in idle[:40]) and not any(_closed_by_peer(s) for s in idle[40:])
        # An agent gets in while the idle ones wait; its first message after hello is not lost.
        agent = _connect(port)
        hello = {"type": "hello", "node": 3, "pid": 1, "host": "h", "secret": SECRET}
        agent.sendall((json.dumps(hello) + "\n" + json.dumps({"type": "hb", "node": 3, "time": 1.5}) + "\n").encode())
        kind, node, _, _ = messages.get(timeout=WAIT_S)
        assert (kind, node) == ("hello", 3)
        kind, node, (_, beat), _ = messages.get(timeout=WAIT_S)
        assert (kind, node, beat["time"]) == ("hb", 3, 1.5)
        err = capfd.readouterr().err
        assert err.count("oobleck: dropped an agent connection") == MAX_DROP_LINES
        assert "connections were waiting to say hello" in err and "later drops are counted, not logged" in err
        agent.close()
    finally:
        for sock in idle:
            sock.close()
        port.close()


def test_a_connection_silent_past_the_deadline_is_dropped(monkeypatch, capfd):
    monkeypatch.setattr(agent_port, "HELLO_TIMEOUT_S", 0.3)
    port = _port(queue.Queue())
    try:
        silent = _connect(port)
        half = _connect(port)
        half.sendall(b'{"type": "hel')  # half a hello, never finished
        _until(lambda: port.dropped == 2 and port.pending() == 0, "both dropped at their deadline")
        assert _closed_by_peer(silent) and _closed_by_peer(half)
        assert capfd.readouterr().err.count("silent for 0.3 s before saying hello") == 2
    finally:
        port.close()


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (b'{"type": "hello", "node": 0, "pid": 1, "host": "h", "secret": "a guess"}\n', "wrong or missing run secret"),
        (b"\xff\xfe\n", "not UTF-8"),
        (b'{"type": "hb", "node": 0, "time": 1.0}\n', "hb before hello"),
    ],
)
def test_a_bad_hello_is_dropped_with_its_reason(line, why, capfd):
    messages: queue.Queue = queue.Queue()
    port = _port(messages)
    try:
        client = _connect(port)
        client.sendall(line)
        _until(lambda: port.dropped == 1, "dropped")
        assert why in capfd.readouterr().err and messages.empty()
    finally:
        port.close()

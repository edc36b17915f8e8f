"""``bench_runtime.capped_links``: the emulated per-node links the split-copy figure rests on.

With the links capped, bytes sent from a node's address arrive no faster than the cap, bytes from
any other loopback address are not shaped, and the loopback device is left as it was. Needs root
and tc (iproute2), as the benchmark does; skipped elsewhere, with the reason.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MBIT = 40.0  # 5 MB/s
BYTES = 2 << 20

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="shaping loopback needs root and tc"),
    pytest.mark.slow,  # starts processes (tests/conftest.py groups these on one xdist worker)
]


def bench_runtime():
    spec = importlib.util.spec_from_file_location("bench_runtime", REPO / "benchmarks" / "bench_runtime.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def send_rate(source: str) -> float:
    """Bytes per second of BYTES sent over TCP from ``source`` to 127.0.0.1 (until all arrived)."""
    server = socket.create_server(("127.0.0.1", 0))
    received = [0]

    def receive() -> None:
        connection, _ = server.accept()
        with connection:
            while chunk := connection.recv(1 << 16):
                received[0] += len(chunk)

    thread = threading.Thread(target=receive)
    thread.start()
    with socket.create_connection(("127.0.0.1", server.getsockname()[1]), source_address=(source, 0)) as client:
        started = time.perf_counter()
        client.sendall(b"x" * BYTES)
    thread.join(timeout=120)
    elapsed = time.perf_counter() - started
    server.close()
    assert received[0] == BYTES
    return BYTES / elapsed


def qdisc() -> str:
    return subprocess.run(["tc", "qdisc", "show", "dev", "lo"], check=True, capture_output=True, text=True).stdout


def test_a_capped_node_sends_no_faster_than_its_link_and_others_are_not_shaped():
    module = bench_runtime()
    before = qdisc()
    with module.capped_links(MBIT, nodes=2):
        capped = send_rate(module.LINK_BASE)
        free = send_rate("127.0.0.1")
    assert qdisc() == before
    cap = MBIT * 1e6 / 8
    # A shaper can only slow bytes down, so the first bound holds on any machine; the burst lets a
    # little more through at the start. Unshaped loopback moves hundreds of MB/s.
    assert capped < 1.5 * cap, capped
    assert free > 10 * cap, free

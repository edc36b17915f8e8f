"""A run binds its two ports (the store's and the agent port, one above it when
``cluster.master_port`` is set) before it starts anything: a port in use stops ``launch`` with one
line naming the key, before a fork server, a plan, a wandb run or a run dir exists."""

from __future__ import annotations

import contextlib
import socket

import pytest

from oobleck.elastic.job import launch
from oobleck.elastic.local import run_processes
from oobleck.elastic.store_host import bind_run_ports
from oobleck.errors import RunError
from testing import config_section, tiny_config

ATTEMPTS = 50  # tries at finding two adjacent free ports


def _listening(port: int) -> socket.socket:
    held = socket.socket()
    held.bind(("127.0.0.1", port))
    held.listen(1)
    return held


def _free_pair() -> int:
    """A port P with P and P + 1 free at this moment."""
    for _ in range(ATTEMPTS):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        with contextlib.suppress(OSError), socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", port))
            second.bind(("127.0.0.1", port + 1))
            return port
    raise AssertionError("no two adjacent free ports")


@pytest.mark.parametrize("busy, message", [(0, "cannot host the store on"), (1, "cannot open the agent port")])
def test_a_busy_port_stops_the_run_before_anything_starts(tmp_path, busy, message):
    port = _free_pair()
    with _listening(port + busy):
        cfg = tiny_config(**{"cluster.master_port": port})
        with pytest.raises(RunError, match=f"{message} 127.0.0.1:{port + busy} .*cluster.master_port="):
            launch(cfg, tmp_path / "run", run_id="busyport0000")
    assert not (tmp_path / "run").exists() and run_processes("busyport0000") == []


def test_the_ports_are_held_until_closed():
    port = _free_pair()
    ports = bind_run_ports(config_section("cluster", master_addr="127.0.0.1", master_port=port))
    try:
        assert ports.store.getsockname()[1] == port and ports.agent.getsockname()[1] == port + 1
        with pytest.raises(OSError):
            _listening(port)
    finally:
        ports.close()
    _listening(port).close()  # free again

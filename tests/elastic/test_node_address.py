"""``cluster.node_address_base``: each local node's workers bind gloo to an address of their own.

A 4-node run with node n on 127.0.1.n (two pipelines of two stages) loses a node and recovers,
copying the layers its pipeline's survivor lacks from the other pipeline's nodes: the
run equals single-process training, and while it trains every worker's gloo sockets sit on its
node's address (what lets a traffic shaper give each node a link of its own: see
``benchmarks/bench_runtime.py --only transfer --link-mbit``).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from oobleck.elastic.job import launch
from oobleck.elastic.local import node_processes
from testing import assert_matches_reference, hand_plan, template, tiny_config

# Slow: starts processes. One xdist group: both give local nodes addresses of their own (127.0.2.n),
# which the partition test drops packets of.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("node_addresses")]

BASE = "127.0.1.0"


def local_addresses(pid: int) -> set[str]:
    """The local IPv4 addresses of process ``pid``'s TCP sockets."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    addresses = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] not in inodes:
                continue
            hex_address = fields[1].rsplit(":", 1)[0]
            raw = bytes.fromhex(hex_address[-8:])[::-1]  # IPv4, or the IPv4 of a mapped IPv6 address
            addresses.add(socket.inet_ntoa(raw))
    return addresses


def test_each_node_trains_and_recovers_on_its_own_address(tmp_path):
    cfg = tiny_config(
        **{
            "cluster.nodes": 4,
            "job.fault_tolerance": 1,
            "job.steps": 6,
            "cluster.node_address_base": BASE,
            "failures.kind": "explicit",
            "failures.events": [{"action": "remove", "step": 3, "nodes": [1]}],
        }
    )
    seen: dict[int, set[str]] = {}

    def watch(controller) -> None:
        def on_step(row: dict) -> None:
            if row["step"] == 1:
                for node, processes in node_processes(controller.run_id).items():
                    seen[node] = set().union(*(local_addresses(pid) for pid in processes["workers"]))

        controller.on_step = on_step

    two_stages = template([(0, 3, 0, 0, 1), (3, 6, 1, 0, 1)])
    plan = hand_plan([(two_stages, (0, 1), 4), (two_stages, (2, 3), 4)], batch=16, micro=2, layers=6, f=1, gpus=1)
    outcome, _ = launch(cfg, tmp_path / "run", initial_plan=plan, on_start=watch)
    assert sorted(seen) == [0, 1, 2, 3]
    for node, addresses in seen.items():
        others = {f"127.0.1.{n}" for n in range(4) if n != node}
        assert f"127.0.1.{node}" in addresses and not addresses & others, (node, addresses)
    assert any(r["bytes_moved"] for r in outcome.recoveries), outcome.recoveries
    assert_matches_reference(cfg, outcome, tmp_path / "run")

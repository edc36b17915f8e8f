"""A node cut off from the data plane is blamed and removed (issue 28, item 4), on a real partition.

Four local nodes each bind gloo to an address of their own (``cluster.node_address_base``, node n
on 127.0.79.n); two pipelines of two stages, f=1. At step 3 every packet to and from node 3's
address is dropped on the loopback device (tc: a ``prio`` qdisc whose filters send that address's
packets to a ``netem loss 100%`` band), while its agent and the store, on 127.0.0.1, still reach
the controller. Every rank then waits on another (no rank to blame from the waits alone); the
controller probes each node's data-plane address, finds node 3's silent, and removes it like a
failed node. The run recovers and equals single-process training. Needs root and tc (skips
otherwise); the qdisc is removed when the test ends.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from oobleck.elastic.job import launch
from testing import assert_matches_reference, hand_plan, template, tiny_config

BASE = "127.0.79.0"
CUT = 3  # the node whose data-plane address is cut off
CUT_AT = 3  # after this step commits


def _tc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", *args], capture_output=True, text=True, check=False)


@pytest.fixture
def loopback_partition():
    if os.geteuid() != 0 or shutil.which("tc") is None:
        pytest.skip("a real partition drops packets with tc on the loopback device: needs root and iproute2's tc")
    shown = _tc("qdisc", "show", "dev", "lo").stdout
    if any(kind in shown for kind in ("prio", "htb", "netem", "tbf")):
        pytest.skip(f"lo already has a qdisc ({shown.strip()}): another test or benchmark shapes it now")
    address = f"127.0.79.{CUT}"

    def cut() -> None:
        for args in (
            ("qdisc", "add", "dev", "lo", "root", "handle", "1:", "prio", "bands", "4"),
            ("qdisc", "add", "dev", "lo", "parent", "1:4", "handle", "40:", "netem", "loss", "100%"),
            (
                "filter",
                "add",
                "dev",
                "lo",
                "parent",
                "1:",
                "protocol",
                "ip",
                "u32",
                "match",
                "ip",
                "dst",
                address,
                "flowid",
                "1:4",
            ),
            (
                "filter",
                "add",
                "dev",
                "lo",
                "parent",
                "1:",
                "protocol",
                "ip",
                "u32",
                "match",
                "ip",
                "src",
                address,
                "flowid",
                "1:4",
            ),
        ):
            done = _tc(*args)
            assert done.returncode == 0, f"tc {' '.join(args)}: {done.stderr}"

    try:
        yield cut
    finally:
        _tc("qdisc", "del", "dev", "lo", "root")


def test_a_node_cut_off_from_the_data_plane_is_removed_and_the_run_goes_on(tmp_path, loopback_partition):
    cfg = tiny_config(
        **{
            "cluster.nodes": 4,
            "job.fault_tolerance": 1,
            "job.steps": 8,
            "cluster.node_address_base": BASE,
            "cluster.collective_timeout_s": 8.0,
        }
    )

    def partition_midway(controller) -> None:
        def on_step(row: dict) -> None:
            if row["step"] == CUT_AT:
                loopback_partition()

        controller.on_step = on_step

    two_stages = template([(0, 3, 0, 0, 1), (3, 6, 1, 0, 1)])
    plan = hand_plan([(two_stages, (0, 1), 4), (two_stages, (2, 3), 4)], batch=16, micro=2, layers=6, f=1, gpus=1)
    outcome, _ = launch(cfg, tmp_path / "run", initial_plan=plan, on_start=partition_midway)
    assert outcome.stopped is None
    assert len(outcome.recoveries) == 1, outcome.recoveries
    events = (tmp_path / "run" / "events.csv").read_text()
    failures = [line for line in events.splitlines() if ",failure," in line]
    assert len(failures) == 1 and "data-plane address did not answer" in failures[0], failures
    assert f"[{CUT}]" in failures[0] or f",{CUT}," in failures[0] or f"node {CUT}" in failures[0], failures
    assert_matches_reference(cfg, outcome, tmp_path / "run")

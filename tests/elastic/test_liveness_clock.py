"""Liveness is measured in durations: a step of the wall clock (NTP, a virtual machine's clock set
again after a pause) makes no node look silent, while real silence still fails a node, with its
cause dated on the wall clock the recovery records use. Were silence wall-clock time, every node
of a run would fail at the same instant of a step, its agents and workers training on.
"""

from __future__ import annotations

import json
import socket
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from oobleck.elastic import membership as membership_module
from oobleck.elastic.events import EventKind
from oobleck.elastic.membership import Membership, NodeState
from oobleck.elastic.protocol import Channel
from oobleck.runtime import keys
from oobleck.runtime.sealed_store import SealedStore
from testing import tiny_config

SPACE = keys.KeySpace("the run's secret")
STEP_S = 3600.0  # the wall clock jumps an hour ahead


class Clocks:
    """The module's view of ``time``: the real clocks, each shifted by what a test adds."""

    def __init__(self) -> None:
        self.wall_shift = 0.0
        self.monotonic_shift = 0.0

    def time(self) -> float:
        return time.time() + self.wall_shift

    def monotonic(self) -> float:
        return time.monotonic() + self.monotonic_shift

    def __getattr__(self, name: str):
        return getattr(time, name)


@pytest.fixture
def clocks(monkeypatch):
    shifted = Clocks()
    monkeypatch.setattr(membership_module, "time", shifted)
    return shifted


@pytest.fixture
def table():
    """A membership table of one node whose agent is one end of a socket pair, and a real store."""
    cfg = tiny_config(**{"cluster.nodes": 1})
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    events: list[dict] = []
    table = Membership(
        cfg,
        SealedStore(server, SPACE),
        f"127.0.0.1:{server.port}",
        secret="the run's secret",
        run_id="run",
        worker_module="oobleck.runtime.worker",
        event=lambda kind, **fields: events.append({"kind": kind, **fields}),
        run_finished=lambda: False,
    )
    ours, agents = socket.socketpair()
    channel = Channel(ours)
    table.nodes[0] = NodeState(node=0, channel=channel, up=True, heard_at=membership_module.time.monotonic())
    yield table, channel, events
    ours.close()
    agents.close()


def heartbeat(table: Membership, channel: Channel) -> None:
    """The agent's heartbeat as the agent port queues it, handled by the controller's loop."""
    table.messages.put(("hb", 0, (channel, {"type": "hb", "node": 0}), membership_module.time.time()))
    table.drain(0.0)


def test_a_wall_clock_step_is_no_silence(table, clocks):
    table, channel, events = table
    heartbeat(table, channel)
    clocks.wall_shift = STEP_S
    table.check_heartbeats()
    assert not table.nodes[0].failed, events


def test_silence_on_the_monotonic_clock_fails_the_node_and_dates_its_cause(table, clocks):
    table, channel, events = table
    heartbeat(table, channel)
    silent_s = float(table.cfg.cluster.heartbeat_timeout_s) + 2.0
    clocks.monotonic_shift = silent_s
    before = time.time()
    table.check_heartbeats()
    assert table.nodes[0].failed
    (failure,) = [e for e in events if e["kind"] == EventKind.FAILURE]
    assert failure["node"] == 0 and "no heartbeat" in failure["reason"]
    # The cause is dated where the silence began, on the wall clock: detect_s is the silence.
    assert failure["detect_s"] == pytest.approx(silent_s, abs=0.5)
    cause, detect_s = table.take_changes().removed[0]
    assert cause <= before - silent_s + 0.5 and detect_s == pytest.approx(silent_s, abs=0.5)


def _write_beat(table: Membership, count: int) -> None:
    beat = {"count": count, "generation": 0, "rank": 0, "wait": None, "peers": None, "waited_s": 0.0}
    table.store.set(keys.heartbeat(0, 0, 0), json.dumps(beat))


def test_a_wall_clock_step_is_no_frozen_worker(table, clocks):
    table, _, events = table
    _write_beat(table, 1)
    table.check_workers(0, {(0, 0): 0})
    clocks.wall_shift = STEP_S  # one beat interval later, the counter not moved yet
    clocks.monotonic_shift = float(table.cfg.cluster.heartbeat_interval_s)  # the next check is due
    table.check_workers(0, {(0, 0): 0})
    assert not table.nodes[0].failed, events


def test_a_worker_counter_that_stops_still_fails_its_node(table, clocks):
    table, _, events = table
    _write_beat(table, 1)
    table.check_workers(0, {(0, 0): 0})
    clocks.monotonic_shift = float(table.cfg.cluster.heartbeat_timeout_s) + 1.0  # no beat since
    table.check_workers(0, {(0, 0): 0})
    assert table.nodes[0].failed
    assert any("sent no heartbeat" in str(e.get("reason")) for e in events)

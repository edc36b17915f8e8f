"""``oobleck.elastic.node_probes`` on its own: the data-plane probe against real sockets, the error
a raised worker stops the run with, the parsers of what workers write to the store, and the boot
wait against a real TCPStore. The runs that use them are in tests/faults and tests/elastic."""

from __future__ import annotations

import math
import queue
import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from oobleck.elastic import node_probes
from oobleck.runtime.keys import KeySpace
from oobleck.runtime.sealed_store import SealedStore


def test_a_node_is_silent_only_when_none_of_its_addresses_answers():
    listening = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    closed_address = closed.getsockname()
    closed.close()  # nothing listens there now: the connection is refused
    try:
        addresses = {
            0: [listening.getsockname()],
            1: [closed_address],
            2: [closed_address, listening.getsockname()],  # one worker of the node answers
        }
        assert node_probes.silent_nodes(addresses, timeout_s=2.0) == [1]
        assert node_probes.silent_nodes({}, timeout_s=2.0) == []
    finally:
        listening.close()


def test_a_raised_worker_stops_the_run_with_its_cause_first():
    report = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: bad batch\n\n'
    error = node_probes.worker_error(2, 1, 1, report)
    first, *rest = str(error).splitlines()
    assert first == "worker (node 2, local rank 1) raised an exception: ValueError: bad batch"
    assert rest[0] == "Traceback (most recent call last):"
    missing = node_probes.worker_error(0, 0, 1, None)
    assert "exited with code 1 and reported no error" in str(missing)


@pytest.mark.parametrize("value", [b"nan", b"-1", b"0", b"inf", b"soon"])
def test_a_strike_time_that_is_no_time_is_refused(value):
    with pytest.raises(ValueError):
        node_probes.wall_time(value)


def test_a_strike_time_and_a_registration_parse():
    assert math.isclose(node_probes.wall_time(b"1764800000.25"), 1764800000.25)
    assert node_probes.registration(b'{"data_address": "10.0.0.1:5000"}') == {"data_address": "10.0.0.1:5000"}
    with pytest.raises(ValueError, match="not a registration record"):
        node_probes.registration(b"[1, 2]")


def _store() -> tuple[dist.TCPStore, str]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    return server, f"127.0.0.1:{server.port}"


def test_the_boot_wait_reports_registration_and_times_out_otherwise():
    server, address = _store()
    space = KeySpace("a secret of this test")
    messages: queue.Queue = queue.Queue()
    end = threading.Event()
    SealedStore(server, space).set("registered/0", "yes")
    done = node_probes.await_registration(address, space, ["registered/0"], 10.0, end, messages, 3, 1)
    kind, node, incarnation, _ = messages.get(timeout=10)
    assert (kind, node, incarnation) == ("registered", 3, 1)
    late = node_probes.await_registration(address, space, ["registered/1"], 0.3, end, messages, 4, 2)
    kind, node, incarnation, _ = messages.get(timeout=10)
    assert (kind, node, incarnation) == ("boot_timeout", 4, 2)
    stopped = node_probes.await_registration(address, space, ["registered/2"], 10.0, end, messages, 5, 0)
    end.set()  # the run ends: the wait stops without a message
    for thread in (done, late, stopped):
        thread.join(timeout=5)
        assert not thread.is_alive()
    assert messages.empty()


def test_a_raised_workers_report_is_read_from_the_store():
    server, _ = _store()
    store = SealedStore(server, KeySpace("another secret"))
    store.set("error/1/0/0", "Traceback\nRuntimeError: out of memory")
    assert node_probes.error_report(store, "error/1/0/0") == "Traceback\nRuntimeError: out of memory"

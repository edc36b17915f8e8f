"""What the controller learns about a node's workers beside its agent's messages, each within a
bound: that they registered in the store (a boot), the report a worker that raised left there,
and whether their data plane answers. ``oobleck.elastic.membership`` acts on the answers."""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from oobleck.errors import RunError
from oobleck.runtime.keys import KeySpace
from oobleck.runtime.sealed_store import SealedStore

# A boot wait polls the store this often (``check``, not a blocking ``wait``: no thread may still
# be inside the store's C++ wait when the store goes away, an exception there at exit aborts the
# process, and a wait in timed slices logs a warning per slice).
BOOT_POLL_S = 0.1
# A worker that raised writes its traceback to the store just before it exits; its agent may report
# the exit first. How long the exit waits for that report (longer on a loaded machine).
ERROR_REPORT_WAIT_S = 5.0


def await_registration(
    store_address: str,
    space: KeySpace,
    registered: list[str],
    timeout_s: float,
    end: threading.Event,
    messages: queue.Queue,
    node: int,
    incarnation: int,
) -> threading.Thread:
    """Wait, in a thread of its own with its own store connection, for every key of ``registered``;
    then put ``("registered", node, incarnation, time)`` on ``messages``, or ``("boot_timeout",
    ...)`` after ``timeout_s`` (or when the store goes away). ``end`` stops it without a message.
    The thread holds only these arguments: one still waiting when the run ends must not keep the
    membership, and with it the store's server, alive."""
    host, _, port = store_address.rpartition(":")

    def wait() -> None:
        deadline = time.monotonic() + timeout_s
        try:
            store = SealedStore(
                dist.TCPStore(
                    host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
                ),
                space,
            )
            while not end.is_set():
                if store.check(registered):
                    messages.put(("registered", node, incarnation, time.time()))
                    return
                if time.monotonic() >= deadline:
                    break
                end.wait(BOOT_POLL_S)
        except Exception:  # the store went away: the run is ending, or the node's boot failed
            pass
        if not end.is_set():
            messages.put(("boot_timeout", node, incarnation, time.time()))

    thread = threading.Thread(target=wait, daemon=True, name=f"await-node{node}")
    thread.start()
    return thread


def error_report(store: SealedStore, key: str) -> str | None:
    """The traceback a worker that raised wrote at ``key``, waiting up to ``ERROR_REPORT_WAIT_S``."""
    deadline = time.monotonic() + ERROR_REPORT_WAIT_S
    while time.monotonic() < deadline:
        if store.check([key]):
            text = store.read(key, bytes.decode)
            return text if isinstance(text, str) else None
        time.sleep(0.01)
    return None


def worker_error(node: int, local_rank: int, code: int, report: str | None) -> RunError:
    """The error that stops a run when a worker raised: its cause (the traceback's last line) on the
    first line, which summary.json keeps, and the traceback below."""
    who = f"worker (node {node}, local rank {local_rank})"
    if report is None:
        return RunError(f"{who} exited with code {code} and reported no error (its report did not reach the store)")
    lines = [line for line in report.strip().splitlines() if line.strip()]
    cause = lines[-1].strip() if lines else "no traceback"
    return RunError(f"{who} raised an exception: {cause}\n{report.rstrip()}")


def silent_nodes(addresses: dict[int, list[tuple[str, int]]], timeout_s: float) -> list[int]:
    """The nodes none of whose ``addresses`` accepts a TCP connection within ``timeout_s``, all
    tried at once."""
    answered: dict[int, bool] = {}

    def probe(node: int) -> None:
        answered[node] = any(_answers(address, timeout_s) for address in addresses[node])

    threads = [threading.Thread(target=probe, args=(node,), daemon=True) for node in addresses]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 1.0)
    return sorted(node for node in addresses if not answered.get(node, False))


def registration(value: bytes) -> dict[str, Any]:
    """A worker's registration record (``keys.worker_registered``)."""
    record = json.loads(value)
    if not isinstance(record, dict):
        raise ValueError(f"not a registration record: {value[:80]!r}")
    return record


def wall_time(value: bytes) -> float:
    """A time a worker wrote (seconds since the epoch; ``ValueError`` for anything else)."""
    seconds = float(value.decode())
    if not (seconds == seconds and 0 < seconds < float("inf")):
        raise ValueError(f"not a time: {seconds}")
    return seconds


def _answers(address: tuple[str, int], timeout_s: float) -> bool:
    try:
        with socket.create_connection(address, timeout=timeout_s):
            return True
    except OSError:
        return False

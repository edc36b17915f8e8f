"""``Waiter.work``: abortable waits on gloo works (real) and on NCCL-style works.

ProcessGroupNCCL completes a work's future when the op is enqueued, not when it ran
(``ProcessGroupNCCL::collective`` marks the future complete right after the launch), so the NCCL
backend's wait watches ``is_completed()`` instead. NCCL does not run on this machine;
``EnqueuedWork`` below follows that contract (a done future, ``is_completed()`` false until the device finishes, ``wait()``
raising if the op failed), so the abort, failure and timeout paths of the polling wait are checked
here, and ``benchmarks/gpu_check.py`` checks them against the real NCCL on a GPU.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from oobleck.errors import RunError
from oobleck.runtime import keys
from oobleck.runtime.backend import GlooBackend, NcclBackend
from oobleck.runtime.sealed_store import SealedStore
from oobleck.runtime.waits import Aborted, AbortWatch, Waiter


class EnqueuedWork:
    """A work whose future is done at once and whose op finishes (or fails) when ``finish`` is called."""

    def __init__(self) -> None:
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result([torch.zeros(1)])
        self._done = threading.Event()
        self.error: Exception | None = None

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def finish(self, error: Exception | None = None) -> None:
        self.error = error
        self._done.set()

    def wait(self) -> bool:
        if self.error is not None:
            raise self.error
        return True


SPACE = keys.KeySpace("waiter tests")


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    return SealedStore(server, SPACE)


@pytest.fixture
def make_waiter(store):
    """Waiters watching the given generation; their watcher threads are ended after the test."""
    watches: list[AbortWatch] = []

    def make(generation: int, timeout_s: float = 10.0, grace_s: float = 5.0, backend=None) -> Waiter:
        watch = AbortWatch("127.0.0.1", store.port, timeout_s, SPACE)
        watch.watch(generation)
        watches.append(watch)
        return Waiter(watch, timeout_s, peer_grace_s=grace_s, backend=backend or NcclBackend())

    yield make
    for watch in watches:
        store.set(keys.abort(watch.generation), "1")
        watch.aborted.wait(5.0)


def later(seconds: float, action) -> None:
    threading.Timer(seconds, action).start()


def test_waits_until_the_enqueued_op_has_run(store, make_waiter):
    waiter = make_waiter(0)
    work = EnqueuedWork()
    later(0.3, work.finish)
    started = time.monotonic()
    waiter.work(work, "all-reducing")
    assert work.is_completed() and time.monotonic() - started >= 0.25


def test_abort_while_the_op_is_pending_wakes_the_waiter(store, make_waiter):
    waiter = make_waiter(1)
    work = EnqueuedWork()  # never finishes: a peer that is gone
    later(0.2, lambda: store.set(keys.abort(1), "1"))
    started = time.monotonic()
    with pytest.raises(Aborted):
        waiter.work(work, "receiving activations")
    assert time.monotonic() - started < 5.0  # the abort, not the 10 s timeout, ended the wait


def test_a_failed_op_waits_for_the_abort_that_follows(store, make_waiter):
    waiter = make_waiter(2)
    work = EnqueuedWork()
    later(0.1, lambda: work.finish(RuntimeError("NCCL communicator was aborted")))
    later(0.4, lambda: store.set(keys.abort(2), "1"))
    with pytest.raises(Aborted):
        waiter.work(work, "sending gradients")


def test_an_op_that_never_finishes_times_out_with_the_key_to_raise(store, make_waiter):
    """Nobody steps in: after the timeout and the grace the worker gives up, naming the key."""
    waiter = make_waiter(3, timeout_s=0.5, grace_s=0.3)
    with pytest.raises(RunError, match="cluster.collective_timeout_s=0.5"):
        waiter.work(EnqueuedWork(), "all-reducing gradients")


def test_a_timed_out_op_is_recovered_when_the_controller_aborts(store, make_waiter):
    """Past the timeout the wait is the controller's to end: it fails the ranks that did not
    answer and aborts the generation, and the waiter takes part in the recovery."""
    waiter = make_waiter(5, timeout_s=0.3, grace_s=5.0)
    later(0.8, lambda: store.set(keys.abort(5), "1"))
    with pytest.raises(Aborted):
        waiter.work(EnqueuedWork(), "all-reducing gradients")


def test_a_gloo_work_still_completes_through_its_future(store, make_waiter):
    backend = GlooBackend(dist.ProcessGroupGloo.create_default_device())
    waiter = make_waiter(4, backend=backend)
    group = backend.new_group(dist.PrefixStore("solo", store.raw), 0, 1, timeout_s=10.0)
    tensor = torch.full((4,), 3.0)
    waiter.work(group.allreduce([tensor]), "all-reducing")
    assert torch.equal(tensor, torch.full((4,), 3.0))


def test_an_abort_watch_whose_store_is_gone_ends_as_an_abort():
    """Without it the watch retried a wait that fails at once (a busy loop) until the process exited."""
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10), use_libuv=True
    )
    watch = AbortWatch("127.0.0.1", server.port, 10.0, SPACE)
    watch.watch(3)
    assert not watch.aborted.wait(0.3)
    del server
    assert watch.aborted.wait(10.0)
    watch._thread.join(10.0)
    assert not watch._thread.is_alive()

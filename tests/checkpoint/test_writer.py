"""The background writer: failures surface through the handle, and every wait is bounded."""

import threading

import pytest
import torch
from ckpthelpers import WAIT_S

from oobleck.checkpoint import AsyncCheckpointWriter, snapshot, write_shard
from oobleck.errors import CheckpointError
from oobleck.layer_state import flat_state


@pytest.mark.parametrize("async_write", [True, False])
def test_a_failed_write_is_reported_and_the_writer_carries_on(tmp_path, layers, async_write):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint dir should go")
    snap = snapshot(layers[:2])
    with AsyncCheckpointWriter(async_write=async_write, threads=2, timeout_s=WAIT_S) as writer:
        failed = writer.submit(blocker / "step-00000001", snap)
        assert failed.wait(WAIT_S) and failed.done()
        assert isinstance(failed.error, NotADirectoryError)
        with pytest.raises(
            CheckpointError, match=r"writing layer [01] to .*not-a-dir/step-00000001 failed: NotADirectoryError"
        ):
            failed.result(WAIT_S)
        assert failed.records == {}
        # the slot was released: the next checkpoint goes through
        ok = writer.submit(tmp_path / "step-00000002", snap)
        assert sorted(ok.result(WAIT_S)) == [0, 1] and ok.error is None
        assert ok.bytes == snap.nbytes and ok.snapshot_s == snap.seconds and ok.write_s > 0


class Gate:
    """``write_shard`` that waits for ``open()`` first: holds a real write in flight."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._open = threading.Event()

    def open(self) -> None:
        self._open.set()

    def __call__(self, step_dir, shard):
        self.entered.set()
        assert self._open.wait(WAIT_S), "gate never opened"
        return write_shard(step_dir, shard)


def test_the_queue_is_bounded_and_every_wait_times_out(tmp_path, layers):
    gate = Gate()
    snap = snapshot(layers[:1])
    writer = AsyncCheckpointWriter(max_pending=1, timeout_s=WAIT_S, write_shard_fn=gate)
    try:
        first = writer.submit(tmp_path / "step-00000001", snap)
        assert gate.entered.wait(WAIT_S)
        assert not first.done() and first.wait(0.01) is False and writer.pending() == 1
        with pytest.raises(CheckpointError, match=r"not finished after 0.01 s \(0 of 1 shards written\)"):
            first.result(0.01)
        with pytest.raises(CheckpointError, match="previous checkpoint writes are still in flight after 0.01 s"):
            writer.submit(tmp_path / "step-00000002", snap, timeout=0.01)
        assert writer.close(0.01) is False  # bounded even with a write stuck in flight
        with pytest.raises(CheckpointError, match="closed"):
            writer.submit(tmp_path / "step-00000003", snap)
    finally:
        gate.open()
    assert sorted(first.result(WAIT_S)) == [0]
    assert writer.close(WAIT_S) is True and writer.pending() == 0


def test_an_empty_snapshot_finishes_at_once(tmp_path):
    """A worker that writes no layer this time still gets a finished handle."""
    with AsyncCheckpointWriter(timeout_s=WAIT_S) as writer:
        handle = writer.submit(tmp_path / "step-00000001", snapshot([]))
        assert handle.result(WAIT_S) == {} and handle.bytes == 0 and writer.pending() == 0


def test_bad_writer_settings_are_named():
    with pytest.raises(CheckpointError, match="threads >= 1, max_pending >= 1 and timeout_s > 0; got 0, 1, 600"):
        AsyncCheckpointWriter(threads=0)


def test_snapshot_buffers_are_reused_only_after_their_write(tmp_path, layers):
    gate = Gate()
    writer = AsyncCheckpointWriter(max_pending=2, timeout_s=WAIT_S, write_shard_fn=gate)
    try:
        first = writer.snapshot(layers[:1])
        pointer = first.shards[0].tensor.data_ptr()
        handle = writer.submit(tmp_path / "step-00000001", first)
        assert gate.entered.wait(WAIT_S)
        second = writer.snapshot(layers[:1])  # the first's buffer is still being written: not lent again
        assert second.shards[0].tensor.data_ptr() != pointer
    finally:
        gate.open()
    handle.result(WAIT_S)
    writer.submit(tmp_path / "step-00000002", second).result(WAIT_S)
    assert writer.pool.nbytes() == 2 * first.nbytes
    third = writer.snapshot(layers[:1])  # now a finished write's buffer comes back, refilled
    assert third.shards[0].tensor.data_ptr() in {pointer, second.shards[0].tensor.data_ptr()}
    assert torch.equal(third.shards[0].tensor, flat_state(layers[0])) and writer.pool.nbytes() == first.nbytes
    assert writer.close(WAIT_S)

"""Storage faults are the checkpoint's, not the run's (issue 28, item 3), on real file systems.

A small tmpfs stands for the checkpoint disk; it fills up (ENOSPC) or is remounted read-only
(EROFS) under a writer. Checked here without a run: the probe before launch, a worker's writer
reporting what it could not write, the controller's coordinator failing a checkpoint (a shard it
could not get, a manifest it could not write) with the cause and going on. The runs themselves
are in ``test_storage_fault_runs.py``.
"""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from ckpthelpers import WAIT_S, save
from storagefaults import fill, read_only, small_filesystem

from oobleck.checkpoint import step_dir
from oobleck.checkpoint.storage import STATE_ROWS, checkpoint_bytes, probe_checkpoint_dir
from oobleck.elastic.checkpoints import CheckpointCoordinator
from oobleck.errors import ConfigError
from oobleck.layer_state import STATE_KINDS
from oobleck.models.registry import architecture
from oobleck.planning.outputs import Worker
from oobleck.runtime import keys
from oobleck.runtime.checkpointing import CheckpointWriter
from oobleck.runtime.plan_document import CheckpointPlan
from oobleck.runtime.sealed_store import SealedStore

SPACE = keys.KeySpace("storage faults")
WORKER: Worker = (0, 0)


def test_a_checkpoint_takes_the_bytes_the_probe_reserves(tmp_path, cfg, layers):
    assert STATE_ROWS == STATE_KINDS  # the torch-free estimate and the runtime's flat state agree
    model = architecture(cfg.model)
    estimate = checkpoint_bytes([model.params(i) for i in range(model.num_layers)])
    written = sum(f.stat().st_size for f in save(tmp_path, 4, layers, cfg).glob("layer-*"))
    assert 0 <= written - estimate <= 8192 * model.num_layers  # one small header per shard


def test_the_probe_refuses_a_directory_that_cannot_take_a_checkpoint(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"checkpoint.dir: checkpoints cannot be written to .*a-file/ckpt"):
        probe_checkpoint_dir(blocker / "ckpt", 1, keep=1)
    with small_filesystem(tmp_path / "tiny", 256) as disk:
        with pytest.raises(ConfigError, match=r"has 0.3 MB free, and one checkpoint of this model takes 1.0 MB"):
            probe_checkpoint_dir(disk / "ckpt", 1_000_000, keep=1)
        room = probe_checkpoint_dir(disk / "ckpt", 100_000, keep=2)  # room for 2, retention needs 3
        assert room.checkpoints() == 2 and "later checkpoints will fail" in capsys.readouterr().out
        read_only(disk, True)
        with pytest.raises(ConfigError, match="EROFS: Read-only file system"):
            probe_checkpoint_dir(disk / "ckpt", 1, keep=1)
        read_only(disk, False)


def coordinator(cfg, root, store, events) -> CheckpointCoordinator:
    cfg = cfg.copy()
    cfg.checkpoint.dir = str(root)
    return CheckpointCoordinator(
        cfg, root, store, 4, event=lambda kind, **fields: events.append((kind.value, fields)), extra={}
    )


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return SealedStore(server, SPACE)


def test_a_full_disk_fails_the_checkpoint_where_it_is_written_and_the_run_goes_on(tmp_path, cfg, layers, store, capfd):
    plan = CheckpointPlan(str(tmp_path / "disk"), 4, {layer.index: WORKER for layer in layers})
    writers = dict(plan.writers)
    events: list = []
    with small_filesystem(tmp_path / "disk", 8192) as disk:  # room for two checkpoints of 2.8 MB
        checkpoints = coordinator(cfg, disk, store, events)
        writer = CheckpointWriter("127.0.0.1", store.port, WORKER, cfg.checkpoint, SPACE)
        filler = fill(disk)
        writer.write(4, plan, {layer.index: layer for layer in layers})  # ENOSPC: reported, not raised
        assert writer.close(WAIT_S)
        checkpoints.noticed(0, 4, writers)
        assert checkpoints.poll() == [] and 4 in checkpoints.failed
        assert "could not write layer 0: OSError ENOSPC: No space left on device" in checkpoints.failed[4]
        ((kind, fields),) = events
        assert kind == "checkpoint_failed" and fields["checkpoint_step"] == 4 and fields["newest_complete"] is None
        assert "the checkpoint of step 4 failed" in capfd.readouterr().out
        # The disk has room again: the next checkpoint completes.
        filler.unlink()
        writer = CheckpointWriter("127.0.0.1", store.port, WORKER, cfg.checkpoint, SPACE)
        writer.write(8, plan, {layer.index: layer for layer in layers})
        assert writer.close(WAIT_S)
        checkpoints.noticed(0, 8, writers)
        assert checkpoints.poll() == [8] and checkpoints.latest_step() == 8
        # A manifest that does not fit: the shards are in, the commit point fails, with its cause.
        writer = CheckpointWriter("127.0.0.1", store.port, WORKER, cfg.checkpoint, SPACE)
        writer.write(12, plan, {layer.index: layer for layer in layers})
        assert writer.close(WAIT_S)
        fill(disk)
        checkpoints.noticed(0, 12, writers)
        assert checkpoints.poll() == [] and checkpoints.latest_step() == 8
        assert checkpoints.failed[12].startswith("the manifest could not be written: OSError ENOSPC")
        assert not (step_dir(disk, 12) / "manifest.json").exists()
        assert [f["checkpoint_step"] for f in checkpoints.failure_rows] == [4, 12]


def test_a_read_only_disk_fails_the_checkpoint_not_the_worker(tmp_path, cfg, layers, store):
    plan = CheckpointPlan(str(tmp_path / "disk"), 4, {layer.index: WORKER for layer in layers})
    with small_filesystem(tmp_path / "disk", 4096) as disk:
        read_only(disk, True)
        writer = CheckpointWriter("127.0.0.1", store.port, WORKER, cfg.checkpoint, SPACE)
        writer.write(4, plan, {layer.index: layer for layer in layers})  # its step dir cannot be made
        assert writer.close(WAIT_S)
        read_only(disk, False)
    report = json.loads(store.get(keys.checkpoint_shard(4, 0)))
    assert report["layer"] == 0 and report["failed"].startswith("OSError EROFS: Read-only file system")

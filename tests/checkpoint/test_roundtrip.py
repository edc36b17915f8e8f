"""Every layer of gpt3_tiny survives a checkpoint bit for bit, and a shard checks what it is loaded into."""

import json

import pytest
import torch
from ckpthelpers import WAIT_S, save

from oobleck.checkpoint import (
    AsyncCheckpointWriter,
    Manifest,
    ShardRecord,
    latest_valid,
    read_manifest,
    read_shard,
    restore_layer,
    shard_meta,
    snapshot,
    write_manifest,
)
from oobleck.errors import CheckpointError
from oobleck.layer_state import flat_state
from oobleck.models import num_layers
from oobleck.runtime.state import new_layer_state
from testing import tiny_config

STEPS = 2  # trained_layers' AdamW steps: the committed step count the checkpoint records


@pytest.mark.parametrize("async_write", [True, False])
def test_every_layer_round_trips_exactly(tmp_path, cfg, layers, async_write):
    save(tmp_path, STEPS, layers, cfg, extra={"strategy": "oobleck", "rng": [1, 2, 3]}, async_write=async_write)
    found = latest_valid(tmp_path)
    assert found is not None and found.step == STEPS and found.skipped == ()
    assert found.manifest.extra == {"strategy": "oobleck", "rng": [1, 2, 3]}
    assert found.manifest.num_layers == num_layers(cfg.model) == len(found.manifest.shards)
    for layer in layers:
        # A fresh layer from another seed: nothing it holds may survive the restore.
        fresh = new_layer_state(cfg.model, cfg.job, layer.index, seed=123, device="cpu")
        assert not torch.equal(flat_state(fresh), flat_state(layer))
        restore_layer(found.step_dir, found.manifest.record(layer.index), fresh, found.step)
        assert torch.equal(flat_state(fresh), flat_state(layer))
        for p in fresh.params:
            assert fresh.optimizer.state[p]["step"].item() == STEPS
        # the restored optimiser keeps training identically to the original one
        for a, b in zip(fresh.params, layer.params):
            a.grad = torch.ones_like(a)
            b.grad = torch.ones_like(b)
        fresh.optimizer.step()
        layer.optimizer.step()
        assert torch.equal(flat_state(fresh), flat_state(layer))
        # put the shared fixture back (the next step moved it past the checkpoint)
        restore_layer(found.step_dir, found.manifest.record(layer.index), layer, found.step)


def test_manifest_is_json_and_round_trips(tmp_path, cfg, layers):
    step_dir = save(tmp_path, STEPS, layers, cfg, extra={"plan": {"pipelines": 2}})
    data = json.loads((step_dir / "manifest.json").read_text())
    assert data["step"] == STEPS and data["fingerprint"]["model.n_layer"] == cfg.model.n_layer
    manifest = read_manifest(step_dir)
    assert Manifest.from_dict(manifest.to_dict()) == manifest
    assert manifest.total_bytes == sum(p.stat().st_size for p in step_dir.glob("layer-*.shard"))
    assert all(record.crc32 > 0 and record.file == f"layer-{record.layer:04d}.shard" for record in manifest.shards)


def test_a_shard_of_another_model_is_refused_by_name(tmp_path, cfg, layers):
    step_dir = save(tmp_path, STEPS, layers, cfg)
    manifest = read_manifest(step_dir)
    wider = tiny_config(**{"model.n_embd": 32})
    other = new_layer_state(wider.model, wider.job, 1, 0, "cpu")
    with pytest.raises(
        CheckpointError, match=r"layer-0001.shard \(layer 1\) does not fit the model: parameter '.*' has shape"
    ):
        restore_layer(step_dir, manifest.record(1), other, manifest.step)
    # a record naming the wrong layer for a file is caught too
    swapped = ShardRecord(
        layer=2, file=manifest.record(1).file, bytes=manifest.record(1).bytes, crc32=manifest.record(1).crc32
    )
    with pytest.raises(CheckpointError, match="holds layer 1, not layer 2"):
        read_shard(step_dir, swapped)


def test_manifest_needs_every_layer_once_and_its_files(tmp_path, cfg, layers):
    with AsyncCheckpointWriter(async_write=False) as writer:
        handle = writer.submit(tmp_path / "step-00000001", snapshot(layers[:3]))
        records = handle.result(WAIT_S)
    with pytest.raises(CheckpointError, match=r"missing layers \[3, 4, 5\]"):
        Manifest.build(1, {}, records.values(), num_layers=len(layers))
    extra_record = ShardRecord(layer=3, file="layer-0003.shard", bytes=10, crc32=1)
    manifest = Manifest.build(1, {}, [*records.values(), extra_record], num_layers=4)
    with pytest.raises(CheckpointError, match="shard layer-0003.shard of layer 3 is missing"):
        write_manifest(tmp_path / "step-00000001", manifest)
    with pytest.raises(CheckpointError, match="does not belong in"):
        write_manifest(tmp_path / "step-00000002", manifest, check_files=False)
    three = Manifest.build(1, {}, records.values(), num_layers=3, extra={"bad": object()})
    with pytest.raises(CheckpointError, match="not JSON-serialisable"):
        write_manifest(tmp_path / "step-00000001", three)
    assert not (tmp_path / "step-00000001" / "manifest.json").exists()


def test_snapshot_is_a_copy_taken_at_the_boundary(cfg):
    layer = new_layer_state(cfg.model, cfg.job, 0, 0, "cpu")
    snap = snapshot([layer])
    before = snap.shards[0].tensor.clone()
    with torch.no_grad():
        for p in layer.params:
            p.add_(1.0)  # training goes on after the snapshot
    assert torch.equal(snap.shards[0].tensor, before)
    assert snap.nbytes == 3 * layer.numel * 4 and snap.seconds >= 0
    assert snap.shards[0].meta == shard_meta(layer)

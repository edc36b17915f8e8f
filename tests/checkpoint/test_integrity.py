"""Corrupt and partial checkpoints are detected, named, and passed over for the previous one."""

import logging

import pytest
from ckpthelpers import save

from oobleck.checkpoint import (
    find_latest,
    latest_valid,
    list_checkpoints,
    prepare_step_dir,
    read_manifest,
    read_shard,
    verify,
)
from oobleck.checkpoint.durable import temporary_name
from oobleck.errors import CheckpointError


@pytest.fixture
def two_checkpoints(tmp_path, cfg, layers):
    """Complete checkpoints at steps 2 and 4 (same state; only the newest gets damaged)."""
    return save(tmp_path, 2, layers, cfg), save(tmp_path, 4, layers, cfg)


def flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("offset", [20, -1], ids=["header", "data"])
def test_a_flipped_byte_is_named_and_the_previous_checkpoint_used(tmp_path, two_checkpoints, offset, caplog):
    older, newer = two_checkpoints
    flip_byte(newer / "layer-0003.shard", offset)
    problems = verify(newer)
    assert len(problems) == 1 and problems[0].startswith("layer-0003.shard (layer 3) fails its checksum")
    assert verify(newer, checksums=False) == []  # sizes alone cannot see it
    with caplog.at_level(logging.WARNING, logger="oobleck.checkpoint.catalog"):
        found = latest_valid(tmp_path)
    assert found.step_dir == older and found.step == 2
    assert [s.step_dir for s in found.skipped] == [
        newer
    ] and "layer-0003.shard (layer 3) fails its checksum" in found.skipped[0].problems[0]
    assert "skipped" in caplog.text and "step-00000004" in caplog.text and "fails its checksum" in caplog.text
    with pytest.raises(CheckpointError, match=r"layer-0003.shard \(layer 3\)"):
        read_shard(newer, read_manifest(newer).record(3))


def test_missing_manifest_means_no_checkpoint(tmp_path, two_checkpoints):
    older, newer = two_checkpoints
    (newer / "manifest.json").unlink()
    search = find_latest(tmp_path)
    assert search.found.step_dir == older
    assert "manifest.json is missing: the checkpoint is incomplete" in search.skipped[0].problems[0]
    (older / "manifest.json").unlink()
    assert latest_valid(tmp_path) is None
    assert [entry.has_manifest for entry in list_checkpoints(tmp_path)] == [False, False]


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda d: (d / "layer-0005.shard").unlink(), "layer-0005.shard (layer 5) is missing"),
        (
            lambda d: (d / "layer-0000.shard").write_bytes((d / "layer-0000.shard").read_bytes()[:-7]),
            "layer-0000.shard (layer 0) is",
        ),
        (lambda d: (d / "manifest.json").write_text('{"format": 1, "step": 4'), "is not valid JSON"),
        (
            lambda d: (d / "manifest.json").write_text(
                '{"format": 1, "step": 5, "num_layers": 0, "created": 0, "fingerprint": {}, "shards": [], "extra": {}}'
            ),
            "says step 5",
        ),
    ],
    ids=["missing-shard", "truncated-shard", "torn-manifest", "wrong-step"],
)
def test_partial_or_inconsistent_checkpoints_are_named(tmp_path, two_checkpoints, damage, needle):
    older, newer = two_checkpoints
    damage(newer)
    problems = verify(newer)
    assert problems and needle in problems[0]
    assert latest_valid(tmp_path).step_dir == older


def test_nothing_valid_and_nothing_there(tmp_path):
    assert latest_valid(tmp_path / "absent") is None
    assert list_checkpoints(tmp_path) == []
    assert verify(tmp_path / "step-00000001") == [f"{tmp_path / 'step-00000001'} is not a directory"]


def test_prepare_step_dir_retracts_an_old_manifest_and_leftovers(tmp_path, two_checkpoints):
    _, newer = two_checkpoints
    leftover = newer / temporary_name("layer-0001.shard")
    leftover.write_bytes(b"half a shard")
    assert prepare_step_dir(tmp_path, 4) == newer
    assert not (newer / "manifest.json").exists() and not leftover.exists()
    assert latest_valid(tmp_path).step == 2  # until the new manifest is written


def test_parallel_verification_reports_the_same_problems_in_layer_order(two_checkpoints):
    _, newer = two_checkpoints
    flip_byte(newer / "layer-0004.shard", -1)
    (newer / "layer-0001.shard").unlink()
    expected = ["layer-0001.shard (layer 1) is missing", "layer-0004.shard (layer 4) fails its checksum"]
    for threads in (1, 3):
        problems = verify(newer, threads=threads)
        assert [p[: len(e)] for p, e in zip(problems, expected)] == expected and len(problems) == 2

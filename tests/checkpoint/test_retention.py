"""Retention keeps the newest complete checkpoints and never the wrong ones."""

import pytest
from ckpthelpers import save

from oobleck.checkpoint import list_checkpoints, prune
from oobleck.checkpoint.durable import temporary_name
from oobleck.errors import CheckpointError


def steps(root):
    return [entry.step for entry in list_checkpoints(root)]


def test_prune_keeps_the_newest_complete_and_newer_partials(tmp_path, cfg, layers):
    for step in (1, 2, 3, 5):
        save(tmp_path, step, layers, cfg)
    (tmp_path / "step-00000004").mkdir()  # abandoned: older than the newest complete (5)
    (tmp_path / "step-00000006").mkdir()  # maybe in progress: newer than the newest complete
    (tmp_path / "step-00000003" / "layer-0002.shard").unlink()  # structurally incomplete: not counted
    trash = tmp_path / temporary_name("step-00000000")  # left by a prune killed mid-way
    trash.mkdir()

    removed = prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step-00000001", "step-00000003", "step-00000004"]
    assert steps(tmp_path) == [2, 5, 6] and not trash.exists()
    assert prune(tmp_path, keep=2) == []  # idempotent
    assert [p.name for p in prune(tmp_path, keep=1)] == ["step-00000002"]
    assert steps(tmp_path) == [5, 6]


def test_prune_without_a_complete_checkpoint_removes_nothing(tmp_path):
    (tmp_path / "step-00000001").mkdir()
    assert prune(tmp_path, keep=1) == [] and steps(tmp_path) == [1]
    assert prune(tmp_path / "absent", keep=1) == []


def test_keep_must_leave_the_newest(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint.keep=0 must be >= 1"):
        prune(tmp_path, keep=0)

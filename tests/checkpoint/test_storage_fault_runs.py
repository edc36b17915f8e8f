"""Storage faults in real runs (issue 28, item 3): the checkpoint disk fills up while a run trains.

The checkpoint directory is a small tmpfs (``storagefaults``); after a few steps a filler file
takes every free byte. The checkpoints from then on fail where their shards are written, each
reported with its cause (ENOSPC) in events.csv, summary.json and one warning line, and training
goes on (Oobleck does not need them) to the same result as single-process training. A checkpoint
directory that cannot be written at all is refused before any process starts, naming the key. A
run dir that turns read-only stops the run with its cause in one line (no traceback), every
process stopped.
"""

from __future__ import annotations

import json
import time

import pandas as pd
import pytest
from storagefaults import fill, read_only, small_filesystem

from oobleck.elastic.job import launch
from oobleck.elastic.local import run_processes
from oobleck.errors import ConfigError, RunError
from testing import assert_matches_reference, tiny_config

pytestmark = pytest.mark.slow  # starts processes

STEPS = 12
FILL_AFTER = 4  # the disk is full (or read-only) from the commit of this step on


def _wait_gone(run_id: str, timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while run_processes(run_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    return run_processes(run_id)


def test_a_full_checkpoint_disk_fails_checkpoints_and_the_run_goes_on(tmp_path, capfd):
    run_dir = tmp_path / "run"
    with small_filesystem(tmp_path / "disk", 8192) as disk:  # room for two checkpoints of gpt3_tiny
        cfg = tiny_config(
            **{
                "cluster.nodes": 2,
                "job.steps": STEPS,
                "checkpoint.every_steps": 3,
                "checkpoint.dir": str(disk / "ckpt"),
            }
        )

        def fill_midway(controller) -> None:
            def on_step(row) -> None:
                if row["step"] == FILL_AFTER:
                    fill(disk)

            controller.on_step = on_step

        outcome, summary = launch(cfg, run_dir, on_start=fill_midway)
    assert outcome.stopped is None and summary["steps"] == STEPS
    assert outcome.checkpoint_failures, "a checkpoint written to a full disk failed"
    assert all("ENOSPC" in f["cause"] for f in outcome.checkpoint_failures), outcome.checkpoint_failures
    written = json.loads((run_dir / "summary.json").read_text())
    assert written["checkpoints_failed"] == len(outcome.checkpoint_failures)
    assert all("No space left on device" in line for line in written["checkpoint_failures"])
    events = pd.read_csv(run_dir / "events.csv")
    failed = events[events["kind"] == "checkpoint_failed"]
    assert len(failed) == len(outcome.checkpoint_failures)
    assert not events["kind"].isin(["failure", "checkpoint_abandoned"]).any()  # no node was taken for dead
    out = capfd.readouterr().out
    assert out.count("oobleck: warning: the checkpoint of step") == len(failed)
    assert_matches_reference(cfg, outcome, run_dir)


def test_an_unwritable_checkpoint_dir_is_refused_before_any_process_starts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cfg = tiny_config(**{"checkpoint.every_steps": 2, "checkpoint.dir": str(blocker / "ckpt")})
    started = []
    with pytest.raises(ConfigError, match=r"checkpoint.dir: checkpoints cannot be written to .*a-file/ckpt"):
        launch(cfg, tmp_path / "run", on_start=started.append)
    assert started == []  # refused before the controller (and any node) started


def test_a_run_dir_that_turns_read_only_stops_the_run_with_its_cause(tmp_path, capfd):
    with small_filesystem(tmp_path / "disk", 65536) as disk:
        run_dir = disk / "run"
        cfg = tiny_config(**{"cluster.nodes": 2, "job.steps": STEPS})
        run_ids = []

        def read_only_midway(controller) -> None:
            run_ids.append(controller.run_id)

            def on_step(row) -> None:
                if row["step"] == FILL_AFTER:
                    read_only(disk, True)

            controller.on_step = on_step

        try:
            with pytest.raises(RunError, match="operating-system error: OSError EROFS: Read-only file system"):
                launch(cfg, run_dir, on_start=read_only_midway)
        finally:
            read_only(disk, False)
    captured = capfd.readouterr()
    assert "Traceback" not in captured.out + captured.err, captured.err[-3000:]
    assert "summary.json could not be written (OSError EROFS" in captured.err
    assert not _wait_gone(run_ids[0])  # every node and worker stopped


def test_varuna_restarts_from_the_newest_checkpoint_that_completed_and_says_so(tmp_path, capfd):
    """Varuna needs a checkpoint to restart: after the disk filled, the checkpoints after it fail,
    and the restart at the failure uses the newest one that completed, with a note saying which
    checkpoint it was to restart from and why it could not."""
    run_dir = tmp_path / "run"
    with small_filesystem(tmp_path / "disk", 8192) as disk:
        cfg = tiny_config(
            "strategy=varuna",
            **{
                "cluster.nodes": 3,
                "job.steps": STEPS,
                "checkpoint.every_steps": 3,
                "checkpoint.dir": str(disk / "ckpt"),
                "failures.kind": "explicit",
                "failures.events": [{"action": "remove", "step": 10, "nodes": [2]}],
            },
        )

        def fill_midway(controller) -> None:
            def on_step(row) -> None:
                if row["step"] == FILL_AFTER:
                    fill(disk)

            controller.on_step = on_step

        outcome, _ = launch(cfg, run_dir, on_start=fill_midway)
    assert outcome.stopped is None
    failed = sorted(int(f["checkpoint_step"]) for f in outcome.checkpoint_failures)
    assert failed and all(step > FILL_AFTER - 3 for step in failed), outcome.checkpoint_failures
    (recovery,) = outcome.recoveries
    completed = max(int(c["checkpoint_step"]) for c in outcome.checkpoints if int(c["checkpoint_step"]) <= 10)
    assert recovery["kind"] == "restart" and completed < max(b for b in failed if b <= 10)
    assert "failed" in recovery.get("note", ""), recovery
    assert "ENOSPC" in recovery["note"]
    assert f"oobleck: warning: {recovery['note']}" in capfd.readouterr().out
    assert_matches_reference(cfg, outcome, run_dir)

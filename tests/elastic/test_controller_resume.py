"""Stopping a run and resuming it from its checkpoints is exact (issue 11).

A real run of ``python -m oobleck.run`` checkpoints every 5 steps; its main process (the
controller) is SIGKILLed mid-run; the agents notice and stop their workers. The same command with
``job.resume=auto`` then continues from the newest valid checkpoint (the newest one is corrupted
first, so the previous one is used, and the run says so), and over the union of both runs'
committed steps the losses and the final parameters equal uninterrupted single-process training.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pandas as pd
import pytest
import torch

from oobleck.checkpoint import list_checkpoints, read_manifest
from oobleck.config import compose_config
from oobleck.elastic.local import run_processes
from testing import cached_reference

pytestmark = pytest.mark.slow  # starts processes

REPO = Path(__file__).resolve().parents[2]
STEPS = 40
OVERRIDES = (
    f"job.steps={STEPS}",
    "checkpoint.every_steps=5",
    "failures=none",
    "logger.wandb.mode=disabled",
    "logger.progress_bar=false",
    "runtime.save_final_params=true",
    "cluster.nodes=3",
)


def _command(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "oobleck.run", f"hydra.run.dir={run_dir}", *OVERRIDES, *extra]


def _env(run_id: str) -> dict[str, str]:
    return dict(os.environ, OOBLECK_RUN_ID=run_id, WANDB_SILENT="true")


def _rows(run_dir: Path) -> int:
    try:
        return len(pd.read_csv(run_dir / "metrics.csv"))
    except (OSError, pd.errors.EmptyDataError):
        return 0


def _wait_gone(run_id: str, timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while run_processes(run_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    return run_processes(run_id)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("resume") / "run"
    run_id = uuid.uuid4().hex[:12]
    first = subprocess.Popen(
        _command(run_dir), cwd=REPO, env=_env(run_id), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 240
    while _rows(run_dir) < 18 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, "the first run ended before it could be interrupted"
    first.send_signal(signal.SIGKILL)  # the controller dies mid-step: no summary, no goodbye
    first.wait(timeout=30)
    strays = _wait_gone(run_id)
    committed = pd.read_csv(run_dir / "metrics.csv")
    return run_dir, committed, strays


def test_killing_the_controller_leaves_no_process_behind(interrupted):
    _, committed, strays = interrupted
    assert strays == [], "agents stop their workers when the controller is gone"
    assert len(committed) >= 18 and not (committed["step"].diff().dropna() != 1).any()


@pytest.fixture(scope="module")
def resumed(interrupted):
    run_dir, committed, _ = interrupted
    checkpoints = [
        entry for entry in list_checkpoints(run_dir / "checkpoints") if (entry.path / "manifest.json").exists()
    ]
    newest = checkpoints[-1]
    shard = newest.path / read_manifest(newest.path).shards[0].file
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # a torn or corrupted write the checksums must catch
    shard.write_bytes(bytes(data))
    run_id = uuid.uuid4().hex[:12]
    done = subprocess.run(
        _command(run_dir, "job.resume=auto"), cwd=REPO, env=_env(run_id), capture_output=True, text=True, timeout=600
    )
    return run_dir, committed, newest.step, done, _wait_gone(run_id)


def test_resume_uses_the_newest_valid_checkpoint_and_says_why(resumed):
    run_dir, committed, corrupted_step, done, strays = resumed
    assert done.returncode == 0, done.stderr[-3000:]
    assert strays == []
    events = pd.read_csv(run_dir / "events.csv")
    resume = events[events["kind"] == "resume"].iloc[-1]
    assert resume["resume_step"] == corrupted_step - 5
    assert str(corrupted_step).zfill(8) in resume["skipped"] and "checksum" in resume["skipped"].lower()
    assert "skipped" in done.stdout


def test_the_union_of_both_runs_is_exact(resumed):
    run_dir, committed, _, done, _ = resumed
    cfg = compose_config(*OVERRIDES)
    reference = cached_reference(cfg)
    metrics = pd.read_csv(run_dir / "metrics.csv")
    final = metrics.groupby("step").last()  # a step redone after the resume is committed again
    assert list(final.index) == list(range(STEPS))
    for step, expected in enumerate(reference.losses):
        assert final.loc[step, "loss"] == pytest.approx(expected, rel=1e-5), step
    params = torch.load(run_dir / "final_params.pt", weights_only=True)
    worst = max(
        float((params[str(layer)][name] - value).abs().max())
        for layer, state in reference.layers.items()
        for name, value in state.items()
    )
    assert worst <= 1e-5
    # summary.json covers the whole run: both attempts, the killed one's end said as such.
    summary = json.loads((run_dir / "summary.json").read_text())
    resume_step = int(pd.read_csv(run_dir / "events.csv").query("kind == 'resume'")["resume_step"].iloc[-1])
    assert summary["first_step"] == 0 and summary["steps"] == STEPS
    first, second = summary["attempts"]
    assert first["first_step"] == 0 and first["ended"] == "ended without a stop event (killed?)"
    assert second["resume_step"] == second["first_step"] == resume_step and second["ended"] == "finished"


def test_resuming_a_different_setup_is_one_clear_message(resumed):
    run_dir = resumed[0]
    done = subprocess.run(
        _command(run_dir, "job.resume=auto", "job.global_batch_size=16"),
        cwd=REPO,
        env=_env(uuid.uuid4().hex[:12]),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "job.global_batch_size=32 in the checkpoint, 16 now" in done.stderr and "Traceback" not in done.stderr

"""Inputs of the analysis tests: one real Hydra sweep of two short runs (3 and 4 local nodes, one
node killed at step 4, wandb offline) and a hand-written Varuna-style run under the same
failure schedule (tests/analysis/rundirs.py); both are shared by the whole package."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from oobleck.elastic.local import run_processes
from oobleck.metrics.offline import private_wandb_dirs

REPO = Path(__file__).resolve().parents[2]
FAILURE = "failures.events=[{action:remove,step:4,count:1}]"


@pytest.fixture(autouse=True)
def _wandb_dirs(tmp_path_factory, monkeypatch):
    for name, value in private_wandb_dirs(tmp_path_factory.mktemp("wandb-home")).items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="session")
def sweep(tmp_path_factory) -> Path:
    """``multirun/`` of ``python -m oobleck.run -m cluster.nodes=3,4`` (jobs 0 and 1, 10 steps each)."""
    root = tmp_path_factory.mktemp("sweep") / "multirun"
    run_id = uuid.uuid4().hex[:12]
    env = {
        **os.environ,
        **private_wandb_dirs(root.parent / "wandb-home"),
        "OOBLECK_RUN_ID": run_id,
        "WANDB_SILENT": "true",
    }
    command = [
        sys.executable,
        "-m",
        "oobleck.run",
        "-m",
        f"hydra.sweep.dir={root / 'sweep'}",
        "cluster.nodes=3,4",
        "job.steps=10",
        "failures=explicit",
        FAILURE,
        "logger.progress_bar=false",
        "logger.wandb.mode=offline",
    ]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert run_processes(run_id) == []
    return root


@pytest.fixture(scope="session")
def restart_run(tmp_path_factory) -> Path:
    from rundirs import write_restart_run

    return write_restart_run(tmp_path_factory.mktemp("varuna") / "varuna", nodes=4, steps=10, fail_step=4)

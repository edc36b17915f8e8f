"""``python -m oobleck.run`` end to end in a subprocess: the README's main job and its errors.

Every run is tagged with OOBLECK_RUN_ID so the test can scan /proc for any agent or worker it
left behind (there must be none, whatever happened).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import pandas as pd
import pytest

from oobleck.elastic.local import run_processes
from testing.readme import readme_commands

pytestmark = pytest.mark.slow  # starts processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(tmp_path, *overrides, timeout=300):
    run_id = uuid.uuid4().hex[:12]
    env = dict(os.environ, OOBLECK_RUN_ID=run_id, WANDB_SILENT="true")
    command = [
        sys.executable,
        "-m",
        "oobleck.run",
        f"hydra.run.dir={tmp_path}",
        "logger.progress_bar=false",
        *overrides,
    ]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return result, run_processes(run_id)


def test_main_job_recovers_and_continues(tmp_path):
    """The README's main job as the Quick start gives it (``oobleck-run failures=demo``; the test
    adds only the run dir and no progress bar): 4 local nodes, gpt3_tiny, one node killed at step
    10. ``oobleck-run`` without arguments injects no failure (tests/faults/test_schedule.py)."""
    main_job = next(c for c in readme_commands() if c.program == "oobleck-run")
    assert main_job.arguments == ("failures=demo",), main_job
    result, strays = run_cli(tmp_path, *main_job.arguments)
    assert result.returncode == 0, result.stderr[-3000:]
    assert strays == []
    for name in ("plan.json", "metrics.csv", "events.csv", "summary.json", ".hydra/config.yaml"):
        assert (tmp_path / name).is_file(), name
    assert list((tmp_path / "wandb").glob("offline-run-*")), "wandb logs offline by default"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["consecutive_steps"] and summary["recoveries"] == 1
    assert summary["resumed_at_steps"] == [10]
    metrics = pd.read_csv(tmp_path / "metrics.csv")
    assert list(metrics["step"]) == list(range(30))
    assert metrics.loc[metrics["step"] == 10, "attempts"].item() == 2
    assert metrics["generation"].iloc[-1] == 1
    events = pd.read_csv(tmp_path / "events.csv")
    recovery = events[events["kind"] == "reconfiguration"].iloc[0]
    for column in ("detect_s", "plan_s", "groups_s", "state_copy_s", "first_step_s", "total_s", "bytes_moved"):
        assert recovery[column] >= 0
    assert "recovery_median_total_s" in result.stdout  # the summary table


def test_cuda_without_cuda_fails_before_launch(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, so the no-CUDA error path cannot be reached")
    result, strays = run_cli(tmp_path, "cluster.device=cuda", "failures=none")
    assert result.returncode == 2
    assert "cluster.device=cuda but CUDA is not available" in result.stderr
    assert "Traceback" not in result.stderr and strays == []


def test_busy_port_is_a_clear_error(tmp_path):
    """A store port in use stops the run with one line, before it plans or starts anything."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result, strays = run_cli(tmp_path, f"cluster.master_port={port}", "failures=none")
    assert result.returncode == 2
    assert f"cluster.master_port={port}" not in result.stderr or "in use" in result.stderr
    assert "in use" in result.stderr and "Traceback" not in result.stderr.split("error:")[0]
    assert strays == []
    # Found before anything else starts: no planning, no fork server, no wandb run.
    assert "planning:" not in result.stderr and not (tmp_path / "wandb").exists(), result.stderr


def test_worker_exception_stops_with_its_traceback(tmp_path):
    result, strays = run_cli(
        tmp_path,
        "cluster.nodes=2",
        "job.steps=6",
        "failures=explicit",
        "failures.events=[{action:raise,step:2,nodes:[1],phase:backward}]",
        "logger.wandb.mode=disabled",  # the main job's test covers wandb; this one the stop
    )
    assert result.returncode == 2
    assert "worker (node 1, local rank 0) raised an exception" in result.stderr
    # The strike is armed through the store a step ahead; armed late (a loaded machine), it fires
    # at the next step instead (oobleck.faults.injector), and the run stops there.
    fired = re.search(r"InjectedFault: injected failure on node 1 at step (\d+), phase backward", result.stderr)
    assert fired, result.stderr[-3000:]
    assert strays == []
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert 2 <= summary["steps"] == int(fired.group(1)) < 6
    # The cause stays on the line summary.json keeps; the node is alive, so no node failed.
    assert summary["stopped"].startswith(
        "worker (node 1, local rank 0) raised an exception: oobleck.runtime.entry.InjectedFault: injected"
    )
    assert ",failure," not in (tmp_path / "events.csv").read_text()


def test_a_strategy_that_cannot_run_stops_before_any_process_starts(tmp_path):
    """Bamboo's redundancy needs every stage's successor on another node: depth 1 is refused with
    one line naming the key, before any agent or worker exists."""
    result, strays = run_cli(tmp_path, "strategy=bamboo", "strategy.pipeline_depth=1", "logger.wandb.mode=disabled")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "strategy.pipeline_depth=1" in result.stderr and "Traceback" not in result.stderr
    assert strays == []


def test_join_the_run_outlives_is_reported_not_hidden(tmp_path):
    """A join that starts two steps before the end cannot boot in time (an exec'd worker takes
    seconds to import torch): the run says so in events.csv and summary.json instead of silently
    dropping it."""
    # Two nodes, not the default four: the property is about the joining node, and every node
    # started is a worker importing torch on a 2-core machine. Workers are exec'd, not forked: a
    # forked worker boots in well under a second, and may then be absorbed before the end.
    result, strays = run_cli(
        tmp_path,
        "cluster.nodes=2",
        "job.steps=6",
        "failures=explicit",
        "failures.events=[{action:join,step:4,count:1}]",
        "cluster.fork_workers=false",
        "logger.wandb.mode=disabled",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert strays == []
    events = pd.read_csv(tmp_path / "events.csv")
    assert {"join_started", "join_not_absorbed"} <= set(events["kind"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["joins_not_absorbed"] == [2] and summary["steps"] == 6  # the joining node's id (nodes 0, 1 run)


def test_a_run_dir_that_cannot_be_written_is_one_line(tmp_path):
    """The run dir cannot be created (a file stands where its parent should be: this fails even
    for root, which a read-only mode would not stop): one line naming the key, exit 2, and
    nothing started. ``launch`` refuses it the same way before any process starts."""
    from oobleck.elastic.job import check_writable
    from oobleck.errors import RunError

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    result, strays = run_cli(blocker / "run", "failures=none", timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot write" in lines[0] and "hydra.run.dir=<a writable directory>" in lines[0], lines
    assert strays == []
    with pytest.raises(RunError, match="cannot write the run dir .*not-a-dir/run"):
        check_writable(blocker / "run")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_run_cleanly(tmp_path, sig, code):
    """Ctrl-C (SIGINT to the terminal's whole process group) or SIGTERM mid-training: the
    workers stop, summary.json and a ``stop`` event are written, one line says why, the exit
    code is the shell's 128 + signal, and nothing is left running. Two nodes (f+1 pipelines of
    gpt3_tiny) suffice: stopping does not depend on how many there are."""
    run_id = uuid.uuid4().hex[:12]
    env = dict(os.environ, OOBLECK_RUN_ID=run_id, WANDB_SILENT="true")
    command = [
        sys.executable,
        "-m",
        "oobleck.run",
        f"hydra.run.dir={tmp_path}",
        "logger.progress_bar=false",
        "failures=none",
        "cluster.nodes=2",
        "job.steps=100000",
        # Ctrl-C reaches the terminal's whole process group, wandb's service too: that case keeps
        # wandb's default (offline); a SIGTERM reaches only the launcher.
        *(["logger.wandb.mode=disabled"] if sig == signal.SIGTERM else []),
    ]
    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        metrics = tmp_path / "metrics.csv"
        while time.monotonic() < deadline and process.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) > 3:  # a few steps committed
                break
            time.sleep(0.2)
        assert process.poll() is None, process.communicate()[1][-3000:]
        os.killpg(process.pid, sig) if sig == signal.SIGINT else process.send_signal(sig)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == code, err[-3000:]
    assert "Traceback" not in err and "c10d" not in err, err[-3000:]
    name = signal.Signals(sig).name
    reason = f"{'interrupted' if sig == signal.SIGINT else 'terminated'} ({name})"
    stopped = [line for line in err.splitlines() if line.startswith("oobleck.run: stopped:")]
    assert len(stopped) == 1 and reason in stopped[0], err[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] >= 3 and summary["consecutive_steps"]
    events = pd.read_csv(tmp_path / "events.csv")
    assert name in events[events["kind"] == "stop"]["reason"].item()
    assert run_processes(run_id) == []

"""Out-of-sample validation on real runs: the runtime overhead is measured on two calibration runs
(3 local nodes with one killed at step 4; 3 nodes, batch 8, no failure) and predicts a different
run (4 nodes, one killed at step 7: other node count, other layouts, other failure step)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from analysis.validation import validation_table
from oobleck.elastic.local import run_processes
from oobleck.errors import RunError
from oobleck.sim.validate import calibrate_runs

REPO = Path(__file__).resolve().parents[2]

# Generous bands, not the 15% / 50%: the 2 cores are shared with other jobs whose load
# changes between the two runs, and the runtime's step time has been seen to change up to 3x
# with it (analysis/README.md). Each band is still tight enough to fail the planner's model
# (2-5x off in throughput here, 2 s of reconfiguration against a measured 0.1-0.6 s).
THROUGHPUT_BAND = (0.5, 2.0)
RECOVERY_BAND = (0.25, 4.0)


def _run(run_dir: Path, nodes: int, steps: int, failure_step: int | None, *extra: str) -> Path:
    run_id = uuid.uuid4().hex[:12]
    env = dict(os.environ, OOBLECK_RUN_ID=run_id, WANDB_SILENT="true")
    command = [
        sys.executable, "-m", "oobleck.run", f"hydra.run.dir={run_dir}", "logger.progress_bar=false",
        "logger.wandb.mode=disabled", f"cluster.nodes={nodes}", f"job.steps={steps}", *extra,
        "failures=none" if failure_step is None else f"failures.events=[{{action:remove,step:{failure_step},count:1}}]",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert run_processes(run_id) == []
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[Path], Path]:
    """Calibration runs (one with a failure, one with a small batch to separate the per-step from
    the per-microbatch term) and the run to predict."""
    base = tmp_path_factory.mktemp("validation")
    calibration = [_run(base / "calibration", 3, 10, 4), _run(base / "small_batch", 3, 10, None, "job.global_batch_size=8")]
    return calibration, _run(base / "failure", 4, 12, 7)


def test_calibrated_on_one_run_predicts_another(runs):
    calibration, failure = runs
    runtime = calibrate_runs(calibration)
    # Every term is measured (positive) and smaller than a whole measured step or recovery.
    assert runtime.per_microbatch_s + runtime.per_step_s > 0 and runtime.cores == (os.cpu_count() or 1)
    assert 0 < runtime.reconfigure_fixed_s < 5.0 and runtime.warmup_s >= 0
    table = validation_table(calibration, [failure]).set_index("metric")
    assert set(table.index) == {"steady_iteration_s", "later_iteration_s", "throughput", "recovery_s"}
    assert all(math.isfinite(v) and v > 0 for v in table["measured"]) and all(table["simulated"] > 0)
    low, high = THROUGHPUT_BAND
    assert low <= table.loc["throughput", "ratio"] <= high, table
    low, high = RECOVERY_BAND
    assert low <= table.loc["recovery_s", "ratio"] <= high, table
    # The calibration never looks at the predicted run.
    assert set(table["calibration"]) == {", ".join(map(str, calibration))}
    with pytest.raises(RunError, match="also a calibration run"):
        validation_table(calibration, [calibration[0]])


def test_the_planner_model_alone_misses_the_recovery(runs):
    from oobleck.sim.validate import validate_run

    table = validate_run(runs[1]).table
    planner = table[table["model"] == "planner"].set_index("metric")
    # 2 s of fixed reconfiguration (the artifact's GPU figure) against well under 1 s measured.
    assert planner.loc["recovery_s", "ratio"] > RECOVERY_BAND[1]


def test_a_calibration_run_needs_a_failure(tmp_path, runs):
    import shutil

    import pandas as pd

    run = tmp_path / "no_failure"
    shutil.copytree(runs[0][0], run)
    events = pd.read_csv(run / "events.csv")
    events[~events["kind"].isin(["reconfiguration"])].to_csv(run / "events.csv", index=False)
    with pytest.raises(RunError, match="no reconfiguration"):
        calibrate_runs([run, runs[0][1]])

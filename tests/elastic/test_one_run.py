"""A run stopped for a requeue and resumed is one run (issue 28, item 1).

A real 3-node run (f=1) with a node removed at step 3 is stopped the way Slurm's warning signal
stops it (``request_checkpoint_stop``: checkpoint the next boundary, stop with the requeue exit
code), then resumed in its own run dir with ``job.resume=auto``. The resumed attempt must not
replay the removal of step 3 (it once fired again at the resume step), its ``time_s`` continues
after the first attempt's, and summary.json covers the whole run: every step committed once,
the first attempt's recovery, and both attempts' boundaries. Over the union of both attempts the
losses and the final parameters equal single-process training.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from oobleck.elastic.job import launch
from oobleck.errors import EXIT_REQUEUE, Stopped
from testing import assert_matches_reference, tiny_config

pytestmark = pytest.mark.slow  # starts processes

STEPS = 14
STOP_AFTER = 6  # the stop is asked for once this step committed; the checkpoint after it follows
REMOVED_AT = 3


def test_a_requeued_run_resumes_as_one_run(tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_config(
        **{
            "cluster.nodes": 3,
            "job.fault_tolerance": 1,
            "job.steps": STEPS,
            "checkpoint.every_steps": 5,
            "failures.kind": "explicit",
            "failures.events": [{"action": "remove", "step": REMOVED_AT, "nodes": [1]}],
        }
    )

    def stop_for_requeue(controller) -> None:
        def on_step(row) -> None:
            if row["step"] == STOP_AFTER:
                controller.request_checkpoint_stop("the job's time limit is near")

        controller.on_step = on_step

    with pytest.raises(Stopped) as stopped:
        launch(cfg, run_dir, on_start=stop_for_requeue)
    assert stopped.value.exit_code == EXIT_REQUEUE
    first = json.loads((run_dir / "summary.json").read_text())
    assert first["recoveries"] == 1
    first_events = pd.read_csv(run_dir / "events.csv")
    first_end = float(first_events["time_s"].max())

    resumed_cfg = cfg.copy()
    resumed_cfg.job.resume = "auto"
    outcome, summary = launch(resumed_cfg, run_dir)

    events = pd.read_csv(run_dir / "events.csv")
    later = events[events["attempt"] == 1]
    assert not later.empty and set(events["attempt"]) == {0, 1}
    assert not later["kind"].isin(["fault_armed", "fault_injected", "failure"]).any(), later.to_string()
    resume_row = later[later["kind"] == "resume"].iloc[0]
    assert int(resume_row["events_before"]) == 1
    assert float(later["time_s"].min()) >= first_end  # the time axis continues
    metrics = pd.read_csv(run_dir / "metrics.csv")
    for attempt in (0, 1):
        times = metrics[metrics["attempt"] == attempt]["time_s"]
        assert times.is_monotonic_increasing
    assert float(metrics[metrics["attempt"] == 1]["time_s"].min()) >= first_end

    written = json.loads((run_dir / "summary.json").read_text())
    assert written["steps"] == STEPS and written["recoveries"] == 1
    attempts = written["attempts"]
    assert [a["attempt"] for a in attempts] == [0, 1]
    resume_step = attempts[1]["resume_step"]
    assert STOP_AFTER < resume_step <= STOP_AFTER + 5
    assert attempts[0]["first_step"] == 0 and attempts[1]["first_step"] == resume_step
    assert attempts[1]["last_step"] == STEPS - 1 and attempts[1]["ended"] == "finished"
    assert attempts[1]["started_time_s"] >= first_end
    assert_matches_reference(resumed_cfg, outcome, run_dir)

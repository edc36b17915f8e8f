"""The fault tolerance a run keeps, and says it lost (issue 18's end-to-end acceptance test).

6 nodes, f=2, gpt3_tiny (one node holds the model, so f+1 pipelines need only f+1 nodes). Nodes
2, 3 and 4 go at steps 10, 14 and 18, each within f: the three survivors can still host f+1
pipelines, and recovery must keep them, so the loss of two more nodes (0 and 5) at step 30 is
survived in place. That last loss leaves one pipeline: the run continues, and reports the drop
in events.csv (``fault_tolerance_reduced``), summary.json (``fault_tolerance_min``) and one line
of its output.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from oobleck.elastic.job import launch
from testing import assert_matches_reference, tiny_config

pytestmark = pytest.mark.slow  # starts processes

EVENTS = [
    {"action": "remove", "step": 10, "nodes": [2]},
    {"action": "remove", "step": 14, "nodes": [3]},
    {"action": "remove", "step": 18, "nodes": [4]},
    {"action": "remove", "step": 30, "nodes": [0, 5]},
]


def test_recovery_keeps_f_plus_one_pipelines_and_reports_the_drop(tmp_path, capsys):
    cfg = tiny_config(
        **{
            "cluster.nodes": 6,
            "job.fault_tolerance": 2,
            "job.steps": 34,
            "failures.kind": "explicit",
            "failures.events": EVENTS,
        }
    )
    run_dir = tmp_path / "run"
    outcome, summary = launch(cfg, run_dir)
    assert_matches_reference(cfg, outcome, run_dir)
    assert [sorted(r["removed"]) for r in outcome.recoveries] == [[2], [3], [4], [0, 5]]
    assert all(r["kind"] == "reconfiguration" for r in outcome.recoveries), outcome.recoveries

    # Every plan is checked when published: only plans after step 30 survive fewer than f
    # failures, so recovery kept f+1 pipelines until then. (Nodes 0 and 5 may be detected apart:
    # the plan for the first loss, superseded by the second, tolerates one and is reported too.)
    drops = outcome.fault_tolerance
    assert {d["step"] for d in drops} == {30} and drops[-1] == {"step": 30, "tolerated": 0, "wanted": 2}, drops
    assert (summary["fault_tolerance_min"], summary["fault_tolerance_wanted"]) == (0, 2)
    assert json.loads((run_dir / "summary.json").read_text())["fault_tolerance_min"] == 0
    events = pd.read_csv(run_dir / "events.csv")
    reported = events[events["kind"] == "fault_tolerance_reduced"]
    assert list(zip(reported["tolerated"], reported["wanted"])) == [(d["tolerated"], 2) for d in drops]
    lines = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("oobleck: warning: the plan now survives")
    ]
    assert lines == [
        f"oobleck: warning: the plan now survives only {d['tolerated']} simultaneous node failure(s), not job.fault_tolerance=2"
        for d in drops
    ]

"""A node trace replayed on a real local cluster (issue 5): a removal, then two joins, ends with
more nodes than it started with and is still exact: losses and final parameters equal
single-process training.

Long churn (>= 25 generation changes of joins and every kind of failure, consecutive steps,
flat resources of a survivor and of the controller, exactness) is ``tests/faults/test_chaos.py``.
"""

from __future__ import annotations

import pytest

from oobleck.elastic.job import launch
from testing import assert_matches_reference, tiny_config

pytestmark = pytest.mark.slow  # starts processes


def test_removal_then_joins_end_bigger_and_exact(tmp_path):
    trace = tmp_path / "grow.csv"
    trace.write_text("0,add,a\n0,add,b\n0,add,c\n1000,remove,b\n2000,add,d\n2000,add,e\n")
    cfg = tiny_config(
        **{
            "cluster.nodes": 3,
            "job.fault_tolerance": 1,
            # Every event is due at the start: at load 3-4 both joins were absorbed at step 5,
            # so 40 steps leave room for boots several times slower, and exact steps after them.
            "job.steps": 40,
            "failures.kind": "trace",
            "failures.trace": str(trace),
            "failures.seconds_per_trace_hour": 0.5,
        }
    )
    outcome, _ = launch(cfg, tmp_path / "run")
    assert [r["removed"] for r in outcome.recoveries] == [[1], []]
    assert [r["joined"] for r in outcome.recoveries] == [[], [3, 4]]
    assert outcome.steps[-1]["nodes"] == 4
    assert_matches_reference(cfg, outcome, tmp_path / "run", loss_rtol=1e-4, param_atol=1e-4)

"""A ReCycle-style re-routed plan, run for real: exact, and every sample processed once per step.

Plans are built by hand (no strategy decides a re-route yet): a pipeline whose node of stage s is
gone keeps a template with a gap there, and each of its microbatches runs stage s on the same
stage of a peer pipeline (``Reroute``), with the backward split into input and weight passes
(``oobleck.schedules.recycle``). The real cluster (controller, agents, gloo workers) trains a few
steps; losses and final parameters must equal single-process training on the same batches, and
the work ledger (``runtime.record_work``: every rank's compute ops of every committed step) must
show each row of each layer of each microbatch forwarded once and backwarded once (input and
weight passes) per step.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest

from oobleck.elastic.job import launch
from oobleck.planning.outputs import Reroute
from testing import assert_matches_reference, cached_reference, hand_plan, template, tiny_config

pytestmark = pytest.mark.slow  # starts processes


@pytest.fixture(scope="module")
def reference():
    return cached_reference(tiny_config())


def _last_stage_lost():
    """Three 2-stage pipelines; pipeline 0 lost its last stage (layers 3-5, where the loss is):
    its microbatches finish on pipelines 1 and 2 in turn."""
    full = template([(0, 3, 0, 0, 1), (3, 6, 1, 0, 1)])
    plan = hand_plan(
        [(template([(0, 3, 0, 0, 1)]), (0,), 4), (full, (1, 2), 2), (full, (3, 4), 2)],
        batch=16,
        micro=2,
        layers=6,
        f=0,
        gpus=1,
    )
    return replace(plan, reroutes=(Reroute(0, 3, 6, (1, 2, 1, 2)),))


def _middle_stage_lost():
    """Two 3-stage pipelines; pipeline 1 lost its middle stage (layers 2-3): its microbatches go
    through pipeline 0's middle stage and come back."""
    full = template([(0, 2, 0, 0, 1), (2, 4, 1, 0, 1), (4, 6, 2, 0, 1)])
    gap = template([(0, 2, 0, 0, 1), (4, 6, 1, 0, 1)])
    plan = hand_plan([(full, (0, 1, 2), 3), (gap, (3, 4), 5)], batch=16, micro=2, layers=6, f=0, gpus=1)
    return replace(plan, reroutes=(Reroute(1, 2, 4, (0,) * 5),))


@pytest.mark.parametrize("make_plan", [_last_stage_lost, _middle_stage_lost], ids=["last-stage", "middle-stage"])
def test_rerouted_plan_equals_single_process_training(run_dir, reference, make_plan):
    plan = make_plan()
    cfg = tiny_config(**{"cluster.nodes": len(plan.nodes), "job.fault_tolerance": 0, "runtime.record_work": True})
    outcome, _ = launch(cfg, run_dir, initial_plan=plan)
    assert_matches_reference(cfg, outcome, run_dir, reference)
    ledger = json.loads((run_dir / "work.json").read_text())
    assert sorted(map(int, ledger)) == list(range(int(cfg.job.steps)))
    rerouted = {(r.pipeline, r.start): r for r in plan.reroutes}
    for step, record in ledger.items():
        done: Counter = Counter()
        for rank, entry in record["ranks"].items():
            assignment = plan.assignments()[int(rank)]
            for kind, mb, start, end, lo, hi in entry["ops"]:
                for layer in range(start, end):
                    for row in range(lo, hi):
                        done[(kind, mb, layer, row)] += 1
                owner = next(
                    p for p in plan.pipelines if p.first_microbatch <= mb < p.first_microbatch + p.microbatches
                )
                if owner.index != assignment.pipeline:  # a detour: the peer runs exactly the lost layers
                    reroute = rerouted[(owner.index, start)]
                    assert reroute.via[mb - owner.first_microbatch] == assignment.pipeline and end == reroute.end
        for mb in range(plan.num_microbatches):
            for layer in range(plan.num_layers):
                for row in range(plan.microbatch_size):
                    assert done[("F", mb, layer, row)] == 1, (step, mb, layer, row)
                    assert done[("I", mb, layer, row)] == done[("W", mb, layer, row)] == 1, (step, mb, layer, row)
        assert sum(done.values()) == 3 * plan.num_microbatches * plan.num_layers * plan.microbatch_size


def test_an_inconsistent_reroute_is_refused_before_any_process_starts(run_dir):
    from oobleck.errors import PlanningError

    plan = _middle_stage_lost()
    cfg = tiny_config(**{"cluster.nodes": len(plan.nodes), "job.fault_tolerance": 0})
    wrong_peer = replace(plan, reroutes=(Reroute(1, 2, 4, (1,) * 5),))
    with pytest.raises(PlanningError, match=r"pipeline 1 has no stage of exactly those layers to run them"):
        launch(cfg, run_dir, initial_plan=wrong_peer)
    no_reroute = replace(plan, reroutes=())
    with pytest.raises(PlanningError, match=r"pipeline 1 has no stage for layers \[2, 4\) and no re-route of them"):
        launch(cfg, run_dir, initial_plan=no_reroute)
    assert not (run_dir / "metrics.csv").exists()

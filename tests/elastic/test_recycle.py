"""strategy=recycle for real: re-routes after SIGKILLs, a join restoring the layout, the fall-back.

Two pipelines of depth 3 on 6 nodes (D=2 x P=3). Node 1 (stage 1 of pipeline 0) is killed in the
backward pass of step 2: its microbatches run stage 1 on pipeline 1 (a re-route, nothing copied).
A node joins at step 3 and takes stage 1 back (its layers copied from pipeline 1's stage 1: a
reconfiguration; the re-route is dropped). Node 3 (stage 0 of pipeline 1) is killed at step 12:
re-routed through pipeline 0's stage 0. Losses and final parameters must equal single-process
training, and the work ledger must show every row of every layer of every microbatch forwarded
and backwarded (input and weight passes) exactly once per committed step. A second run loses
both copies of stage 1 at once and falls back to the last checkpoint.
"""

from __future__ import annotations

import json
from collections import Counter

import pandas as pd
import pytest

from oobleck.elastic.job import launch
from oobleck.errors import ConfigError, RunError
from oobleck.runtime.plan_document import PlanDocument
from testing import assert_matches_reference, tiny_config

pytestmark = pytest.mark.slow  # starts processes


def _config(events, steps: int = 6, **extra):
    return tiny_config(
        "strategy=recycle",
        **{
            "cluster.nodes": 6,
            "job.steps": steps,
            "job.fault_tolerance": 0,
            "strategy.pipeline_depth": 3,
            "runtime.record_work": True,
            "failures.kind": "explicit",
            "failures.events": events,
            **extra,
        },
    )


def _each_microbatch_once(cfg, run_dir) -> None:
    ledger = json.loads((run_dir / "work.json").read_text())
    assert sorted(map(int, ledger)) == list(range(int(cfg.job.steps)))
    microbatches = int(cfg.job.global_batch_size) // int(cfg.job.microbatch_size)
    for step, record in ledger.items():
        done: Counter = Counter()
        for entry in record["ranks"].values():
            for kind, mb, start, end, lo, hi in entry["ops"]:
                for layer in range(start, end):
                    for row in range(lo, hi):
                        done[(kind, mb, layer, row)] += 1
        layers = {layer for _, _, layer, _ in done}
        assert layers == set(range(len(layers))) and len(layers) > 1
        expected = {
            (kind, mb, layer, row): 1
            for kind in ("F", "B")
            for mb in range(microbatches)
            for layer in layers
            for row in range(int(cfg.job.microbatch_size))
        }
        # A re-routed step splits each backward into input (I) and weight (W) passes; each counts once.
        merged = Counter()
        for (kind, mb, layer, row), count in done.items():
            if kind == "W" or kind == "B":
                merged[("B", mb, layer, row)] += count
            elif kind == "F":
                merged[(kind, mb, layer, row)] += count
            else:
                assert kind == "I" and count == 1 and done[("W", mb, layer, row)] == 1, (step, kind, mb, layer, row)
        assert merged == expected, f"step {step}: some row was not processed exactly once"


def test_reroutes_and_a_join_equal_single_process_training(tmp_path):
    events = [
        {"action": "remove", "step": 2, "nodes": [1], "phase": "backward"},
        {"action": "join", "step": 3, "count": 1},
        # Late enough for the joined node's worker to be up (it takes seconds to start; steps here
        # take a fraction of one) and its reconfiguration absorbed.
        {"action": "remove", "step": 12, "nodes": [3], "phase": "forward"},
    ]
    cfg = _config(events, steps=14)
    run_dir = tmp_path / "run"
    controllers = []
    outcome, _ = launch(cfg, run_dir, on_start=controllers.append)
    assert_matches_reference(cfg, outcome, run_dir)
    _each_microbatch_once(cfg, run_dir)
    kinds = [(r["kind"], r["removed"], r["joined"], r["bytes_moved"] > 0) for r in outcome.recoveries]
    assert kinds == [
        ("reroute", [1], [], False),
        ("reconfiguration", [], [6], True),
        ("reroute", [3], [], False),
    ]
    published = controllers[0].executor.documents
    # What the workers read: every generation's document, through its JSON.
    documents = [PlanDocument.from_json(published[g].to_json()) for g in sorted(published)]
    assert [d.decision for d in documents] == ["start", "reroute", "reconfigure", "reroute"]
    assert [len(d.plan.reroutes) for d in documents] == [0, 1, 0, 1]
    assert outcome.steps[-1]["pipelines"] == 2


def test_losing_every_copy_of_a_stage_falls_back_to_the_checkpoint(tmp_path):
    cfg = _config(
        [{"action": "remove", "step": 3, "nodes": [1, 4], "phase": "forward"}],
        steps=5,
        **{"checkpoint.every_steps": 2},
    )
    run_dir = tmp_path / "run"
    outcome, _ = launch(cfg, run_dir)
    assert_matches_reference(cfg, outcome, run_dir)
    (restart,) = outcome.recoveries
    assert restart["kind"] == "restart" and sorted(restart["removed"]) == [1, 4]
    # From the newest checkpoint complete when it restarted: step 2's, unless the lost nodes took
    # their shards of it with them before writing them (a loaded machine), when step 0 is.
    events = pd.read_csv(run_dir / "events.csv")
    before = events.loc[: events.index[events["kind"] == "restart"][0]]
    durable = before.loc[before["kind"] == "checkpoint", "checkpoint_step"]
    assert restart["resume_step"] == (int(durable.max()) if len(durable) else 0)


def test_bad_settings_are_refused_before_any_process_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"strategy.min_pipelines=1 must be at least 2"):
        launch(tiny_config("strategy=recycle", **{"strategy.min_pipelines": 1}), tmp_path / "a")
    with pytest.raises(RunError, match=r"strategy.pipeline_depth=4 needs .* at least strategy.min_pipelines=2"):
        launch(tiny_config("strategy=recycle", **{"cluster.nodes": 6, "strategy.pipeline_depth": 4}), tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

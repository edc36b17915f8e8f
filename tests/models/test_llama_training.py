"""The Llama-style family trained for real: a local cluster running strategy=oobleck on llama_tiny
loses a node to SIGKILL mid-step, reconfigures in place, and ends equal to single-process training
of the same model on the same batches (tolerance justified in tests/runtime/test_exactness.py)."""

from __future__ import annotations

import pytest

from oobleck.config import load_model_config
from oobleck.elastic.job import launch
from testing import assert_matches_reference, tiny_config, two_pipelines_of_two_nodes

pytestmark = pytest.mark.slow  # starts processes


@pytest.mark.slow
def test_llama_recovers_in_place_from_a_killed_node_exactly(tmp_path):
    cfg = tiny_config(
        **{
            "cluster.nodes": 4,
            "job.fault_tolerance": 1,
            "job.steps": 6,
            "failures.kind": "explicit",
            "failures.events": [{"action": "remove", "step": 2, "nodes": [1], "phase": "backward"}],
        }
    )
    cfg.model = load_model_config("llama_tiny")
    assert cfg.strategy.name == "oobleck"
    run_dir = tmp_path / "run"
    # Layers 0-2 on nodes 0 and 2, layers 3-5 on nodes 1 and 3: losing node 1 leaves layers 3-5 one
    # replica, whose state (parameters and AdamW moments) the regrouped plan copies.
    outcome, summary = launch(cfg, run_dir, initial_plan=two_pipelines_of_two_nodes())
    assert_matches_reference(cfg, outcome, run_dir)
    (recovery,) = outcome.recoveries
    assert recovery["removed"] == [1] and recovery["resume_step"] == 2
    assert recovery["bytes_moved"] > 0 and recovery["replicas_identical"]
    assert summary["recoveries"] == 1 and summary["steps"] == 6

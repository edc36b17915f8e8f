"""Bamboo's eager and lazy redundancy for real: a SIGKILL, a failover, exact training.

Two pipelines of depth 2 on 4 nodes; stage 1 of pipeline 0 is killed in the backward pass of
step 3; its predecessor, which holds a copy of its layers, takes it over. Every run must equal
single-process training on the same batches. Eager runs the successor's forward before each
wait for gradients (the workers time it); lazy runs none. Inline (the redundant forward on the
critical path) is the mode of ``tests/elastic/test_strategies.py``'s Bamboo run.
"""

from __future__ import annotations

import pytest

from oobleck.elastic.job import launch
from oobleck.errors import ConfigError
from testing import assert_matches_reference, cached_reference, tiny_config

pytestmark = pytest.mark.slow  # starts processes


def _config(mode: str):
    return tiny_config(
        "strategy=bamboo",
        **{
            "cluster.nodes": 4,
            "job.steps": 8,
            "strategy.pipeline_depth": 2,
            "strategy.redundancy": mode,
            "failures.kind": "explicit",
            "failures.events": [{"action": "remove", "step": 3, "nodes": [1], "phase": "backward"}],
        },
    )


@pytest.fixture(scope="module")
def reference():
    return cached_reference(_config("lazy"))


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_failover_in_each_mode_equals_single_process_training(tmp_path, reference, mode):
    cfg = _config(mode)
    outcome, _ = launch(cfg, tmp_path / "run", initial_plan=None)
    assert_matches_reference(cfg, outcome, tmp_path / "run", reference)
    (failover,) = outcome.recoveries
    assert failover["kind"] == "failover" and failover["removed"] == [1] and failover["resume_step"] == 3
    assert outcome.steps[-1]["nodes"] == 3 and outcome.steps[-1]["pipelines"] == 2
    assert all(r["replicas_identical"] for r in outcome.recoveries)  # the copies stayed bit-identical
    redundant = [p.get("redundant_forward", 0.0) for p in outcome.phase_seconds.values()]
    assert redundant and (all(s > 0 for s in redundant) if mode == "eager" else all(s == 0 for s in redundant))


def test_a_bad_mode_is_refused_before_any_process_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"strategy.redundancy='eagre' must be one of inline, eager, lazy"):
        launch(tiny_config("strategy=bamboo", **{"strategy.redundancy": "eagre"}), tmp_path / "run")
    assert not (tmp_path / "run").exists()

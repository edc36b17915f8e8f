"""Varuna's two layout rules (strategy.layout_rule): its own AutoConfig rule (the default) and D
copies of the planner's optimal template; both exact against single-process training through real
SIGKILLs and restarts from checkpoints.

gpt3_tiny has six layers: embedding, four blocks, head. Varuna's CutPoints sit between blocks
(its GPT-2 example), so it has four partitions and P is 1 or 2. At
``cluster.device_memory_gb=0.004`` the whole model does not fit one device even for one sample
(4.9 MB by the cost model) but half of it does (3.0 MB), and two samples do not (4.0 MB): Varuna
runs 2-stage pipelines of 1-sample microbatches where the job says 2.
"""

from __future__ import annotations

import pytest

from baselines.varuna.policy import varuna_depths, varuna_partitions
from oobleck.elastic.job import launch, make_strategy
from oobleck.errors import ConfigError
from oobleck.strategy import Kind
from testing import assert_matches_reference, tiny_config

pytestmark = pytest.mark.slow  # starts processes

HALF_THE_MODEL_FITS = {"cluster.device_memory_gb": 0.004}


def test_varunas_rule_picks_a_divisor_depth_and_the_largest_microbatch_that_fits():
    varuna = make_strategy(tiny_config("strategy=varuna", **{**HALF_THE_MODEL_FITS, "cluster.nodes": 4}))
    profile = varuna.context.profile
    assert varuna_partitions(profile) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert varuna_depths(4) == [1, 2] and varuna_depths(12) == [1, 2, 3, 4, 6] and varuna_depths(1) == [1]
    layout = varuna.start(range(4)).layout
    assert layout.description == "D=2 x P=2, microbatch 1" and layout.state == (2, 2)
    plan = layout.plan
    assert plan.microbatch_size == 1 and plan.global_batch_size == 16
    assert [(s.start, s.end) for s in plan.pipelines[0].template.stages] == [(0, 3), (3, 6)]  # equal partitions
    assert [p.microbatches for p in plan.pipelines] == [8, 8]
    # With room for the whole model, P=1 and the largest microbatch that still feeds every replica.
    roomy = make_strategy(tiny_config("strategy=varuna", **{"cluster.nodes": 4}))
    assert roomy.start(range(4)).layout.description == "D=4 x P=1, microbatch 4"
    # 48 samples: 12 per replica on 4 nodes, one microbatch each. On 5, Varuna gives each replica
    # 9 (dropping 3); training all 48 in whole microbatches, 8 would leave one replica 16 samples,
    # 2 leaves the busiest 10, the fewest possible, and is the largest that does.
    batch48 = make_strategy(tiny_config("strategy=varuna", **{"cluster.nodes": 5, "job.global_batch_size": 48}))
    assert batch48.best_layout(range(4)).description == "D=4 x P=1, microbatch 12"
    five = batch48.best_layout(range(5))
    assert five.description == "D=5 x P=1" and [p.microbatches for p in five.plan.pipelines] == [5, 5, 5, 5, 4]
    # The other rule: the planner's templates with the job's microbatch.
    templates = make_strategy(
        tiny_config(
            "strategy=varuna",
            **{
                **HALF_THE_MODEL_FITS,
                "cluster.nodes": 4,
                "strategy.layout_rule": "oobleck_templates",
                # The planner's choice follows the profile's times: analytic ones are the same on
                # every host, where measured ones follow its load (a loaded CI run picked P=3).
                "profile.source": "analytic",
            },
        )
    )
    other = templates.start(range(4)).layout
    assert other.plan.microbatch_size == 2 and "microbatch" not in other.description
    # The planner's fastest at 2 samples per microbatch, by the analytic profile's times: one
    # 3-node pipeline (0.28 ms an iteration) over one of 4 nodes (0.31 ms) and two of 2 (0.60 ms).
    assert other.description == "D=1 x P=3"


def test_nothing_fitting_and_a_bad_rule_are_refused_before_launch(tmp_path):
    tight = make_strategy(tiny_config("strategy=varuna", **{"cluster.device_memory_gb": 0.0012}))
    refused = tight.start(range(4))
    assert refused.kind is Kind.STOP and refused.out_of_memory
    assert "P in [1, 2]" in refused.reason and "strategy.layout_rule=oobleck_templates" in refused.reason
    with pytest.raises(ConfigError, match=r"strategy.layout_rule=best is not one of varuna, oobleck_templates"):
        launch(tiny_config("strategy=varuna", **{"strategy.layout_rule": "best"}), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_varunas_rule_morphs_and_restarts_exactly_with_its_own_microbatch(tmp_path):
    """3 nodes: D=1 x P=2 with 1-sample microbatches, one node standing by. A node joining at step 1
    makes D=2 faster: checkpoint, restart, morph onto 4 nodes. Node 1 dies in the backward pass of
    step 30 or later: every worker restarts from the latest checkpoint on D=1 x P=2 again. The
    samples of every step are the job's, so the run equals single-process training with the job's
    microbatch. The joiner boots while the 3 nodes train: forked from a fork server that has
    imported torch, it joined at step 5 and the morph resumed at step 8 under a load average of
    11 on 2 cores; step 30 leaves it over three times that."""
    cfg = tiny_config(
        "strategy=varuna",
        **{
            **HALF_THE_MODEL_FITS,
            "cluster.nodes": 3,
            "job.steps": 36,
            "checkpoint.every_steps": 5,
            "failures.kind": "explicit",
            "failures.events": [
                {"action": "join", "step": 1, "count": 1},
                {"action": "remove", "step": 30, "nodes": [1], "phase": "backward"},
            ],
        },
    )
    outcome, _ = launch(cfg, tmp_path / "run")
    assert_matches_reference(cfg, outcome, tmp_path / "run")
    morph, restart = outcome.recoveries
    assert morph["kind"] == "restart" and morph["joined"] == [3] and morph["rolled_back_steps"] == 0
    assert "D=2 x P=2, microbatch 1" in morph["decision"]
    assert restart["kind"] == "restart" and restart["removed"] == [1] and restart["resume_step"] % 5 == 0
    assert outcome.steps[0]["nodes"] == 2 and outcome.steps[-1]["nodes"] == 2
    assert max(row["nodes"] for row in outcome.steps) == 4


def test_the_template_rule_restarts_exactly(tmp_path):
    """layout_rule=oobleck_templates on 3 nodes (D=3 x P=1, the job's microbatch); node 2 dies in
    the all-reduce of step 3: restart from the checkpoint of step 2 on the two survivors."""
    cfg = tiny_config(
        "strategy=varuna",
        **{
            "strategy.layout_rule": "oobleck_templates",
            "cluster.nodes": 3,
            "job.steps": 6,
            "checkpoint.every_steps": 2,
            "failures.kind": "explicit",
            "failures.events": [{"action": "remove", "step": 3, "nodes": [2], "phase": "allreduce"}],
        },
    )
    outcome, _ = launch(cfg, tmp_path / "run")
    assert_matches_reference(cfg, outcome, tmp_path / "run")
    (restart,) = outcome.recoveries
    assert restart["kind"] == "restart" and restart["resume_step"] == 2 and outcome.steps[-1]["nodes"] == 2

"""Real multi-process training (gloo, one process per device) equals single-process training.

Each plan runs on a real local cluster (controller, agents, workers) for a few steps; the per-step
losses and the final parameters are compared with ``train_reference`` on the same global batches.

Tolerance: the runtime sums the same fp32 gradient contributions in a different order (per-pipeline
autograd accumulation, then an all-reduce across pipelines and shards; bucketed), so gradients
differ by a few ulps (relative ~1e-7). Losses of later steps inherit the parameter differences; AdamW
normalises each update (|update| <= lr), so parameter differences stay of the order of
lr * (relative gradient error) per step. Measured on the heterogeneous plan over 20 steps: loss
relative difference 2.3e-8, parameter difference 1.6e-7; the bounds below are far above that
and far below what a real bug
does (a missing microbatch, a wrong scale, an unsynchronised replica, a skipped tied-gradient
sum moves losses by > 1e-3 and parameters by ~lr = 3e-4 at once).
"""

from __future__ import annotations

import pytest

from oobleck.elastic.job import launch
from testing import assert_matches_reference, cached_reference, hand_plan, template, tiny_config

pytestmark = pytest.mark.slow  # starts processes


@pytest.fixture(scope="module")
def reference():
    return cached_reference(tiny_config())


def test_heterogeneous_pipelines_of_two_and_three_nodes(run_dir, reference):
    cfg = tiny_config(**{"cluster.nodes": 5, "job.fault_tolerance": 1})
    plan = hand_plan(
        [
            (template([(0, 3, 0, 0, 1), (3, 6, 1, 0, 1)]), (0, 1), 3),
            (template([(0, 2, 0, 0, 1), (2, 4, 1, 0, 1), (4, 6, 2, 0, 1)]), (2, 3, 4), 5),
        ],
        batch=16,
        micro=2,
        layers=6,
        f=1,
        gpus=1,
    )
    outcome, summary = launch(cfg, run_dir, initial_plan=plan)
    assert_matches_reference(cfg, outcome, run_dir, reference)
    assert summary["consecutive_steps"]


def test_two_gpus_per_node_with_sharded_stage(run_dir, reference):
    """Pipeline 0: one stage of all layers on both devices of node 0 (each takes half of every
    microbatch); pipeline 1: two stages on the two devices of node 1."""
    cfg = tiny_config(**{"cluster.nodes": 2, "cluster.gpus_per_node": 2, "job.fault_tolerance": 1})
    plan = hand_plan(
        [
            (template([(0, 6, 0, 0, 2)]), (0,), 4),
            (template([(0, 4, 0, 0, 1), (4, 6, 0, 1, 1)]), (1,), 4),
        ],
        batch=16,
        micro=2,
        layers=6,
        f=1,
        gpus=2,
    )
    outcome, _ = launch(cfg, run_dir, initial_plan=plan)
    assert_matches_reference(cfg, outcome, run_dir, reference)


def test_single_pipeline_of_four_stages(run_dir, reference):
    cfg = tiny_config(**{"cluster.nodes": 4, "job.fault_tolerance": 0})
    plan = hand_plan(
        [(template([(0, 2, 0, 0, 1), (2, 3, 1, 0, 1), (3, 4, 2, 0, 1), (4, 6, 3, 0, 1)]), (0, 1, 2, 3), 8)],
        batch=16,
        micro=2,
        layers=6,
        f=0,
        gpus=1,
    )
    outcome, _ = launch(cfg, run_dir, initial_plan=plan)
    assert_matches_reference(cfg, outcome, run_dir, reference)

"""Oobleck's checkpoint fall-back lowers f where the survivors cannot host f+1 pipelines (issue 28,
item 7), as an in-place reconfiguration does, instead of insisting on the original f ("restarting
failed: f=1 needs ... 4 nodes" with fewer alive). A synthetic model whose pipelines need n0=2 nodes
on a 4-node cluster, f=1: two pipelines of two nodes."""

from __future__ import annotations

from omegaconf import OmegaConf

from oobleck.config import CONF_DIR
from oobleck.planning.inputs import ClusterSpec
from oobleck.planning.outputs import tolerated_failures
from oobleck.planning.synthetic import synthetic_profile
from oobleck.strategy import Kind, RunState, StrategyContext, build_strategy

GB = 1e9


def test_the_checkpoint_fall_back_restarts_with_the_f_the_survivors_allow():
    context = StrategyContext(
        profile=synthetic_profile(12, seed=1),  # ~50 MB layers: n0 = 2 nodes at 2 GB per device
        cluster=ClusterSpec(4, 1, 2 * GB, 10 * GB, 1 * GB),
        global_batch_size=64,
        microbatch_size=1,
        fault_tolerance=1,
    )
    strategy = build_strategy(OmegaConf.load(CONF_DIR / "strategy" / "oobleck.yaml"), context, {})
    layout = strategy.start(list(range(4))).layout
    assert context.templates().min_nodes == 2 and len(layout.plan.pipelines) == 2
    # Both holders of the first layers are lost: in-place recovery is impossible.
    removed = tuple(sorted(p.nodes[0] for p in layout.plan.pipelines))
    alive = tuple(n for n in range(4) if n not in removed)
    decision = strategy.on_change(RunState(layout, alive, removed, (), step=8, checkpoint_step=5))
    assert decision.kind is Kind.RESTART, decision.reason
    assert decision.rollback_to_step == 5 and "in-place recovery impossible" in decision.reason
    assert set(decision.layout.plan.nodes) == set(alive) and tolerated_failures(decision.layout.plan) == 0
    # One survivor cannot hold a pipeline: the refusal says so, naming the survivors.
    alone = alive[:1]
    refusal = strategy.on_change(
        RunState(layout, alone, tuple(n for n in range(4) if n not in alone), (), step=8, checkpoint_step=5)
    )
    assert (
        refusal.kind is Kind.STOP and f"the 1 surviving node(s) [{alone[0]}] cannot hold one pipeline" in refusal.reason
    )

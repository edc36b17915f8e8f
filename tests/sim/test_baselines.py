"""Varuna and Bamboo policies on small hand-checked scenarios (real planner templates, synthetic model)."""

from __future__ import annotations

import math

import pytest
from simhelpers import with_strategy

from baselines.bamboo.policy import FAILED, BambooStrategy
from baselines.varuna.policy import VarunaStrategy, best_homogeneous
from oobleck.faults.trace import parse_trace
from oobleck.planning.instantiate import _Sync, plan_iteration_time
from oobleck.sim.engine import simulate


def _trace(lines: list[str]):
    return parse_trace("\n".join(lines) + "\n", origin="test.csv")


def _start(n: int) -> list[str]:
    return [f"0,add,n{i}" for i in range(n)]


# ----- Varuna ---------------------------------------------------------------------------------
def test_varuna_morphs_to_the_fastest_homogeneous_layout(context):
    ctx = with_strategy(context, "varuna")
    for nodes in (2, 5, 7, 8):
        layout = best_homogeneous(ctx, range(nodes))
        d, p = layout.state
        assert d * p == len(layout.nodes) <= nodes
        # Brute force over every template size, timed as the planner times a plan of D such pipelines.
        templates = ctx.templates(0)
        sync = _Sync(templates, templates.intra_node_bandwidth, templates.inter_node_bandwidth)
        times = []
        for size, template in templates.templates.items():
            pipelines = nodes // size
            if pipelines:
                split = [ctx.num_microbatches // pipelines + (i < ctx.num_microbatches % pipelines) for i in range(pipelines)]
                times.append(plan_iteration_time([template] * pipelines, split, sync)[0])
        assert layout.iteration_s == pytest.approx(min(times))


def test_varuna_loses_exactly_the_work_since_the_last_checkpoint(context):
    strategy = VarunaStrategy(with_strategy(context, "varuna", checkpoint_interval=4, checkpoint_s_by_model={"synthetic": 3.0}, restart_s_by_model={"synthetic": 30.0}))
    start = strategy.start(list(range(8))).layout
    victim = start.nodes[0]
    failure_s = 200.0
    trace = _trace([*_start(8), f"{int(failure_s * 1000)},remove,n{victim}"])
    result = simulate(strategy, trace, duration_s=400.0)
    checkpoints = [e["time_s"] for e in result.events if e["kind"] == "checkpoint" and e["time_s"] <= failure_s]
    assert checkpoints, "the scenario must checkpoint before the failure"
    done_since = math.floor((failure_s - checkpoints[-1]) / start.iteration_s + 1e-9)
    restart = next(e for e in result.events if e["kind"] == "restart")
    assert restart["lost_samples"] == done_since * 64 > 0
    assert restart["downtime_s"] == 30.0
    assert result.summary["lost_samples"] == restart["lost_samples"]


def test_varuna_ignores_idle_nodes_and_morphs_on_a_useful_join(context):
    strategy = VarunaStrategy(with_strategy(context, "varuna"))
    layout = strategy.start(list(range(7))).layout
    idle = sorted(set(range(7)) - set(layout.nodes))
    if idle:
        reaction = strategy.react(layout, sorted(set(range(7)) - {idle[0]}), [idle[0]], [])
        assert reaction.action == "none" and reaction.layout is layout
    grown = strategy.react(layout, list(range(8)), [], [7])
    better = best_homogeneous(strategy.context, range(8))
    if better.iteration_s < layout.iteration_s:
        assert grown.action == "restart" and grown.checkpoint_first and not grown.rollback
        assert grown.downtime_s == pytest.approx(strategy.checkpoint_s() + strategy.restart_s())
    else:
        assert grown.action == "none"


# ----- Bamboo ---------------------------------------------------------------------------------
def _bamboo(context, **overrides) -> BambooStrategy:
    return BambooStrategy(with_strategy(context, "bamboo", **overrides))


def test_bamboo_fails_over_then_restarts_on_adjacent_failures(context):
    strategy = _bamboo(context, pipeline_depth=4)
    layout = strategy.start(list(range(8))).layout
    state = layout.state
    assert state.depth == 4 and len(state.pipelines) == 2 and not state.spares
    first = state.pipelines[0]
    # Stage 1 of pipeline 0 fails: its predecessor takes over; the slower pipeline slows the step.
    failover = strategy.react(layout, [n for n in range(8) if n != first[1]], [first[1]], [])
    assert failover.action == "failover" and not failover.rollback
    assert failover.layout.state.pipelines[0][1] == FAILED
    assert failover.layout.iteration_s > layout.iteration_s
    # Stage 2 (adjacent to the failed stage 1) fails: the stage's only copy is gone -> global restart.
    alive = [n for n in range(8) if n not in (first[1], first[2])]
    restart = strategy.react(failover.layout, alive, [first[2]], [])
    assert restart.action == "restart" and restart.rollback
    assert restart.downtime_s == pytest.approx(strategy.restart_s())
    assert len(restart.layout.state.pipelines) == 6 // 4  # fixed depth: floor(6 / 4) pipelines
    # A non-adjacent second failure in the other pipeline is just another failover (or rebalance).
    second = state.pipelines[1]
    other = strategy.react(failover.layout, [n for n in range(8) if n not in (first[1], second[3])], [second[3]], [])
    assert other.action in ("failover", "reconfiguration") and not other.rollback


def test_bamboo_standbys_repair_failed_stages(context):
    strategy = _bamboo(context, pipeline_depth=3)
    layout = strategy.start(list(range(8))).layout
    assert len(layout.state.pipelines) == 2 and len(layout.state.spares) == 2
    victim = layout.state.pipelines[1][0]
    reaction = strategy.react(layout, [n for n in range(8) if n != victim], [victim], [])
    assert reaction.action == "reconfiguration" and reaction.bytes_moved > 0
    assert FAILED not in reaction.layout.state.pipelines[1] and len(reaction.layout.state.spares) == 1
    assert reaction.layout.iteration_s == pytest.approx(layout.iteration_s)


def test_bamboo_redundancy_costs_time_and_memory(context, tight_context):
    strategy = _bamboo(context, pipeline_depth=4)
    layout = strategy.start(list(range(8))).layout
    assert 0 < layout.redundant_fraction < 1
    assert layout.iteration_s > strategy.iteration_s(layout.state, redundancy=False)
    # 1 GB devices hold a stage but not its successor's copy as well: Bamboo cannot run at all.
    oom = _bamboo(tight_context).start(list(range(8)))
    assert oom.action == "oom" and oom.layout is None and "OOM" in oom.reason
    result = simulate(_bamboo(tight_context), _trace([*_start(8), "60000,remove,n3"]), duration_s=120)
    assert result.summary["oom"] and result.summary["throughput"] == 0
    assert result.summary["idle_fraction"] == pytest.approx(1.0)

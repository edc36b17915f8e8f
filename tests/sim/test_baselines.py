"""Varuna and Bamboo policies on small hand-checked scenarios (real planner templates, synthetic model)."""

from __future__ import annotations

import math

import pytest
from simhelpers import make_strategy

from baselines.bamboo.config import FAILED
from baselines.fixed_depth import balanced_partition
from oobleck.faults.trace import parse_trace
from oobleck.planning.gradient_sync import _Sync
from oobleck.planning.instantiate import plan_iteration_time
from oobleck.recovery_costs import checkpoint_cost, restore_s
from oobleck.sim.charges import decision_downtime
from oobleck.sim.engine import simulate
from oobleck.strategy import Kind, RunState


def _trace(lines: list[str]):
    return parse_trace("\n".join(lines) + "\n", origin="test.csv")


def _start(n: int) -> list[str]:
    return [f"0,add,n{i}" for i in range(n)]


def _change(layout, alive, removed=(), joined=(), step=5, checkpoint_step=None):
    return RunState(
        layout, tuple(sorted(alive)), tuple(removed), tuple(joined), step=step, checkpoint_step=checkpoint_step
    )


# ----- Varuna ---------------------------------------------------------------------------------
def test_varuna_morphs_to_the_fastest_homogeneous_layout(context):
    # The planner's-templates rule; Varuna's own (the default) is tested in tests/elastic/test_varuna_layouts.py.
    strategy = make_strategy(context, "varuna", layout_rule="oobleck_templates")
    for nodes in (2, 5, 7, 8):
        layout = strategy.best_layout(range(nodes))
        d, p = layout.state
        assert d * p == len(layout.nodes) <= nodes and len(layout.standby) == nodes - d * p
        assert {len(pipe.nodes) for pipe in layout.plan.pipelines} == {p}
        # Brute force over every template size, timed as the planner times a plan of D such pipelines.
        templates = context.templates(0)
        sync = _Sync(templates, templates.intra_node_bandwidth, templates.inter_node_bandwidth)
        times = []
        for size, template in templates.templates.items():
            pipelines = nodes // size
            if pipelines:
                split = [
                    context.num_microbatches // pipelines + (i < context.num_microbatches % pipelines)
                    for i in range(pipelines)
                ]
                times.append(plan_iteration_time([template] * pipelines, split, sync)[0])
        assert layout.iteration_s == pytest.approx(min(times))


def test_varuna_loses_exactly_the_work_since_the_last_checkpoint(context):
    strategy = make_strategy(
        context,
        "varuna",
        layout_rule="oobleck_templates",  # a layout whose iteration fits the scenario's timeline
        checkpoint_every_steps=4,
        costs={"checkpoint_async": False, "storage_read_gbps": 1e9, "restart_fixed_s": 30.0},
    )
    start = strategy.start(list(range(8))).layout
    victim = start.nodes[0]
    failure_s = 200.0
    trace = _trace([*_start(8), f"{int(failure_s * 1000)},remove,n{victim}"])
    result = simulate(strategy, trace, duration_s=400.0, charge_start=False)
    checkpoints = [e["time_s"] for e in result.events if e["kind"] == "checkpoint" and e["time_s"] <= failure_s]
    assert checkpoints, "the scenario must checkpoint before the failure"
    done_since = math.floor((failure_s - checkpoints[-1]) / start.iteration_s + 1e-9)
    restart = next(e for e in result.events if e["kind"] == "restart")
    assert restart["lost_samples"] == done_since * 64 > 0
    assert restart["downtime_s"] == pytest.approx(30.0)
    assert result.summary["lost_samples"] == restart["lost_samples"]


def test_varuna_restarts_from_the_checkpoint_ignores_idle_nodes_and_morphs_on_a_useful_join(context):
    strategy = make_strategy(context, "varuna")
    layout = strategy.start(list(range(7))).layout
    lost = strategy.on_change(
        _change(layout, [n for n in range(7) if n != layout.nodes[0]], [layout.nodes[0]], step=9, checkpoint_step=5)
    )
    assert lost.kind is Kind.RESTART and lost.rollback_to_step == 5 and not lost.checkpoint_first
    no_checkpoint = strategy.on_change(_change(layout, range(1, 7), [0], step=3))
    assert no_checkpoint.kind is Kind.RESTART and no_checkpoint.rollback_to_step == 0  # from the initial state
    if layout.standby:
        idle = layout.standby[0]
        decision = strategy.on_change(_change(layout, set(range(7)) - {idle}, [idle]))
        assert decision.kind is Kind.CONTINUE and decision.layout.plan is layout.plan
    grown = strategy.on_change(_change(layout, range(8), joined=[7], step=9))
    better = strategy.best_layout(range(8))
    if better.iteration_s < layout.iteration_s:
        assert grown.kind is Kind.RESTART and grown.checkpoint_first and grown.rollback_to_step == 9
        # Checkpoint the running layout (written before stopping), restart, read it back onto the new one.
        downtime, parts = decision_downtime(grown, strategy, previous=layout)
        costs, link = strategy.config.costs, context.cluster.inter_node_bandwidth
        written = checkpoint_cost(layout.plan, context.profile, costs, link)
        read = restore_s(grown.layout.plan, context.profile, costs, link)
        assert dict(parts) == pytest.approx(
            {
                "checkpoint": written.snapshot_s + written.write_s,
                "process_start": costs.restart_fixed_s,
                "group_init": costs.group_init(len(grown.layout.nodes)),
                "model_build": 0.0,
                "load": read,
                "warmup": costs.restart_warmup_s,
            }
        )
        assert downtime == pytest.approx(sum(dict(parts).values()))
    else:
        assert grown.kind is Kind.CONTINUE and 7 in grown.layout.standby


# ----- Bamboo ---------------------------------------------------------------------------------
def _bamboo(context, **overrides):
    return make_strategy(context, "bamboo", **overrides)


def test_balanced_partition_is_the_min_max_split():
    import itertools

    sizes = [5, 1, 1, 7, 2, 2, 9, 1]
    for parts in range(1, len(sizes) + 1):
        ranges = balanced_partition(sizes, parts)
        assert ranges[0][0] == 0 and ranges[-1][1] == len(sizes) and len(ranges) == parts
        assert all(a < b for a, b in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(parts - 1))
        best = min(
            max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, len(sizes))))
            for cuts in itertools.combinations(range(1, len(sizes)), parts - 1)
        )
        assert max(sum(sizes[a:b]) for a, b in ranges) == best


def test_bamboo_plans_hold_each_successor_as_a_shadow(context):
    layout = _bamboo(context, pipeline_depth=4).start(list(range(8))).layout
    plan = layout.plan
    assert len(plan.pipelines) == 2 and all(p.template.num_stages == 4 for p in plan.pipelines)
    for assignment in plan.assignments():
        stages = plan.pipelines[assignment.pipeline].template.stages
        successor = stages[(assignment.stage + 1) % len(stages)]
        assert assignment.shadow_layers == tuple(successor.layers)
    holders = plan.layer_holders()
    assert all(len(workers) == 4 for workers in holders.values()), "2 pipelines x (stage + its shadow)"


def test_bamboo_fails_over_then_restarts_on_adjacent_failures(context):
    strategy = _bamboo(context, pipeline_depth=4)
    layout = strategy.start(list(range(8))).layout
    state = layout.state
    assert state.depth == 4 and len(state.pipelines) == 2 and not state.spares
    first = state.pipelines[0]
    # Stage 1 of pipeline 0 fails: its predecessor, which holds its layers, takes over.
    failover = strategy.on_change(_change(layout, [n for n in range(8) if n != first[1]], [first[1]]))
    assert failover.kind is Kind.FAILOVER
    assert failover.layout.state.pipelines[0][1] == FAILED
    assert failover.layout.iteration_s > layout.iteration_s
    merged = failover.layout.plan.pipelines[0]
    assert merged.nodes == (first[0], first[2], first[3]) and merged.template.stages[0].end == state.partition[1][1]
    # The merged stage needed no copy of its own layers: transfers only restore the shadows.
    old_held = {a.worker: set(a.held_layers) for a in layout.plan.assignments()}
    for t in failover.transfers:
        target = failover.layout.plan.assignment_of(t.target)
        assert t.layer not in old_held[t.target] and t.layer in target.held_layers
    assert all(t.layer not in range(*state.partition[1]) or t.target[0] != first[0] for t in failover.transfers)
    # Stage 2 (adjacent to the failed stage 1) fails: the stage's only copy is gone -> global restart.
    alive = [n for n in range(8) if n not in (first[1], first[2])]
    restart = strategy.on_change(_change(failover.layout, alive, [first[2]], checkpoint_step=3))
    assert restart.kind is Kind.RESTART and restart.rollback_to_step == 3
    assert len(restart.layout.state.pipelines) == 6 // 4  # fixed depth: floor(6 / 4) pipelines
    # A non-adjacent second failure in the other pipeline is just another failover (or rebalance).
    second = state.pipelines[1]
    other = strategy.on_change(
        _change(failover.layout, [n for n in range(8) if n not in (first[1], second[3])], [second[3]])
    )
    assert other.kind in (Kind.FAILOVER, Kind.RECONFIGURE)


def test_bamboo_first_stage_goes_to_the_second_stage_with_a_copy(context):
    strategy = _bamboo(context, pipeline_depth=4)
    layout = strategy.start(list(range(8))).layout
    first = layout.state.pipelines[0]
    decision = strategy.on_change(_change(layout, [n for n in range(8) if n != first[0]], [first[0]]))
    assert decision.kind is Kind.FAILOVER
    merged = decision.layout.plan.pipelines[0]
    assert merged.nodes[0] == first[1] and merged.template.stages[0].start == 0
    copied = {t.layer for t in decision.transfers if t.target[0] == first[1]}
    assert set(range(*layout.state.partition[0])) <= copied


def test_bamboo_standbys_repair_failed_stages():
    from simhelpers import make_context

    strategy = _bamboo(make_context(memory_gb=2.5), pipeline_depth=3)  # depth 3 needs 2.05 GB per device
    layout = strategy.start(list(range(8))).layout
    assert len(layout.state.pipelines) == 2 and len(layout.state.spares) == 2
    victim = layout.state.pipelines[1][0]
    decision = strategy.on_change(_change(layout, [n for n in range(8) if n != victim], [victim]))
    assert decision.kind is Kind.RECONFIGURE and decision.bytes_moved > 0
    assert FAILED not in decision.layout.state.pipelines[1] and len(decision.layout.state.spares) == 1
    assert decision.layout.iteration_s == pytest.approx(layout.iteration_s)


def test_bamboo_redundancy_costs_time_and_memory(context, tight_context):
    strategy = _bamboo(context, pipeline_depth=4, redundancy="inline")
    layout = strategy.start(list(range(8))).layout
    assert 0 < layout.redundant_fraction < 1
    assert layout.iteration_s > strategy.iteration_s(layout.state, redundancy=False)
    # 1 GB devices hold a stage but not its successor's copy as well: Bamboo cannot run at all.
    oom = _bamboo(tight_context, redundancy="inline").start(list(range(8)))
    assert oom.kind is Kind.STOP and oom.out_of_memory and oom.layout is None
    assert "out of memory" in oom.reason and "GB on one device" in oom.reason
    result = simulate(
        _bamboo(tight_context, redundancy="inline"), _trace([*_start(8), "60000,remove,n3"]), duration_s=120
    )
    assert result.summary["oom"] and result.summary["throughput"] == 0
    assert not result.summary["no_durable_progress"]  # it never ran: marked OOM, not as progress lost
    assert result.summary["idle_fraction"] == pytest.approx(1.0)

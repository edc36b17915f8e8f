"""strategy=recycle in the simulator and as a policy: the re-route kind costed by its own cost (no
state copy), its layouts timed from the runtime's own operation lists, its decisions."""

from __future__ import annotations

import math
from dataclasses import replace

import pandas as pd
import pytest
from simhelpers import make_context, make_strategy

from oobleck.faults.trace import parse_trace
from oobleck.schedules import checked_schedule
from oobleck.schedules.cost import schedule_cost
from oobleck.sim.charges import decision_downtime
from oobleck.sim.engine import simulate
from oobleck.strategy import Kind, RunState


@pytest.fixture(scope="module")
def context():
    return make_context(memory_gb=4.0, nodes=8)


def _lines(n: int, removals: list[tuple[int, int]]) -> str:
    return "\n".join([f"0,add,n{i}" for i in range(n)] + [f"{t * 1000},remove,n{i}" for t, i in removals]) + "\n"


def test_a_lost_node_is_rerouted_with_no_copy_and_costed_at_operation_level(context):
    strategy = make_strategy(context, "recycle", pipeline_depth=4)
    start = strategy.start(list(range(8)))
    assert start.kind is Kind.START and start.layout.description == "D=2 x P=4"
    decision = strategy.on_change(RunState(start.layout, tuple(n for n in range(8) if n != 5), (5,), (), 10))
    assert decision.kind is Kind.REROUTE and decision.transfers == ()
    plan = decision.layout.plan
    (reroute,) = plan.reroutes
    assert reroute.pipeline == 1 and set(reroute.via) == {0}
    # The slowdown is what the runtime's own lists add: the re-routed plan's op-level makespan less
    # the intact plan's, on top of the intact layout's plan time.
    costed = schedule_cost(plan, checked_schedule(plan), context.profile, context.cluster).makespan_s
    intact = start.layout.plan
    base = schedule_cost(intact, checked_schedule(intact), context.profile, context.cluster).makespan_s
    assert decision.layout.iteration_s == pytest.approx(start.layout.iteration_s + costed - base)
    assert decision.layout.iteration_s > start.layout.iteration_s
    costs = strategy.config.costs
    downtime, parts = decision_downtime(decision, strategy)
    assert downtime == pytest.approx(costs.reconfigure_fixed_s + costs.warmup_s)
    assert dict(parts)["state_copy"] == 0.0


def test_every_copy_of_a_stage_lost_falls_back_to_a_checkpoint_restart(context):
    strategy = make_strategy(context, "recycle", pipeline_depth=4)
    layout = strategy.start(list(range(8))).layout
    decision = strategy.on_change(RunState(layout, (0, 2, 3, 4, 6, 7), (1, 5), (), 10, checkpoint_step=8))
    assert decision.kind is Kind.RESTART and decision.rollback_to_step == 8
    assert "no live pipeline holds stage(s) [1]" in decision.reason


def test_a_joined_node_takes_the_lost_stage_back_with_a_copy(context):
    strategy = make_strategy(context, "recycle", pipeline_depth=4)
    layout = strategy.start(list(range(8))).layout
    rerouted = strategy.on_change(RunState(layout, (0, 1, 2, 3, 4, 6, 7), (5,), (), 3)).layout
    back = strategy.on_change(RunState(rerouted, (0, 1, 2, 3, 4, 6, 7, 8), (), (8,), 5))
    assert back.kind is Kind.RECONFIGURE and not back.layout.plan.reroutes
    stage = layout.plan.pipelines[1].template.stages[1]
    assert {t.layer for t in back.transfers} == set(stage.layers) and all(t.target[0] == 8 for t in back.transfers)


def test_the_simulator_records_reroutes(context):
    trace = parse_trace(_lines(8, [(300, 1), (700, 6)]), origin="t.csv")
    result = simulate(make_strategy(context, "recycle", pipeline_depth=4), trace, duration_s=1000.0)
    kinds = [e["kind"] for e in result.events if e["kind"] not in ("failure", "checkpoint")]
    assert kinds == ["start", "reroute", "reroute"]
    assert result.summary["n_reroute"] == 2 and all(
        e["bytes_moved"] == 0 for e in result.events if e["kind"] == "reroute"
    )


def test_the_staggering_bound_is_the_gap_between_the_first_and_last_rank_to_finish(context):
    from baselines.recycle.policy import staggering_bound_s

    deep = make_strategy(context, "recycle", pipeline_depth=4).start(list(range(8))).layout.plan
    cost = schedule_cost(deep, checked_schedule(deep), context.profile, context.cluster)
    bound = staggering_bound_s(deep, context.profile, context.cluster)
    assert bound == pytest.approx(cost.makespan_s - min(cost.rank_end_s)) and 0 < bound < cost.makespan_s
    # Pure data parallelism: every rank ends together, nothing to stagger.
    flat = make_strategy(context, "recycle", pipeline_depth=1).start(list(range(8))).layout.plan
    assert staggering_bound_s(flat, context.profile, context.cluster) == pytest.approx(0.0)


def test_a_standby_takes_a_lost_stage_at_once_and_a_pipeline_with_no_node_left_is_dropped(context):
    strategy = make_strategy(context, "recycle", pipeline_depth=3)
    layout = strategy.start(list(range(8))).layout
    assert layout.description == "D=2 x P=3" and layout.standby == (6, 7)
    taken = strategy.on_change(RunState(layout, (0, 1, 2, 3, 5, 6, 7), (4,), (), 3))
    assert taken.kind is Kind.RECONFIGURE and taken.layout.plan.pipelines[1].nodes == (3, 6, 5)
    assert taken.layout.standby == (7,) and {t.target[0] for t in taken.transfers} == {6}
    # Pipeline 1 loses every node: its microbatches go to pipeline 0, nothing is copied.
    alone = make_strategy(context, "recycle", pipeline_depth=4)
    start = alone.start(list(range(8))).layout
    dropped = alone.on_change(RunState(start, (0, 1, 2, 3), (4, 5, 6, 7), (), 3))
    assert dropped.kind is Kind.REROUTE and len(dropped.layout.plan.pipelines) == 1
    assert dropped.layout.plan.pipelines[0].microbatches == context.num_microbatches and not dropped.transfers


def test_losing_the_last_stage_of_the_first_pipeline_is_rerouted(context):
    # The re-routed plan's model is the intact template's, not the first pipeline's gapped one.
    strategy = make_strategy(context, "recycle", pipeline_depth=4)
    start = strategy.start(list(range(8))).layout
    last = start.plan.pipelines[0].nodes[-1]
    decision = strategy.on_change(RunState(start, tuple(n for n in range(8) if n != last), (last,), (), 5))
    assert decision.kind is Kind.REROUTE and decision.layout.plan.num_layers == start.plan.num_layers
    (reroute,) = decision.layout.plan.reroutes
    assert (reroute.pipeline, reroute.end) == (0, start.plan.num_layers)
    checked_schedule(decision.layout.plan)  # routes and lists build and check
    assert decision.layout.iteration_s > start.iteration_s


def _gapped_state(strategy, depth: int, pipelines: int, lost: set[int]):
    from baselines.recycle.policy import FAILED, ReCycleState

    slots = tuple(
        tuple(FAILED if n in lost else n for n in range(p * depth, (p + 1) * depth)) for p in range(pipelines)
    )
    return ReCycleState(depth, strategy.partition(depth), slots, ())


def _uncached_extra_s(context, state) -> float:
    """The re-routes' cost as a fresh strategy computes it: both plans costed from scratch."""
    from dataclasses import replace

    fresh = make_strategy(context, "recycle")
    depth = state.depth
    intact = replace(
        state, pipelines=tuple(tuple(range(p * depth, (p + 1) * depth)) for p in range(len(state.pipelines)))
    )
    times = []
    for plan in (fresh.plan(state), fresh.plan(intact)):
        times.append(schedule_cost(plan, checked_schedule(plan), context.profile, context.cluster).makespan_s)
    return max(0.0, times[0] - times[1])


def test_the_intact_makespan_is_costed_once_per_split_and_pipeline_count_and_changes_no_value():
    context = make_context(memory_gb=4.0, nodes=12)
    strategy = make_strategy(context, "recycle")
    # Same split and count twice (one cost), another count, another depth: three intact plans.
    states = [
        _gapped_state(strategy, 4, 3, {5}),
        _gapped_state(strategy, 4, 3, {1, 10}),
        _gapped_state(strategy, 4, 2, {6}),
        _gapped_state(strategy, 3, 4, {0}),
        _gapped_state(strategy, 3, 4, {4, 11}),
    ]
    for state in states:
        assert strategy.rerouted_extra_s(state) == pytest.approx(_uncached_extra_s(context, state), rel=1e-12)
        assert strategy.rerouted_extra_s(state) > 0.0
    assert len(strategy._intact_makespan) == 3


def test_a_strategy_that_started_once_nodes_joined_is_not_out_of_memory():
    """ReCycle needs two pipelines: on 3 nodes of n0 = 2 it cannot lay the model out (an out-of-
    memory stop), and starts when a fourth node joins. It started late; it is not OOM, and its
    ratio is a number."""
    from oobleck.sim.ratios import add_speedups, speedup_ranges

    context = make_context(memory_gb=2.0, nodes=4)
    trace = parse_trace("0,add,n0\n0,add,n1\n0,add,n2\n120000,add,n3\n4000000,remove,n1\n", origin="late.csv")
    first = make_strategy(context, "recycle").start([0, 1, 2])
    assert first.kind is Kind.STOP and first.out_of_memory
    late = simulate(make_strategy(context, "recycle"), trace, labels={"model": "m"})
    s = late.summary
    assert s["ran"] and not s["oom"] and s["n_oom"] == 1 and s["start_delay_s"] == pytest.approx(120.0)
    ours = simulate(make_strategy(context, "oobleck"), trace, labels={"model": "m"}).summary
    assert ours["start_delay_s"] == pytest.approx(120.0)  # f = 1 needs 4 nodes too (not a memory stop)
    summary = add_speedups(pd.DataFrame([ours, s]))
    ratio = speedup_ranges(summary).set_index("baseline").loc["recycle"]
    assert ratio["note"] == "" and ratio["ratio_median"] > 0 and not ratio["baseline_oom"]
    assert ratio["baseline_start_delay_s_max"] == pytest.approx(120.0)
    never = simulate(
        make_strategy(context, "recycle"),
        parse_trace("0,add,n0\n0,add,n1\n9000,remove,n1\n", origin="x.csv"),
    )
    assert never.summary["oom"] and not never.summary["ran"] and math.isnan(never.summary["start_delay_s"])


def test_states_with_equal_gaps_share_one_costing_that_equals_their_own(context):
    """A re-routed plan's makespan is costed once per gap pattern, whichever nodes hold the rest
    (the cluster's nodes are alike); what the shared value gives each state is what costing that
    state's own plan gives."""
    strategy = make_strategy(context, "recycle", pipeline_depth=4)
    layout = strategy.start(list(range(8))).layout
    # Stage 1 of pipeline 1 lost, once as node 5 on nodes 0-7, once after the nodes were renumbered.
    first = strategy.on_change(RunState(layout, (0, 1, 2, 3, 4, 6, 7), (5,), (), 3)).layout
    renamed = replace(
        first.state, pipelines=tuple(tuple(n + 10 if n >= 0 else n for n in p) for p in first.state.pipelines)
    )
    assert renamed.pipelines != first.state.pipelines
    shared = strategy.layout(renamed)
    assert len(strategy._rerouted_makespan) == 1
    for state, seconds in ((first.state, first.iteration_s), (renamed, shared.iteration_s)):
        plan = strategy.plan(state)
        own = schedule_cost(plan, checked_schedule(plan), context.profile, context.cluster).makespan_s
        assert seconds == pytest.approx(plan.predicted_iteration_s + own - strategy.intact_makespan_s(state), rel=1e-12)

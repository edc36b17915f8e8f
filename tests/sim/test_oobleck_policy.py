"""Oobleck's policy in the simulator: real planner plans, in-place reconfiguration, no idle node."""

from __future__ import annotations

from collections import defaultdict

import pytest
from simhelpers import make_strategy

from oobleck.faults.trace import parse_trace
from oobleck.planning.reconfigure import reconfigure
from oobleck.sim.charges import decision_downtime
from oobleck.sim.engine import simulate
from oobleck.strategy import Kind, RunState


def _oobleck(context, **overrides):
    return make_strategy(context, "oobleck", **overrides)


def _trace(lines):
    return parse_trace("\n".join(lines) + "\n", origin="t.csv")


def test_oobleck_never_idles_and_never_restarts_within_f(context):
    # 8 nodes, one lost every 10 minutes down to (f+1) * n0 = 4, then two join.
    lines = [f"0,add,n{i}" for i in range(8)]
    lines += [f"{600_000 * k},remove,n{k}" for k in range(1, 5)]
    lines += ["3000000,add,x1", "3000000,add,x2"]
    result = simulate(_oobleck(context), _trace(lines), duration_s=3600.0)
    s = result.summary
    assert s["n_reconfiguration"] == 5 and s["n_restart"] == 0 and s["n_stop"] == 0
    assert s["lost_samples"] == 0
    # Only the two joiners idle, until the step boundary where they are taken in (the iteration
    # in flight completes first).
    running = [row for row in result.segments if row["phase"] == "running"]
    waiting = [row for row in running if row["nodes_used"] != row["nodes_alive"]]
    assert len(waiting) == 1 and waiting[0]["t_start_s"] == pytest.approx(3000.0)
    assert waiting[0]["nodes_alive"] - waiting[0]["nodes_used"] == 2
    assert 0 < waiting[0]["t_end_s"] - 3000.0 <= waiting[0]["iteration_s"] + 1e-9
    assert s["idle_node_s"] == pytest.approx(2 * (waiting[0]["t_end_s"] - 3000.0))
    reconfigurations = [e for e in result.events if e["kind"] == "reconfiguration"]
    assert all(0 < e["downtime_s"] < 60 for e in reconfigurations)
    assert reconfigurations[-1]["nodes_used"] == 6


def test_reconfiguration_cost_is_fixed_plus_bytes_over_bandwidth(context):
    strategy = _oobleck(context)
    layout = strategy.start(list(range(8))).layout
    victim = layout.plan.pipelines[0].nodes[0]
    alive = tuple(n for n in range(8) if n != victim)
    decision = strategy.on_change(RunState(layout, alive, (victim,), (), step=5))
    plan = reconfigure(
        layout.plan,
        context.templates(),
        removed=[victim],
        layer_param_bytes=[l.param_bytes for l in context.profile.layers],
    )
    assert decision.kind is Kind.RECONFIGURE and decision.layout.plan == plan.new
    assert decision.transfers == plan.transfers
    into, out = defaultdict(float), defaultdict(float)
    for t in plan.transfers:
        if t.source[0] != t.target[0]:
            into[t.target[0]] += 3 * t.nbytes  # parameters + two Adam moments = 12 B of 4 B params
            out[t.source[0]] += 3 * t.nbytes
    expected = 2.0 + max([*into.values(), *out.values()]) / context.cluster.inter_node_bandwidth
    downtime, _ = decision_downtime(decision, strategy)
    assert downtime == pytest.approx(expected)
    assert decision.bytes_moved == plan.bytes_moved > 0
    assert set(decision.layout.nodes) == set(alive)


def test_losing_every_replica_restarts_from_the_checkpoint_or_stops_without_one(context):
    layout = _oobleck(context).start(list(range(8))).layout
    holders = {w[0] for w in layout.plan.layer_holders()[0]}  # every node holding layer 0
    lines = [f"0,add,n{i}" for i in range(8)] + [f"300000,remove,n{n}" for n in sorted(holders)]
    # With checkpoints every 10 iterations: restart from the last one, losing what came after it.
    result = simulate(_oobleck(context, checkpoint_every_steps=10), _trace(lines), duration_s=900.0)
    restart = next(e for e in result.events if e["kind"] == "restart")
    assert "no live replica" in restart["reason"]
    last_checkpoint = max(e["time_s"] for e in result.events if e["kind"] == "checkpoint" and e["time_s"] <= 300.0)
    since = int((300.0 - last_checkpoint) // layout.iteration_s + 1e-9)
    assert restart["lost_samples"] == min(since, 10) * 64
    # Without any checkpoint there is nothing to fall back on: the job stops and starts again at
    # once from the initial state on the survivors (a restart that reads nothing).
    stopped = simulate(_oobleck(context), _trace(lines), duration_s=900.0)
    stop = next(e for e in stopped.events if e["kind"] == "stop")
    assert "no checkpoint" in stop["reason"]
    again = next(e for e in stopped.events if e["kind"] == "restart")
    assert again["time_s"] == stop["time_s"] == 300.0 and "load" not in again["breakdown"]
    assert stopped.summary["n_restart"] == 1 and stopped.summary["lost_samples"] > 0


def test_before_the_first_commit_the_survivors_start_over_on_what_they_can_host(context):
    """Step 0, every replica of the first layers lost (nothing has committed, so nothing is really
    lost): two survivors cannot host f+1=2 pipelines of n0=2 nodes, so the run starts over on one
    pipeline and says it now tolerates no failure; one survivor cannot hold the model, and the
    refusal names the survivors, not a cluster.nodes value the user never set."""
    from oobleck.planning.outputs import tolerated_failures

    strategy = _oobleck(context)
    layout = strategy.start(list(range(8))).layout
    assert context.templates().min_nodes == 2 and len(layout.plan.pipelines) >= 2
    survivors = tuple(sorted(p.nodes[-1] for p in layout.plan.pipelines[:2]))
    removed = tuple(n for n in range(8) if n not in survivors)
    decision = strategy.on_change(RunState(layout, survivors, removed, (), step=0))
    assert decision.kind is Kind.RECONFIGURE and "starting over before the first commit" in decision.reason
    assert set(decision.layout.plan.nodes) == set(survivors) and tolerated_failures(decision.layout.plan) == 0

    alone = (survivors[0],)
    refusal = strategy.on_change(RunState(layout, alone, tuple(n for n in range(8) if n != alone[0]), (), step=0))
    assert refusal.kind is Kind.STOP
    assert f"the 1 surviving node(s) [{alone[0]}] cannot hold one pipeline (n0=2 nodes)" in refusal.reason
    assert "cluster.nodes" not in refusal.reason

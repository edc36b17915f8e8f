"""Oobleck's policy in the simulator: real planner plans, in-place reconfiguration, no idle node."""

from __future__ import annotations

from collections import defaultdict

import pytest
from simhelpers import with_strategy

from oobleck.faults.trace import parse_trace
from oobleck.planning.reconfigure import reconfigure
from oobleck.sim.engine import simulate
from oobleck.sim.policies import OobleckStrategy


def _oobleck(context, **overrides) -> OobleckStrategy:
    return OobleckStrategy(with_strategy(context, "oobleck", **overrides))


def test_oobleck_never_idles_and_never_restarts_within_f(context):
    # 8 nodes, one lost every 10 minutes down to (f+1) * n0 = 4, then two join.
    lines = [f"0,add,n{i}" for i in range(8)]
    lines += [f"{600_000 * k},remove,n{k}" for k in range(1, 5)]
    lines += ["3000000,add,x1", "3000000,add,x2"]
    result = simulate(_oobleck(context), parse_trace("\n".join(lines) + "\n", origin="t.csv"), duration_s=3600.0)
    s = result.summary
    assert s["n_reconfiguration"] == 5 and s["n_restart"] == 0 and s["n_stop"] == 0
    assert s["idle_node_s"] == 0 and s["lost_samples"] == 0
    for row in result.segments:
        if row["phase"] == "running":
            assert row["nodes_used"] == row["nodes_alive"]
    reconfigurations = [e for e in result.events if e["kind"] == "reconfiguration"]
    assert all(0 < e["downtime_s"] < 60 for e in reconfigurations)
    assert reconfigurations[-1]["nodes_used"] == 6


def test_reconfiguration_cost_is_fixed_plus_bytes_over_bandwidth(context):
    strategy = _oobleck(context)
    layout = strategy.start(list(range(8))).layout
    victim = layout.plan.pipelines[0].nodes[0]
    alive = [n for n in range(8) if n != victim]
    reaction = strategy.react(layout, alive, [victim], [])
    plan = reconfigure(layout.plan, context.templates(), removed=[victim], layer_param_bytes=[l.param_bytes for l in context.profile.layers])
    assert reaction.layout.plan == plan.new
    into, out = defaultdict(float), defaultdict(float)
    for t in plan.transfers:
        if t.source[0] != t.target[0]:
            into[t.target[0]] += 3 * t.nbytes  # parameters + two Adam moments = 12 B of 4 B params
            out[t.source[0]] += 3 * t.nbytes
    expected = 2.0 + max([*into.values(), *out.values()]) / context.cluster.inter_node_bandwidth
    assert reaction.downtime_s == pytest.approx(expected)
    assert reaction.bytes_moved == 3 * plan.bytes_moved > 0
    assert set(reaction.layout.nodes) == set(alive)


def test_losing_every_replica_of_a_layer_falls_back_to_a_restart(context):
    strategy = _oobleck(context)
    layout = strategy.start(list(range(8))).layout
    holders = {w[0] for w in layout.plan.layer_holders()[0]}  # every node holding layer 0
    lines = [f"0,add,n{i}" for i in range(8)] + [f"300000,remove,n{n}" for n in sorted(holders)]
    result = simulate(_oobleck(context), parse_trace("\n".join(lines) + "\n", origin="t.csv"), duration_s=900.0)
    restart = next(e for e in result.events if e["kind"] == "restart")
    assert "no live replica" in restart["reason"]
    # No checkpoint was ever taken (checkpoint_interval 0): everything done before is lost.
    done_before = int(300.0 // layout.iteration_s) * 64
    assert restart["lost_samples"] == done_before > 0

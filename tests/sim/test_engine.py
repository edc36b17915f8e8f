"""The event engine's bookkeeping, checked by hand on a tiny strategy with round numbers."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from oobleck.faults.trace import parse_trace
from oobleck.planning.layouts import even_split
from oobleck.planning.plan import ExecutionPlan, PipelineInstance, PipelineTemplate, StageSpec
from oobleck.planning.profile import ClusterSpec
from oobleck.planning.synthetic import synthetic_profile
from oobleck.sim.costs import CostConstants
from oobleck.sim.engine import BREAKDOWN, simulate
from oobleck.strategy import Decision, Kind, Layout, Strategy, StrategyConfig, StrategyContext

ONE_STAGE = PipelineTemplate(1, (StageSpec(0, 1, 0, 0, 1),), (10.0,), (0.0,), 4, 10.0)


class RoundNumbers(Strategy):
    """Every alive node works; one sample per 10 s iteration; checkpoints every 3 iterations (5 s);
    any removal rolls back and restarts in 20 s; joins are absorbed by a 1 s reconfiguration."""

    def __init__(self, interval: int = 3) -> None:
        costs = CostConstants(checkpoint_s_by_model={"synthetic": 5.0}, restart_s_by_model={"synthetic": 20.0}, reconfigure_fixed_s=1.0)
        config = StrategyConfig(_target_="test_engine.RoundNumbers", name="round", checkpoint_every_steps=interval, costs=costs)
        context = StrategyContext(synthetic_profile(1, seed=0), ClusterSpec(8, 1, 1e9, 1e10, 1e9), 1, 1, 0)
        super().__init__(config, context)

    def _layout(self, nodes: Sequence[int]) -> Layout:
        split = even_split(1, len(nodes))
        pipelines = tuple(PipelineInstance(i, ONE_STAGE, (n,), m, sum(split[:i]), 10.0) for i, (n, m) in enumerate(zip(nodes, split)))
        plan = ExecutionPlan(pipelines, 1, 1, 1, 0, 1, 10.0)
        return Layout(plan=plan, iteration_s=10.0, description=f"{len(nodes)} nodes")

    def start(self, nodes):
        return Decision(Kind.START, self._layout(nodes))

    def on_change(self, state):
        if state.removed:
            return self.restart(state, "a node was lost")
        return Decision(Kind.RECONFIGURE, self._layout(state.alive))


def _trace(text: str):
    return parse_trace(text, origin="test.csv")


def test_rollback_loses_exactly_the_work_since_the_last_checkpoint():
    result = simulate(RoundNumbers(), _trace("0,add,a\n0,add,b\n95000,remove,b\n"), duration_s=200.0)
    s = result.summary
    # Before the removal: 2 checkpointed cycles (6 iterations), 2 more iterations and 5 s in flight.
    # After: restart 20 s, then 115..200 s: 7 iterations (6 checkpointed), 5 s in flight at the end.
    assert s["samples"] == 13 and s["lost_samples"] == 2
    assert s["useful_node_s"] == pytest.approx(2 * 60 + 1 * 70)
    assert s["checkpoint_node_s"] == pytest.approx(2 * 10 + 1 * 10)
    assert s["lost_node_s"] == pytest.approx(2 * 20 + 2 * 5 + 1 * 5)
    assert s["restart_node_s"] == pytest.approx(20)
    assert s["node_seconds"] == pytest.approx(2 * 95 + 1 * 105)
    assert s["n_checkpoint"] == 4 and s["n_restart"] == 1 and s["n_failure"] == 1
    assert s["throughput"] == pytest.approx(13 / 200)
    # One checkpoint row per running period: (first, last, count).
    checkpoints = [(e["first_time_s"], e["time_s"], e["count"]) for e in result.events if e["kind"] == "checkpoint"]
    assert checkpoints == [(pytest.approx(35), pytest.approx(70), 2), (pytest.approx(150), pytest.approx(185), 2)]


def test_breakdown_sums_to_alive_node_seconds_and_segments_tile_time():
    text = "0,add,a\n0,add,b\n0,add,c\n12000,remove,a\n13000,add,d\n50000,add,e\n51000,remove,b\n"
    result = simulate(RoundNumbers(interval=0), _trace(text), duration_s=300.0)
    s = result.summary
    assert sum(s[f"{k}_node_s"] for k in BREAKDOWN) == pytest.approx(s["node_seconds"])
    alive = [(0, 3), (12, 2), (13, 3), (50, 4), (51, 3)]
    expected = sum(n * (end - t) for (t, n), (end, _) in zip(alive, [*alive[1:], (300, 0)]))
    assert s["node_seconds"] == pytest.approx(expected)
    spans = [(r["t_start_s"], r["t_end_s"]) for r in result.segments]
    assert spans[0][0] == 0 and spans[-1][1] == pytest.approx(300)
    assert all(a[1] == pytest.approx(b[0]) for a, b in zip(spans, spans[1:]))
    # Without checkpoints a rollback loses everything done so far. At 12 s: the iteration done at
    # 10 s; the join at 13 s cannot cut the 20 s restart short (running again at 32 s); at 51 s:
    # the iteration done at 42 s (the one in flight at 50 s was abandoned by the join).
    assert s["lost_samples"] == 1 + 1
    running = [r for r in result.segments if r["phase"] == "running"]
    assert [r["t_start_s"] for r in running][:2] == pytest.approx([0, 32])


def test_a_second_restart_during_a_restart_starts_over():
    # The second removal comes 10 s into the first 20 s restart: recovery restarts from there.
    result = simulate(RoundNumbers(), _trace("0,add,a\n0,add,b\n0,add,c\n40000,remove,a\n50000,remove,b\n"), duration_s=100.0)
    restarts = [e for e in result.events if e["kind"] == "restart"]
    assert [e["time_s"] for e in restarts] == [40, 50]
    running = [r for r in result.segments if r["phase"] == "running"]
    assert running[-1]["t_start_s"] == pytest.approx(70)
    assert result.summary["restart_node_s"] == pytest.approx(2 * 10 + 1 * 20)

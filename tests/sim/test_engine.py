"""The event engine's bookkeeping, checked by hand on a tiny strategy with round numbers."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from oobleck.faults.trace import parse_trace
from oobleck.planning.inputs import ClusterSpec
from oobleck.planning.layouts import even_split
from oobleck.planning.outputs import ExecutionPlan, PipelineInstance, PipelineTemplate, StageSpec
from oobleck.planning.synthetic import synthetic_profile
from oobleck.recovery_costs import CostConstants
from oobleck.sim.engine import simulate
from oobleck.sim.progress import BREAKDOWN
from oobleck.strategy import Decision, Kind, Layout, Strategy, StrategyConfig, StrategyContext

ONE_STAGE = PipelineTemplate(1, (StageSpec(0, 1, 0, 0, 1),), (10.0,), (0.0,), 4, 10.0)


PROFILE = synthetic_profile(1, seed=0)
CHECKPOINT_GB = PROFILE.param_bytes * 3 / 1e9  # parameters and two Adam moments of the one layer


def round_costs(**changes) -> CostConstants:
    """Synchronous checkpoints of 2.5 s snapshot + 2.5 s write; restarts of 20 s (reading the
    checkpoint back is instant); starts free unless ``changes`` say otherwise."""
    values = dict(
        checkpoint_async=False,
        host_copy_gbps=CHECKPOINT_GB / 2.5,
        storage_write_gbps=CHECKPOINT_GB / 2.5,
        storage_read_gbps=1e9,
        restart_fixed_s=20.0,
        reconfigure_fixed_s=1.0,
    )
    return CostConstants(**{**values, **changes})


class RoundNumbers(Strategy):
    """Every alive node works; one sample per 10 s iteration; checkpoints every 3 iterations (5 s);
    any removal rolls back and restarts in 20 s; joins are absorbed by a 1 s reconfiguration."""

    def __init__(self, interval: int = 3, costs: CostConstants | None = None) -> None:
        config = StrategyConfig(
            _target_="test_engine.RoundNumbers",
            name="round",
            checkpoint_every_steps=interval,
            costs=costs or round_costs(),
        )
        context = StrategyContext(PROFILE, ClusterSpec(8, 1, 1e9, 1e10, 1e9), 1, 1, 0)
        super().__init__(config, context)

    def _layout(self, nodes: Sequence[int]) -> Layout:
        split = even_split(1, len(nodes))
        pipelines = tuple(
            PipelineInstance(i, ONE_STAGE, (n,), m, sum(split[:i]), 10.0) for i, (n, m) in enumerate(zip(nodes, split))
        )
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
    result = simulate(
        RoundNumbers(), _trace("0,add,a\n0,add,b\n95000,remove,b\n"), duration_s=200.0, charge_start=False
    )
    s = result.summary
    # Before the removal: 2 checkpointed cycles (6 iterations), 2 more iterations and 5 s in flight.
    # After: restart 20 s, then 115..200 s: 7 iterations (6 checkpointed), 5 s in flight at the end.
    assert s["samples"] == 13 and s["lost_samples"] == 2
    assert s["useful_node_s"] == pytest.approx(2 * 60 + 1 * 70)
    assert s["checkpoint_node_s"] == pytest.approx(2 * 10 + 1 * 10)
    assert s["lost_node_s"] == pytest.approx(2 * 20 + 2 * 5 + 1 * 5)
    assert s["restart_node_s"] == pytest.approx(20, rel=1e-6)
    assert s["node_seconds"] == pytest.approx(2 * 95 + 1 * 105)
    assert s["n_checkpoint"] == 4 and s["n_restart"] == 1 and s["n_failure"] == 1
    assert s["throughput"] == pytest.approx(13 / 200)
    # One checkpoint row per running period: (first, last, count).
    checkpoints = [(e["first_time_s"], e["time_s"], e["count"]) for e in result.events if e["kind"] == "checkpoint"]
    assert checkpoints == [(pytest.approx(35), pytest.approx(70), 2), (pytest.approx(150), pytest.approx(185), 2)]


def test_breakdown_sums_to_alive_node_seconds_and_segments_tile_time():
    text = "0,add,a\n0,add,b\n0,add,c\n12000,remove,a\n13000,add,d\n50000,add,e\n51000,remove,b\n"
    result = simulate(RoundNumbers(interval=0), _trace(text), duration_s=300.0, charge_start=False)
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
    result = simulate(
        RoundNumbers(),
        _trace("0,add,a\n0,add,b\n0,add,c\n40000,remove,a\n50000,remove,b\n"),
        duration_s=100.0,
        charge_start=False,
    )
    restarts = [e for e in result.events if e["kind"] == "restart"]
    assert [e["time_s"] for e in restarts] == [40, 50]
    running = [r for r in result.segments if r["phase"] == "running"]
    assert running[-1]["t_start_s"] == pytest.approx(70)
    assert result.summary["restart_node_s"] == pytest.approx(2 * 10 + 1 * 20, rel=1e-6)


def test_every_start_waits_for_its_nodes_and_pays_a_start():
    # Nodes come up 45 s after the trace adds them; the start then takes the restart's fixed 20 s.
    result = simulate(RoundNumbers(interval=0), _trace("0,add,a\n0,add,b\n"), duration_s=200.0, node_creation_s=45.0)
    start = next(e for e in result.events if e["kind"] == "start")
    assert start["time_s"] == pytest.approx(45) and start["downtime_s"] == pytest.approx(20)
    running = [r for r in result.segments if r["phase"] == "running"]
    assert running[0]["t_start_s"] == pytest.approx(65)
    assert [r["phase"] for r in result.segments][:2] == ["starting", "recovering"]
    # 135 s of running: 13 iterations of one sample; the creation time counts in the throughput.
    assert result.summary["samples"] == 13 and result.summary["throughput"] == pytest.approx(13 / 200)
    assert result.summary["restart_node_s"] == pytest.approx(2 * 20) and result.summary["n_start"] == 1


def test_a_node_lost_before_it_is_up_never_joins():
    from oobleck.sim.arrivals import delayed_changes

    trace = _trace("0,add,a\n10000,add,b\n30000,remove,b\n40000,add,b\n50000,remove,a\n")
    changes = [(c.time_ms, c.added, c.removed) for c in delayed_changes(trace, 45.0)]
    # b's first instance is removed 20 s after it was added: before it is up, so it never joins;
    # its second instance comes up 45 s after it is added again.
    assert changes == [(45000, ("a",), ()), (50000, (), ("a",)), (85000, ("b#1",), ())]


def test_an_asynchronous_checkpoint_is_durable_only_once_written():
    # 2.5 s snapshot on the training path, 12 s write in the background: the checkpoint of the
    # 3 iterations done at 30 s is durable at 32.5 + 12 = 44.5 s; the next iteration ends at 42.5 s.
    costs = round_costs(checkpoint_async=True, storage_write_gbps=CHECKPOINT_GB / 12.0)
    for failure_s, lost in ((40, 3), (50, 1)):
        result = simulate(
            RoundNumbers(costs=costs),
            _trace(f"0,add,a\n0,add,b\n{failure_s * 1000},remove,b\n"),
            duration_s=100.0,
            charge_start=False,
        )
        # At 40 s the checkpoint's 3 iterations are lost (its write is in flight); at 50 s only the
        # iteration after it.
        assert result.summary["lost_samples"] == lost, failure_s
    checkpoint = next(e for e in result.events if e["kind"] == "checkpoint")
    assert checkpoint["downtime_s"] == pytest.approx(2.5) and checkpoint["durable_after_s"] == pytest.approx(12.0)


def test_a_stopped_job_restarts_as_soon_as_its_nodes_allow():
    class StopsOnLoss(RoundNumbers):
        """Stops on any loss (nothing to fall back on); needs ``least`` nodes to start."""

        def __init__(self, least: int) -> None:
            super().__init__(interval=0)
            self.least = least

        def start(self, nodes):
            if len(nodes) < self.least:
                return Decision(Kind.STOP, reason=f"needs {self.least} nodes")
            return super().start(nodes)

        def on_change(self, state):
            if state.removed:
                return Decision(Kind.STOP, reason="nothing to fall back on")
            return super().on_change(state)

    # One node is enough: the job stopped at 95 s restarts at once (20 s) from nothing on the
    # survivor. Everything before the stop (9 iterations) is lost; 115..200 s: 8 iterations.
    result = simulate(
        StopsOnLoss(1), _trace("0,add,a\n0,add,b\n95000,remove,b\n"), duration_s=200.0, charge_start=False
    )
    s = result.summary
    assert s["lost_samples"] == 9 and s["samples"] == 8 and s["n_stop"] == 1 and s["n_restart"] == 1
    restart = next(e for e in result.events if e["kind"] == "restart")
    assert restart["time_s"] == pytest.approx(95) and restart["failure"]
    assert s["kept_samples"] == 0 and s["no_durable_progress"]
    # Two nodes needed: it waits for the join at 150 s, then restarts (20 s); 170..200 s: 3 iterations.
    trace = _trace("0,add,a\n0,add,b\n95000,remove,b\n150000,add,c\n")
    s = simulate(StopsOnLoss(2), trace, duration_s=200.0, charge_start=False).summary
    assert s["lost_samples"] == 9 and s["samples"] == 3 and s["n_stop"] == 1 and s["n_restart"] == 1
    assert s["idle_node_s"] == pytest.approx(150 - 95)


def test_a_join_is_taken_in_at_the_next_step_boundary():
    # c joins 5 s into the third iteration (20..30 s): that iteration completes, then the 1 s
    # reconfiguration; nothing is lost and c idles until the boundary.
    result = simulate(
        RoundNumbers(interval=0), _trace("0,add,a\n0,add,b\n25000,add,c\n"), duration_s=100.0, charge_start=False
    )
    s = result.summary
    reconfiguration = next(e for e in result.events if e["kind"] == "reconfiguration")
    assert reconfiguration["time_s"] == pytest.approx(30) and not reconfiguration["failure"]
    assert s["lost_samples"] == 0 and s["lost_node_s"] == pytest.approx(3 * 9)  # in flight when the window closes
    assert s["idle_node_s"] == pytest.approx(5) and s["reconfiguration_node_s"] == pytest.approx(3 * 1)
    assert s["samples"] == 3 + 6  # 10, 20, 30 s; then 41 .. 91 s
    # A failure abandons the iteration in flight at once and is detected first.
    costs = round_costs(detect_s=4.0)
    lost = simulate(
        RoundNumbers(interval=0, costs=costs), _trace("0,add,a\n0,add,b\n25000,remove,b\n"), duration_s=100.0
    )
    restart = next(e for e in lost.events if e["kind"] == "restart")
    assert restart["time_s"] == pytest.approx(25) and restart["failure"]
    assert restart["downtime_s"] == pytest.approx(4 + 20) and "detect=4.000" in restart["breakdown"]


def test_rolled_back_work_is_marked_in_the_timeline():
    # As in the first test: checkpoints durable at 35 and 70 s, the removal at 95 s discards the
    # iterations done at 80 and 90 s and the one in flight: 70..95 s of running is not durable.
    result = simulate(
        RoundNumbers(), _trace("0,add,a\n0,add,b\n95000,remove,b\n"), duration_s=200.0, charge_start=False
    )
    running = [r for r in result.segments if r["phase"] == "running"]
    discarded = [(r["t_start_s"], r["t_end_s"]) for r in running if not r["durable"]]
    assert discarded == [(pytest.approx(70), pytest.approx(95))]
    spans = [(r["t_start_s"], r["t_end_s"]) for r in result.segments]
    assert all(a[1] == pytest.approx(b[0]) for a, b in zip(spans, spans[1:]))  # still tiles time


def test_a_context_remembers_that_no_template_fits(monkeypatch):
    """The same profile, cluster and f fail the planner the same way: a strategy that asks again
    at every membership change (a model nothing fits) gets the same error without a search."""
    import oobleck.planning.templates as templates_module
    from oobleck.errors import PlanningError

    calls = []
    real = templates_module.generate_templates

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(templates_module, "generate_templates", counting)
    context = StrategyContext(PROFILE, ClusterSpec(8, 1, 1.0, 1e10, 1e9), 1, 1, 0)  # one byte per GPU
    messages = []
    for _ in range(3):
        with pytest.raises(PlanningError) as error:
            context.templates()
        messages.append(str(error.value))
    assert len(calls) == 1 and len(set(messages)) == 1 and "fits" in messages[0]
    # Another f is another question.
    with pytest.raises(PlanningError):
        context.templates(1)
    assert len(calls) == 2

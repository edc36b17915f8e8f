"""The regroup-or-re-plan horizon comes from the failure schedule (``planner.replan_horizon``)."""

from __future__ import annotations

import pytest

from oobleck.config import compose_config
from oobleck.errors import ConfigError, PlanningError
from oobleck.faults.schedule import build_schedule
from oobleck.planning.horizon import mean_change_gap_s, replan_horizon_steps


def test_the_mean_gap_is_the_span_over_the_changes():
    assert mean_change_gap_s([]) is None
    assert mean_change_gap_s([30.0, 10.0, 30.0]) == 15.0  # two distinct changes by 30 s
    assert mean_change_gap_s([10.0], span_s=100.0) == 100.0
    assert mean_change_gap_s([0.0]) is None  # no time between them to go by


def test_steps_are_the_gap_over_the_step_time():
    assert replan_horizon_steps(60.0, 0.5, 100) == 120
    assert replan_horizon_steps(0.1, 0.5, 100) == 1  # at least one step
    assert replan_horizon_steps(None, 0.5, 100) == 100
    with pytest.raises(PlanningError, match="step time"):
        replan_horizon_steps(60.0, 0.0, 100)
    with pytest.raises(PlanningError, match="replan_horizon_steps=-1"):
        replan_horizon_steps(None, 1.0, -1)


def _horizon(*overrides: str, step_s: float = 0.5) -> tuple[int, str]:
    from oobleck.elastic.job import replan_horizon

    cfg = compose_config("model=gpt3_tiny", *overrides)
    schedule = build_schedule(cfg.failures, nodes=int(cfg.cluster.nodes), steps=int(cfg.job.steps))
    return replan_horizon(cfg, schedule, step_s)


def test_real_runs_derive_it_from_their_failure_schedule():
    # poisson: the mean time between failures over the predicted step time
    assert _horizon("failures=poisson", "failures.mtbf_s=30")[0] == 60
    # explicit: the run's steps over its changes (two at step 10 count once, a join later)
    events = "failures.events=[{action:remove,step:10,count:2},{action:join,step:30,count:1}]"
    assert _horizon("failures=explicit", events, "job.steps=100")[0] == 50
    # a trace: its span over its changes, scaled to run time
    steps, why = _horizon("failures=trace", "failures.trace=synthetic/10m", "cluster.nodes=4")
    assert steps > 0 and "failures=trace" in why
    # none, or planner.replan_horizon=fixed: planner.replan_horizon_steps
    assert _horizon("failures=none")[0] == 100
    assert _horizon("failures=poisson", "planner.replan_horizon=fixed", "planner.replan_horizon_steps=7")[0] == 7


def test_a_bad_horizon_setting_is_refused_before_anything_starts():
    from oobleck.config import validate

    with pytest.raises(ConfigError, match="planner.replan_horizon='often' is not one of schedule, fixed"):
        validate(compose_config("planner.replan_horizon=often"))
    with pytest.raises(ConfigError, match="planner.copy_piece_mb=0"):
        validate(compose_config("planner.copy_piece_mb=0"))

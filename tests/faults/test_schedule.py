"""Failure schedules are built and checked before launch (no processes involved)."""

from __future__ import annotations

import pytest

from oobleck.config import compose_config
from oobleck.errors import ConfigError, TraceError
from oobleck.faults.injector import Injector
from oobleck.faults.kinds import FaultKind, Phase
from oobleck.faults.schedule import FaultEvent, build_schedule
from testing import config_section


def failures(**fields):
    return config_section("failures", **fields)


def test_none_and_explicit():
    assert build_schedule(failures(kind="none"), nodes=4, steps=10) == ()
    events = build_schedule(
        failures(
            kind="explicit",
            events=[{"action": "remove", "step": 3, "count": 2}, {"action": "join", "time_s": 1.5, "nodes": [4]}],
        ),
        nodes=4,
        steps=10,
    )
    assert events[0] == FaultEvent(FaultKind.REMOVE, step=3, count=2, origin="failures.events[0]")
    assert events[1].nodes == (4,) and events[1].time_s == 1.5


@pytest.mark.parametrize(
    "event, message",
    [
        ({"action": "remove", "step": -1, "count": 1}, "step=-1 must be >= 0"),
        ({"action": "remove", "step": 2, "nodes": [7]}, "names node 7"),
        ({"action": "join", "step": 2, "nodes": [1]}, "new id >= cluster.nodes=4"),
        ({"action": "remove", "time_s": 1.0, "count": 1, "phase": "backward"}, "needs step=<int>"),
        ({"action": "remove", "step": 2, "count": 10}, "count=10 strikes more nodes than the 4 alive then"),
        ({"action": "freeze", "step": 2, "count": 0}, "count=0 must be > 0"),
        ({"action": "join", "step": 2, "count": 1, "phase": "forward"}, "a join has no phase"),
        ({"action": "raise", "time_s": 2.0, "nodes": [1]}, "give step=<int> instead of time_s"),
        ({"action": "explode", "step": 2, "count": 1}, "action='explode' is not one of remove, freeze, raise, join"),
    ],
)
def test_explicit_errors_name_the_event(event, message):
    with pytest.raises(ConfigError, match="failures.events\\[0\\]") as caught:
        build_schedule(failures(kind="explicit", events=[event]), nodes=4, steps=10)
    assert message in str(caught.value)


def test_poisson_is_seeded_and_bounded():
    a = build_schedule(failures(kind="poisson", mtbf_s=5.0, seed=3), nodes=4, steps=10)
    b = build_schedule(failures(kind="poisson", mtbf_s=5.0, seed=3), nodes=4, steps=10)
    c = build_schedule(failures(kind="poisson", mtbf_s=5.0, seed=4), nodes=4, steps=10)
    assert a == b and a != c and len(a) == 4
    times = [e.time_s for e in a]
    assert times == sorted(times) and all(e.count == 1 and e.kind is FaultKind.REMOVE for e in a)


def test_trace_maps_names_and_scales_time(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("0,add,x\n0,add,y\n0,add,z\n0,add,w\n3600000,remove,y\n7200000,add,v\n7200000,remove,w\n")
    events = build_schedule(failures(kind="trace", trace=str(trace), seconds_per_trace_hour=10.0), nodes=3, steps=10)
    # x, y, z are nodes 0..2 (w is beyond cluster.nodes and ignored); v joins as node 3
    assert events == (
        FaultEvent(FaultKind.REMOVE, time_s=10.0, nodes=(1,), origin=f"{trace}:5"),
        FaultEvent(FaultKind.JOIN, time_s=20.0, nodes=(3,), origin=f"{trace}:6"),
    )


def test_malformed_trace_names_file_and_line(tmp_path):
    trace = tmp_path / "bad.csv"
    trace.write_text("0,add,x\n0,add,y\n1000,explode,y\n")
    with pytest.raises(TraceError, match=r"bad.csv:3"):
        build_schedule(failures(kind="trace", trace=str(trace)), nodes=2, steps=10)


def test_trace_smaller_than_cluster_is_refused(tmp_path):
    trace = tmp_path / "small.csv"
    trace.write_text("0,add,x\n")
    with pytest.raises(TraceError, match="cluster.nodes=2"):
        build_schedule(failures(kind="trace", trace=str(trace)), nodes=2, steps=10)


def test_counts_follow_the_nodes_alive_at_each_event():
    events = [
        {"action": "remove", "step": 1, "count": 3},
        {"action": "join", "step": 2, "count": 2},
        {"action": "freeze", "step": 3, "count": 3},
    ]
    assert len(build_schedule(failures(kind="explicit", events=events), nodes=4, steps=10)) == 3
    events[-1]["count"] = 4  # 4 - 3 + 2 = 3 nodes are alive at the third event
    with pytest.raises(ConfigError, match=r"failures.events\[2\].count=4 strikes more nodes than the 3 alive"):
        build_schedule(failures(kind="explicit", events=events), nodes=4, steps=10)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_events": -1}, "failures.max_events=-1 must be >= 1"),
        ({"seed": -1}, "failures.seed=-1 must be >= 0"),
        ({"mtbf_s": 0.0}, "failures.mtbf_s=0.0 must be"),
        ({"kind": "sometimes"}, "failures.kind='sometimes' is not one of none, explicit, poisson, trace"),
    ],
)
def test_settings_are_checked_whatever_the_kind(fields, message):
    with pytest.raises(ConfigError) as caught:
        build_schedule(failures(**{"kind": "poisson", **fields}), nodes=4, steps=10)
    assert message in str(caught.value)


def test_a_raise_at_any_phase_strikes_at_the_steps_first():
    (event,) = build_schedule(
        failures(kind="explicit", events=[{"action": "raise", "step": 2, "nodes": [1]}]), nodes=4, steps=10
    )
    assert event.kind is FaultKind.RAISE and event.phase is Phase.FORWARD and event.armed


def test_freeze_flag_still_means_action_freeze(caplog):
    (event,) = build_schedule(
        failures(kind="explicit", events=[{"action": "remove", "step": 1, "nodes": [2], "freeze": True}]),
        nodes=4,
        steps=10,
    )
    assert event.kind is FaultKind.FREEZE and event.kind.signal.name == "SIGSTOP"
    assert "failures.events[0].freeze=true is deprecated; write action=freeze" in caplog.text


def test_an_event_past_the_last_step_is_said_and_dropped(caplog):
    # failures=demo (a removal at step 10) with a short run: job.steps=3 runs, failure-free.
    demo = compose_config("failures=demo").failures
    assert build_schedule(demo, nodes=4, steps=3) == ()
    assert "failures.events[0] at step 10 is past the run's last step 2 (job.steps=3): it will not fire" in caplog.text


def test_injector_orders_events_and_arms_phases():
    events = (
        FaultEvent(FaultKind.REMOVE, step=2, nodes=(1,), phase=Phase.BACKWARD),
        FaultEvent(FaultKind.REMOVE, step=3, count=1),
        FaultEvent(FaultKind.JOIN, step=3, count=2),
        FaultEvent(FaultKind.RAISE, step=5, nodes=(0,)),
    )
    injector = Injector(events, seed=0)
    assert injector.due(0, 0.0, [0, 1, 2]) == []
    armed = injector.due(1, 0.0, [0, 1, 2])  # a phase strike is armed one step early
    assert [(a.kind, a.armed, a.nodes) for a in armed] == [(FaultKind.REMOVE, True, (1,))]
    kill = injector.due(3, 0.0, [0, 2])
    assert [(a.kind, a.armed) for a in kill] == [(FaultKind.REMOVE, False)] and kill[0].nodes[0] in (0, 2)
    join = injector.due(3, 0.0, [0, 2])  # one change per call: the join comes next
    assert [(a.kind, a.count) for a in join] == [(FaultKind.JOIN, 2)]
    raised = injector.due(4, 0.0, [0, 2, 4, 5])  # a raise is always struck by the worker: armed early
    assert [(a.kind, a.armed, a.nodes) for a in raised] == [(FaultKind.RAISE, True, (0,))] and injector.remaining == 0


def test_a_trace_without_failures_trace_is_refused():
    from oobleck.config import validate

    with pytest.raises(
        ConfigError, match=r"failures.trace=synthetic/10m is read only by failures=trace, but failures.kind=none"
    ):
        validate(compose_config("failures.trace=synthetic/10m"))
    validate(compose_config("failures=trace", "failures.trace=synthetic/10m"))  # chosen: fine


def test_no_failure_unless_asked_and_the_demo_asks_for_one():
    """The default config injects nothing; failures=demo (the README's main job) is one removal at
    step 10, and its event can be replaced."""
    from oobleck.config import validate

    default = compose_config()
    validate(default)
    assert default.failures.kind == "none" and build_schedule(default.failures, nodes=4, steps=30) == ()
    demo = compose_config("failures=demo")
    validate(demo)
    assert build_schedule(demo.failures, nodes=4, steps=30) == (
        FaultEvent(FaultKind.REMOVE, step=10, count=1, origin="failures.events[0]"),
    )
    other = compose_config("failures=demo", "failures.events=[{action:remove,step:4,nodes:[2]}]")
    assert [(e.step, e.nodes) for e in build_schedule(other.failures, nodes=4, steps=30)] == [(4, (2,))]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("failures.events=[{action:remove,step:4,count:1}]",),
            "failures.events is read only by failures=explicit, but failures.kind=none; add failures=explicit",
        ),
        (
            ("failures=poisson", "failures.events=[{action:remove,step:4,count:1}]"),
            "failures.events is read only by failures=explicit, but failures.kind=poisson",
        ),
        (("failures=explicit",), "failures=explicit has no events"),
    ],
)
def test_events_without_an_explicit_schedule_and_an_empty_one_are_refused(overrides, message):
    """Events given without failures=explicit would never fire (no failure is the default): refused
    before launch, as is an explicit schedule with nothing in it."""
    from oobleck.config import validate

    with pytest.raises(ConfigError) as caught:
        validate(compose_config(*overrides))
    assert message in str(caught.value)
    validate(compose_config("failures=explicit", "failures.events=[{action:remove,step:4,count:1}]"))

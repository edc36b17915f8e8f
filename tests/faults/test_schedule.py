"""Failure schedules are built and checked before launch (no processes involved)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from oobleck.config import FailuresConfig
from oobleck.errors import ConfigError, TraceError
from oobleck.faults.injector import Injector
from oobleck.faults.schedule import FaultEvent, build_schedule


def failures(**fields):
    return OmegaConf.merge(OmegaConf.structured(FailuresConfig), fields)


def test_none_and_explicit():
    assert build_schedule(failures(kind="none"), nodes=4, steps=10) == ()
    events = build_schedule(
        failures(kind="explicit", events=[{"action": "remove", "step": 3, "count": 2}, {"action": "join", "time_s": 1.5, "nodes": [4]}]),
        nodes=4,
        steps=10,
    )
    assert events[0] == FaultEvent(action="remove", step=3, count=2, origin="failures.events[0]")
    assert events[1].nodes == (4,) and events[1].time_s == 1.5


@pytest.mark.parametrize(
    "event, message",
    [
        ({"action": "remove", "step": 12, "count": 1}, "outside the run's steps"),
        ({"action": "remove", "step": 2, "nodes": [7]}, "names node 7"),
        ({"action": "join", "step": 2, "nodes": [1]}, "new id >= cluster.nodes=4"),
        ({"action": "remove", "time_s": 1.0, "count": 1, "phase": "backward"}, "needs step=<int>"),
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
    assert times == sorted(times) and all(e.count == 1 and e.action == "remove" for e in a)


def test_trace_maps_names_and_scales_time(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("0,add,x\n0,add,y\n0,add,z\n0,add,w\n3600000,remove,y\n7200000,add,v\n7200000,remove,w\n")
    events = build_schedule(failures(kind="trace", trace=str(trace), seconds_per_trace_hour=10.0), nodes=3, steps=10)
    # x, y, z are nodes 0..2 (w is beyond cluster.nodes and ignored); v joins as node 3
    assert events == (
        FaultEvent(action="remove", time_s=10.0, nodes=(1,), origin=f"{trace}:5"),
        FaultEvent(action="join", time_s=20.0, nodes=(3,), origin=f"{trace}:6"),
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


def test_injector_orders_events_and_arms_phases():
    events = (
        FaultEvent(action="remove", step=2, nodes=(1,), phase="backward"),
        FaultEvent(action="remove", step=3, count=1),
        FaultEvent(action="join", step=3, count=2),
    )
    injector = Injector(events, seed=0)
    assert injector.due(0, 0.0, [0, 1, 2]) == []
    armed = injector.due(1, 0.0, [0, 1, 2])  # a phase strike is armed one step early
    assert [(a.kind, a.nodes) for a in armed] == [("arm", (1,))]
    kill = injector.due(3, 0.0, [0, 2])
    assert [a.kind for a in kill] == ["kill"] and kill[0].nodes[0] in (0, 2)
    join = injector.due(3, 0.0, [0, 2])  # one change per call: the join comes next
    assert [(a.kind, a.count) for a in join] == [("join", 2)] and injector.remaining == 0

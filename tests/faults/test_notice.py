"""Preemption notices: checked before launch, given to every strategy, exact with real SIGKILLs.

A removal may come with ``notice_s`` seconds of warning (``failures.events[].notice_s``, or
``failures.notice_s`` for every removal). The strategy hears of it through ``Strategy.on_notice``
and the node is SIGKILLed when the notice runs out. Every run here still equals single-process
training on the same batches: Varuna checkpoints on the notice and restarts without the node (no
step lost when the checkpoint is done before the kill), Bamboo fails over onto the predecessor
before the kill, Oobleck ignores the notice and recovers in place after the kill.
"""

from __future__ import annotations

import pandas as pd
import pytest

from oobleck.elastic.job import launch
from oobleck.errors import ConfigError
from oobleck.faults.injector import Injector
from oobleck.faults.kinds import FaultKind
from oobleck.faults.schedule import FaultEvent, build_schedule
from testing import config_section, tiny_config
from testing.stopping import StopWhen, assert_stopped_run_matches_reference, launch_until

pytestmark = pytest.mark.slow  # starts processes


def failures(**fields):
    return config_section("failures", **fields)


# ---------------------------------------------------------------------------------- schedules
def test_a_notice_is_a_plain_field_of_the_schedule(tmp_path):
    events = build_schedule(
        failures(
            kind="explicit",
            events=[
                {"action": "remove", "step": 3, "count": 1, "notice_s": 2.5},
                {"action": "remove", "step": 5, "nodes": [2]},
                {"action": "join", "step": 6, "count": 1},
            ],
            notice_s=1.0,
        ),
        nodes=4,
        steps=10,
    )
    assert [e.notice_s for e in events] == [2.5, 1.0, 0.0]  # failures.notice_s for removals without their own
    trace = tmp_path / "t.csv"
    trace.write_text("0,add,x\n0,add,y\n0,add,z\n3600000,remove,y\n7200000,add,v\n")
    replay = build_schedule(failures(kind="trace", trace=str(trace), notice_s=4.0), nodes=3, steps=10)
    assert replay == (
        FaultEvent(FaultKind.REMOVE, time_s=10.0, nodes=(1,), origin=f"{trace}:4", notice_s=4.0),
        FaultEvent(FaultKind.JOIN, time_s=20.0, nodes=(3,), origin=f"{trace}:5"),
    )
    poisson = build_schedule(failures(kind="poisson", mtbf_s=5.0, notice_s=3.0), nodes=2, steps=10)
    assert {e.notice_s for e in poisson} == {3.0}


def test_a_timed_removal_is_due_at_its_notice():
    """A removal at a time happens then; its notice comes notice_s earlier (and the kill follows it)."""
    removal = FaultEvent(FaultKind.REMOVE, time_s=10.0, nodes=(1,), notice_s=4.0)
    injector = Injector([removal])
    assert injector.due(next_step=3, elapsed_s=5.9, live=[0, 1]) == []
    (action,) = injector.due(next_step=3, elapsed_s=6.0, live=[0, 1])
    assert action.nodes == (1,) and action.notice_s == 4.0 and not action.armed
    at_step = Injector([FaultEvent(FaultKind.REMOVE, step=4, nodes=(0,), notice_s=2.0)])
    assert at_step.due(next_step=3, elapsed_s=0.0, live=[0, 1]) == []
    assert at_step.due(next_step=4, elapsed_s=0.0, live=[0, 1])[0].notice_s == 2.0  # the notice as step 4 starts


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"events": [{"action": "remove", "step": 2, "count": 1, "notice_s": -1.0}]}, "notice_s=-1.0 must be a finite"),
        ({"events": [{"action": "remove", "step": 2, "count": 1, "notice_s": float("nan")}]}, "notice_s=nan"),
        ({"events": [{"action": "join", "step": 2, "count": 1, "notice_s": 3.0}]}, "a join is no preemption"),
        ({"events": [{"action": "freeze", "step": 2, "count": 1, "notice_s": 3.0}]}, "a hang comes without warning"),
        ({"events": [{"action": "raise", "step": 2, "nodes": [1], "notice_s": 3.0}]}, "only action=remove"),
        (
            {"events": [{"action": "remove", "step": 2, "count": 1, "phase": "backward", "notice_s": 3.0}]},
            "strikes at phase=backward",
        ),
        (
            {"events": [{"action": "remove", "step": 2, "count": 1, "phase": "backward"}], "notice_s": 3.0},
            "failures.notice_s=3 but failures.events[0] strikes at phase=backward",
        ),
        ({"events": [{"action": "remove", "time_s": 2.0, "count": 1, "notice_s": 3.0}]}, "time_s=2.0 is shorter"),
        ({"notice_s": -2.0}, "failures.notice_s=-2.0 must be a finite number of seconds >= 0"),
    ],
)
def test_bad_notices_are_refused_before_launch(tmp_path, fields, message):
    section = failures(kind="explicit", **({"events": []} | fields))
    with pytest.raises(ConfigError) as caught:
        build_schedule(section, nodes=4, steps=10)
    assert message in str(caught.value)
    # ... and by a launch, before any process starts.
    cfg = tiny_config(**{f"failures.{k}": v for k, v in fields.items()}, **{"failures.kind": "explicit"})
    with pytest.raises(ConfigError):
        launch(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------- real runs
def _events(run_dir) -> list[dict]:
    return pd.read_csv(run_dir / "events.csv").to_dict("records")


# A notice's kill comes seconds after it, and a run ends after job.steps whether or not it has
# come: a fixed step count would be too short on a fast machine and spend most of its steps after
# the events on a slow one. Each run here is stopped (checkpointed, as at a Slurm time limit) a few
# steps after it has seen what its test is about; job.steps is only a bound.
STEPS_BOUND = 2000
STEPS_AFTER = 3


def _notice_run(tmp_path, strategy: str, nodes: int, events: list[dict], seen, **overrides):
    cfg = tiny_config(
        f"strategy={strategy}",
        **{
            "cluster.nodes": nodes,
            "failures.kind": "explicit",
            "failures.events": events,
            "job.steps": STEPS_BOUND,
            **overrides,
        },
    )
    run_dir = tmp_path / strategy
    outcome, summary = launch_until(cfg, run_dir, StopWhen(seen, STEPS_AFTER))
    assert_stopped_run_matches_reference(cfg, outcome, run_dir)
    return outcome, summary, _events(run_dir)


def _count(kind: str, at_least: int = 1):
    return lambda events: sum(e["kind"] == kind for e in events) >= at_least


def test_varuna_checkpoints_on_the_notice_and_loses_no_step(tmp_path):
    """4 nodes (D=4 x P=1), checkpoints every 4 steps. Node 1 gets a 3 s notice as step 5 starts:
    Varuna checkpoints step 6's boundary, restarts on the 3 nodes that stay (rolling back nothing)
    and node 1's kill then changes nothing. Node 2 gets a notice far too short for a checkpoint
    (1 ms) as step 40 starts (or once node 1 is gone, if later: events apply one at a time): the
    kill overtakes the planned restart, which rolls back to the last complete checkpoint as on a
    crash. The run stops a few steps after that second restart (``_notice_run``)."""
    outcome, summary, events = _notice_run(
        tmp_path,
        "varuna",
        4,
        [
            {"action": "remove", "step": 5, "nodes": [1], "notice_s": 3.0},
            {"action": "remove", "step": 40, "nodes": [2], "notice_s": 0.001},
        ],
        _count("restart", 2),
        **{"checkpoint.every_steps": 4},
    )
    noticed, overtaken = outcome.recoveries
    notices = [e for e in events if e["kind"] == "notice"]
    assert noticed["kind"] == "restart" and noticed["reason"] == "notice" and noticed["removed"] == []
    # Checkpointed at the boundary after the step in flight when the notice came; nothing rolled back.
    assert noticed["resume_step"] == notices[0]["step"] + 1 and noticed["rolled_back_steps"] == 0
    assert "preemption notice for nodes [1]" in noticed["decision"]
    assert [(e["nodes"], e["notice_s"], e["decision"]) for e in notices] == [
        ("[1]", 3.0, "restart"),
        ("[2]", 0.001, "restart"),
    ]
    departed = [e for e in events if e["kind"] == "departed"]
    assert [e["nodes"] for e in departed] == ["[1]"]
    kills = [e for e in events if e["kind"] == "fault_injected"]
    assert [(e["nodes"], e["notice_s"]) for e in kills] == [("[1]", 3.0), ("[2]", 0.001)]
    # The second notice: the kill came before the boundary's checkpoint, so the run rolled back
    # to the newest complete checkpoint, the steps since it redone.
    assert overtaken["kind"] == "restart" and overtaken["reason"] == "failure" and overtaken["removed"] == [2]
    killed_at = next(e["step"] for e in events if e["kind"] == "failure" and e["node"] == 2)
    assert overtaken["rolled_back_steps"] == killed_at - overtaken["resume_step"]
    # (none when the kill came at a boundary whose checkpoint was complete: the summary omits 0)
    assert summary.get("rolled_back_steps", 0) == overtaken["rolled_back_steps"]
    assert outcome.steps[-1]["nodes"] == 2


def test_bamboo_fails_over_on_the_notice(tmp_path):
    """Two pipelines of depth 2 on 4 nodes: node 1 (stage 1 of pipeline 0) gets a 5 s notice as
    step 3 starts; its predecessor takes its stage over at once, while node 1 still lives, and its
    kill then changes nothing."""
    outcome, _, events = _notice_run(
        tmp_path,
        "bamboo",
        4,
        [{"action": "remove", "step": 3, "nodes": [1], "notice_s": 5.0}],
        _count("departed"),
        **{"strategy.pipeline_depth": 2},
    )
    (failover,) = outcome.recoveries
    (notice,) = [e for e in events if e["kind"] == "notice"]
    assert failover["kind"] == "failover" and failover["reason"] == "notice" and failover["removed"] == []
    assert notice["decision"] == "failover" and failover["resume_step"] - notice["step"] in (0, 1)
    assert [e["nodes"] for e in events if e["kind"] == "departed"] == ["[1]"]
    assert outcome.steps[-1]["nodes"] == 3


def test_oobleck_ignores_the_notice_and_recovers_in_place_after_the_kill(tmp_path):
    outcome, summary, events = _notice_run(
        tmp_path,
        "oobleck",
        4,
        [{"action": "remove", "step": 3, "nodes": [1], "notice_s": 1.0}],
        _count("reconfiguration"),
        **{"job.fault_tolerance": 1},
    )
    (notice,) = [e for e in events if e["kind"] == "notice"]
    assert notice["decision"] == "continue"
    (recovery,) = outcome.recoveries
    assert recovery["kind"] == "reconfiguration" and recovery["reason"] == "failure" and recovery["removed"] == [1]
    assert not [e for e in events if e["kind"] == "departed"]
    # Every run's summary says what host it ran on and how crowded it was (oobleck.metrics.host).
    host = summary["host"]
    assert host["training_processes"] == 4 and host["run_processes"] == 2 + 4 * 2
    assert host["oversubscribed"] is (4 > host["usable_cpus"]) and len(host["load_avg_end"]) == 3


def test_the_label_of_a_schedule_says_its_notice():
    from oobleck.metrics.wandb_run import failures_label

    events = [{"action": "remove", "step": 8, "count": 1, "notice_s": 5.0}, {"action": "freeze", "step": 9, "count": 1}]
    assert failures_label({"kind": "explicit", "events": events}) == "remove1@8~5s+freeze1@9"
    assert failures_label({"kind": "explicit", "events": events[1:], "notice_s": 2.0}) == "freeze1@9"
    assert (
        failures_label({"kind": "trace", "trace": "spot/ec2_p3_scaled", "notice_s": 30.0}) == "spot/ec2_p3_scaled~30s"
    )

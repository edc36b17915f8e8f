"""In-place recovery from real SIGKILLs loses nothing (issue 5).

One shared run on 7 local nodes (f=1, gpt3_tiny; it starts on a 5-stage and a 2-stage pipeline,
given, not planned: the planner's choice follows the measured profile, and in a 4+3 plan nodes 1
and 4 hold the same layer, so the double failure below would leave it no replica) takes node failures at every point of a step (forward, backward, gradient all-reduce,
optimizer step) and a second failure during a reconfiguration, shrinking to two single-node
pipelines; its per-step losses and final parameters must equal single-process training on the
same batches (tolerance justified in tests/runtime/test_exactness.py).
"""

from __future__ import annotations

import time

import pytest

from oobleck.elastic import controller as controller_module
from oobleck.elastic.job import launch
from oobleck.elastic.local import run_processes
from oobleck.errors import RunError
from testing import (
    assert_matches_reference,
    hand_plan,
    template,
    tiny_config,
    two_pipelines_of_two_nodes,
)

pytestmark = pytest.mark.slow  # starts processes

PHASE_EVENTS = [
    {"action": "remove", "step": 2, "nodes": [1], "phase": "forward"},
    {"action": "remove", "step": 2, "nodes": [4], "phase": "reconfigure"},  # dies while gen 1 forms
    {"action": "remove", "step": 5, "nodes": [3], "phase": "backward"},
    {"action": "remove", "step": 7, "nodes": [5], "phase": "allreduce"},
    {"action": "remove", "step": 9, "nodes": [0], "phase": "optimizer"},
]


def phase_config():
    return tiny_config(
        **{
            "cluster.nodes": 7,
            "job.fault_tolerance": 1,
            "job.steps": 12,
            "failures.kind": "explicit",
            "failures.events": PHASE_EVENTS,
        }
    )


def phase_plan():
    """Nodes 0-4: one stage each (layers 0-1, 2, 3, 4, 5); nodes 5-6: layers 0-2 and 3-5."""
    five = template([(0, 2, 0, 0, 1), (2, 3, 1, 0, 1), (3, 4, 2, 0, 1), (4, 5, 3, 0, 1), (5, 6, 4, 0, 1)])
    two = template([(0, 3, 0, 0, 1), (3, 6, 1, 0, 1)])
    return hand_plan([(five, (0, 1, 2, 3, 4), 4), (two, (5, 6), 4)], batch=16, micro=2, layers=6, f=1, gpus=1)


@pytest.fixture(scope="module")
def phase_run(tmp_path_factory):
    cfg = phase_config()
    run_dir = tmp_path_factory.mktemp("phases")
    outcome, summary = launch(cfg, run_dir, initial_plan=phase_plan())
    return cfg, outcome, summary, run_dir


def test_failures_at_every_phase_lose_nothing(phase_run):
    cfg, outcome, summary, run_dir = phase_run
    assert_matches_reference(cfg, outcome, run_dir)  # steps consecutive, none skipped or repeated


def test_every_failure_became_a_recovery(phase_run):
    cfg, outcome, summary, run_dir = phase_run
    removed = sorted(n for r in outcome.recoveries for n in r["removed"])
    assert removed == [0, 1, 3, 4, 5]
    assert sum(r["bytes_moved"] for r in outcome.recoveries) > 0, "shrinking pipelines moved layers"
    for r in (r for r in outcome.recoveries if r["bytes_moved"]):  # the copies' own figures
        assert r["copy_bytes_per_s"] > 0 and r["receiver_copy_s"] > 0, r
        assert r["prefault_s"] > 0 and 0 <= r["prefault_wait_s"] <= r["receiver_copy_s"], r  # runtime.prefault_copies
    assert all(r["replicas_identical"] for r in outcome.recoveries)
    retried = [row for row in outcome.steps if row["attempts"] > 1]
    assert retried, "a step interrupted by a failure is redone and its attempts recorded"
    events = (run_dir / "events.csv").read_text()
    assert "reconfiguration_superseded" in events  # node 4 died during the first reconfiguration
    assert summary["recoveries"] == len(outcome.recoveries)


def test_replicas_bit_identical_after_each_generation(phase_run):
    _, outcome, _, _ = phase_run
    assert outcome.checksums, "every established generation publishes per-layer checksums"
    assert all(crcs for crcs in outcome.checksums.values())  # empty would mean a mismatch


def test_survivors_were_never_restarted(phase_run):
    _, outcome, _, _ = phase_run
    pids: dict[tuple[int, int], set[int]] = {}
    for ranks in outcome.probes.values():
        for probe in ranks.values():
            pids.setdefault(tuple(probe["worker"]), set()).add(probe["pid"])
    assert pids[(2, 0)] and pids[(6, 0)] and all(len(p) == 1 for p in pids.values())


def test_lost_layers_stop_cleanly(tmp_path):
    """Two 2-node pipelines; both first stages die at once: layers 0..2 have no live replica. The
    run stops in < 10 s with a message naming the lost layers, and leaves no process behind."""
    cfg = tiny_config(
        **{
            "cluster.nodes": 4,
            "job.fault_tolerance": 1,
            "job.steps": 8,
            "failures.kind": "explicit",
            "failures.events": [{"action": "remove", "step": 3, "nodes": [0, 2]}],
        }
    )
    plan = two_pipelines_of_two_nodes()
    seen: dict[str, float] = {}
    ids: list[str] = []
    original = controller_module.Controller.__init__

    def init(self, *args, **kwargs):
        kwargs["on_event"] = lambda kind, fields: seen.setdefault(kind, time.monotonic())
        original(self, *args, **kwargs)
        ids.append(self.run_id)

    controller_module.Controller.__init__ = init
    try:
        with pytest.raises(RunError) as caught:
            launch(cfg, tmp_path / "run", initial_plan=plan)
    finally:
        controller_module.Controller.__init__ = original
    stopped = time.monotonic()
    message = str(caught.value)
    assert "layers [0, 1, 2] have no live replica" in message and "[0, 2]" in message, message
    assert stopped - seen["fault_injected"] < 10.0
    assert run_processes(ids[0]) == []
    summary = (tmp_path / "run" / "summary.json").read_text()
    assert '"steps": 3' in summary  # steps 0..2 committed before the loss


def test_failure_before_the_first_commit_seeds_instead_of_copying(tmp_path):
    """A node dies inside step 0: nothing has committed, so every layer is still its seeded state
    and the survivors build what they now need themselves (no copies). Copying relied on every
    holder in the first plan having built its layers, which a worker slow to start (a loaded
    machine) may never have done: it was once asked to send a layer it did not hold."""
    cfg = tiny_config(
        **{
            "cluster.nodes": 4,
            "job.fault_tolerance": 1,
            "job.steps": 4,
            "failures.kind": "explicit",
            "failures.events": [{"action": "remove", "step": 0, "nodes": [1], "phase": "forward"}],
        }
    )
    plan = two_pipelines_of_two_nodes()
    outcome, _ = launch(cfg, tmp_path / "run", initial_plan=plan)
    assert [(r["resume_step"], r["removed"], r["bytes_moved"]) for r in outcome.recoveries] == [(0, [1], 0)]
    assert_matches_reference(cfg, outcome, tmp_path / "run")
    assert all(r["replicas_identical"] for r in outcome.recoveries)


def test_every_replica_lost_before_the_first_commit_starts_over(tmp_path):
    """Both first stages die inside step 0: layers 0..2 have no live replica, but nothing has
    committed, so the run plans afresh on the two survivors instead of stopping (compare
    test_lost_layers_stop_cleanly, the same loss after step 2)."""
    cfg = tiny_config(
        **{
            "cluster.nodes": 4,
            "job.fault_tolerance": 1,
            "job.steps": 4,
            "failures.kind": "explicit",
            "failures.events": [{"action": "remove", "step": 0, "nodes": [0, 2], "phase": "forward"}],
        }
    )
    plan = two_pipelines_of_two_nodes()
    outcome, _ = launch(cfg, tmp_path / "run", initial_plan=plan)
    assert [(r["resume_step"], r["removed"], r["bytes_moved"]) for r in outcome.recoveries] == [(0, [0, 2], 0)]
    assert outcome.steps[-1]["nodes"] == 2
    assert_matches_reference(cfg, outcome, tmp_path / "run")


def test_frozen_node_is_caught_by_heartbeat_timeout(tmp_path):
    """SIGSTOP (not a kill): nothing exits, so only the missing heartbeats reveal it."""
    cfg = tiny_config(
        **{
            "cluster.nodes": 3,
            "job.fault_tolerance": 1,
            "job.steps": 6,
            "cluster.heartbeat_timeout_s": 2.0,
            "failures.kind": "explicit",
            "failures.events": [{"action": "freeze", "step": 2, "nodes": [2]}],
        }
    )
    outcome, _ = launch(cfg, tmp_path / "run")
    assert [row["step"] for row in outcome.steps] == list(range(6))
    (recovery,) = outcome.recoveries
    assert recovery["removed"] == [2]
    # detected by the timeout (counted from the last heartbeat, at most one interval before the
    # freeze), not by an exit, which takes milliseconds
    assert recovery["detect_s"] >= cfg.cluster.heartbeat_timeout_s - cfg.cluster.heartbeat_interval_s
    events = (tmp_path / "run" / "events.csv").read_text()
    assert "no heartbeat" in events


def test_failures_at_random_times_lose_nothing(tmp_path):
    """Poisson failures (random victims at random moments, wherever the step happens to be) on 6
    nodes with f=2: three 2-node pipelines, so a shrunk pipeline fetches its missing layers in
    chunks from the two surviving replicas."""
    cfg = tiny_config(
        **{
            "cluster.nodes": 6,
            "job.fault_tolerance": 2,
            "job.steps": 50,
            "failures.kind": "poisson",
            "failures.mtbf_s": 0.7,
            "failures.max_events": 2,
            "failures.seed": 0,  # failures at 1.24 s and 2.13 s of training (steps take ~0.07 s)
        }
    )
    outcome, _ = launch(cfg, tmp_path / "run")
    assert len([r for r in outcome.recoveries if r["removed"]]) == 2
    assert all(r["replicas_identical"] for r in outcome.recoveries)
    # Layers are copied once a step has committed (before that, survivors seed them).
    assert all(r["bytes_moved"] > 0 for r in outcome.recoveries if r["resume_step"] > 0)
    assert any(r["resume_step"] > 0 for r in outcome.recoveries)
    assert_matches_reference(cfg, outcome, tmp_path / "run")


@pytest.mark.parametrize("fork_workers", [True, False], ids=["forked", "execd"])
def test_single_worker_death_is_noticed_by_its_agent(tmp_path, fork_workers):
    """Only one worker process dies (its agent lives): the agent reports the exit at once and the
    controller retires the whole node, then training continues in place. Workers forked by the
    run's fork server (the local default) and exec'd ones (as on Slurm) alike."""
    import os
    import signal
    import threading

    from oobleck.elastic.local import node_processes

    # The kill lands once 3 steps have committed, and no step commits without the dead worker
    # until the recovery: 20 steps leave the killer thread 17 to find it (it scans /proc at once).
    cfg = tiny_config(
        **{
            "cluster.nodes": 3,
            "cluster.fork_workers": fork_workers,
            "job.fault_tolerance": 1,
            "job.steps": 20,
            "failures.kind": "none",
        }
    )
    holder: list = []
    original = controller_module.Controller.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        holder.append(self)

    def strike() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if holder and len(holder[0].outcome.steps) >= 3:
                for pid in node_processes(holder[0].run_id).get(1, {}).get("workers", []):
                    os.kill(pid, signal.SIGKILL)
                    return
            time.sleep(0.01)

    controller_module.Controller.__init__ = init
    killer = threading.Thread(target=strike, daemon=True)
    killer.start()
    try:
        outcome, _ = launch(cfg, tmp_path / "run")
    finally:
        controller_module.Controller.__init__ = original
    killer.join(timeout=5)
    assert [r["removed"] for r in outcome.recoveries] == [[1]]
    assert [row["step"] for row in outcome.steps] == list(range(20))
    events = (tmp_path / "run" / "events.csv").read_text()
    assert "worker 0 exited with code -9" in events


def test_a_strike_armed_for_a_reconfiguration_that_never_comes_is_reported(tmp_path):
    """``phase: reconfigure`` arms the strike for the next reconfiguration; with no other failure
    none comes, so the event never fires: it counts in ``events_not_applied`` and the
    ``schedule_not_finished`` event names it."""
    import pandas as pd

    cfg = tiny_config(
        **{
            "cluster.nodes": 2,  # the strike never fires, so no node is needed beyond f+1 pipelines
            "job.fault_tolerance": 1,
            "job.steps": 5,
            "failures.kind": "explicit",
            # armed a step ahead, once generation 0 runs (armed before it, it would strike while
            # generation 0 forms)
            "failures.events": [{"action": "remove", "step": 3, "nodes": [1], "phase": "reconfigure"}],
        }
    )
    outcome, summary = launch(cfg, tmp_path / "run")
    assert outcome.recoveries == [] and [row["step"] for row in outcome.steps] == list(range(5))
    assert outcome.events_not_applied == 1 and summary["events_not_applied"] == 1
    events = pd.read_csv(tmp_path / "run" / "events.csv")
    (unfinished,) = events[events["kind"] == "schedule_not_finished"].itertuples()
    assert unfinished.remaining_events == 0 and "(phase reconfigure)" in unfinished.armed_not_fired

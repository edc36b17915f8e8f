"""torchft as an external peer, for real (issue 16): its Manager, lighthouse and ProcessGroupGloo on
the harness's own model, batches, faults (real SIGKILL and SIGSTOP) and outputs.

torchft promises that replicas stay bit-identical and that every committed update is the gradient
of the batch it trained; it does not promise to train every batch (a step whose vote fails drops
its batch, as torchft's training loops do). So each run is checked against single-process
training on *the batches it committed* (exact), and against training on every batch (where it
differs, from the first skipped batch on, the run says which batches it skipped).
"""

from __future__ import annotations

import json
import math
import socket
import sys
from urllib.parse import urlparse

import pandas as pd
import pytest

from oobleck.elastic.job import launch, make_strategy
from oobleck.errors import ConfigError, RunError
from oobleck.runtime.reference import train_reference
from oobleck.strategy import Kind, RunState
from testing import assert_matches_reference, tiny_config

STEPS = 300


@pytest.fixture(scope="module")
def torchft_run(tmp_path_factory):
    """4 nodes, one replica group each, a global batch of 4 microbatches. Node 1 is SIGKILLed in
    the all-reduce of step 2 (the survivors' vote fails: that batch is dropped), node 2 freezes
    (SIGSTOP) as step 4 starts (torchft's gloo timeout and the lighthouse's heartbeat timeout
    drop it; the harness's heartbeats catch it and kill it), then a new node joins and heals
    from a live peer. A new worker takes up to ~20 s to boot on a loaded 2-core machine and
    steps are short, hence the long run."""
    cfg = tiny_config(
        "strategy=torchft",
        **{
            "cluster.nodes": 4,
            "job.steps": STEPS,
            "job.global_batch_size": 8,
            "failures.kind": "explicit",
            "failures.events": [
                {"action": "remove", "step": 2, "nodes": [1], "phase": "allreduce"},
                {"action": "remove", "step": 4, "nodes": [2], "freeze": True},
                {"action": "join", "step": 5, "count": 1},
            ],
        },
    )
    run_dir = tmp_path_factory.mktemp("torchft")
    outcome, summary = launch(cfg, run_dir)
    return cfg, outcome, summary, run_dir


def test_committed_updates_equal_training_on_the_batches_committed(torchft_run):
    cfg, outcome, _, run_dir = torchft_run
    batches = [row["batch"] for row in outcome.steps]
    assert_matches_reference(cfg, outcome, run_dir, train_reference(cfg, batches=batches))


def test_the_batch_of_a_failed_vote_is_skipped_and_reported(torchft_run):
    cfg, outcome, _, run_dir = torchft_run
    metrics = pd.read_csv(run_dir / "metrics.csv")
    batches = list(metrics["batch"])
    skipped = sorted(set(range(batches[-1] + 1)) - set(batches))
    assert skipped, "node 1 died inside the all-reduce of step 2: that attempt cannot commit"
    assert int(metrics["skipped_batches"].sum()) == len(skipped)
    assert int(metrics["skipped_samples"].sum()) == len(skipped) * int(cfg.job.global_batch_size)
    first = int(metrics.loc[metrics["skipped_batches"] > 0, "step"].iloc[0])
    assert metrics.loc[first, "attempts"] == 2 and first == 2
    # Against training on every batch, the run is equal up to the skip and differs after it.
    every = train_reference(cfg, steps=first + 3).losses
    for step in range(first):
        assert math.isclose(metrics.loc[step, "loss"], every[step], rel_tol=1e-5)
    assert any(not math.isclose(metrics.loc[s, "loss"], every[s], rel_tol=1e-5) for s in range(first, first + 3))
    assert (metrics["samples"] == int(cfg.job.global_batch_size)).all()  # each update trains a whole batch


def test_a_kill_is_a_continue_recovery_until_the_next_commit(torchft_run):
    _, outcome, summary, run_dir = torchft_run
    recoveries = [r for r in outcome.recoveries if r["kind"] == "continue"]
    assert [r["removed"] for r in recoveries] == [[1], [2]]
    assert all(r["total_s"] > 0 and r["groups_s"] == 0 for r in recoveries)
    assert summary["continues"] == 2 and summary["generations"] == 1  # torchft never needs a new plan
    events = pd.read_csv(run_dir / "events.csv")
    assert list(events.loc[events["kind"] == "continue", "resume_step"]) == [r["resume_step"] for r in recoveries]


def test_a_joining_replica_heals_from_a_peer_and_trains(torchft_run):
    _, outcome, _, run_dir = torchft_run
    metrics = pd.read_csv(run_dir / "metrics.csv")
    healed = metrics[metrics["healed"] == "[4]"]
    assert len(healed) == 1, "node 4 healed exactly once"
    row = healed.iloc[0]
    assert row["heal_s"] > 0 and row["join_to_heal_s"] >= row["heal_s"]
    later = metrics[metrics["step"] >= row["step"]]
    assert later["replicas"].str.contains("4").all()
    assert list(metrics["nodes"].iloc[[0, 2, -1]]) == [4, 3, 3] and metrics["nodes"].min() == 2


def test_replicas_end_bit_identical_and_survivors_never_restarted(torchft_run):
    _, _, _, run_dir = torchft_run
    report = json.loads((run_dir / "torchft.json").read_text())
    assert report["replicas_identical"] is True and report["nodes"] == [0, 3, 4]
    by_node = {r["node"]: r for r in report["replicas"]}
    assert by_node[4]["heals"] and by_node[4]["steps"] == STEPS
    assert all(r["incarnation"] == 0 for r in report["replicas"])
    assert report["failed_votes"] >= 2  # nodes 0 and 3 voted no when node 1 died in the all-reduce


def test_the_lighthouse_is_stopped_with_the_run(torchft_run):
    _, _, _, run_dir = torchft_run
    address = urlparse(json.loads((run_dir / "torchft.json").read_text())["lighthouse"])
    assert address.hostname == "127.0.0.1"  # loopback, as the cluster's master_addr
    with pytest.raises(OSError):
        socket.create_connection((address.hostname, address.port), timeout=2).close()


def test_redone_batches_make_torchft_exactly_once(tmp_path):
    """redo_uncommitted_batches: the batch of a failed vote is trained again (step-indexed data,
    as the harness's own strategies do), so the run equals single-process training on every
    batch. Node 1 dies inside the all-reduce of step 2."""
    cfg = tiny_config(
        "strategy=torchft",
        **{
            "cluster.nodes": 2,
            "job.steps": 5,
            "job.global_batch_size": 8,
            "strategy.redo_uncommitted_batches": True,
            "failures.kind": "explicit",
            "failures.events": [{"action": "remove", "step": 2, "nodes": [1], "phase": "allreduce"}],
        },
    )
    outcome, summary = launch(cfg, tmp_path / "run")
    assert_matches_reference(cfg, outcome, tmp_path / "run")
    (recovery,) = outcome.recoveries
    assert recovery["kind"] == "continue" and recovery["removed"] == [1]
    assert outcome.steps[2]["attempts"] == 2 and [row["batch"] for row in outcome.steps] == [0, 1, 2, 3, 4]
    assert [row["skipped_batches"] for row in outcome.steps] == [0] * 5


# ---------------------------------------------------------------------------------------------
# Decisions and refusals (no processes)


def test_a_model_that_does_not_fit_one_node_is_refused_before_launch(tmp_path):
    small = {"cluster.nodes": 4, "cluster.device_memory_gb": 0.006}
    torchft = make_strategy(tiny_config("strategy=torchft", **small)).start([0, 1, 2, 3])
    assert torchft.kind is Kind.STOP and torchft.out_of_memory
    assert "n0=2" in torchft.reason and "cluster.device_memory_gb=0.006" in torchft.reason and "MB" in torchft.reason
    oobleck = make_strategy(tiny_config(**small)).start([0, 1, 2, 3])
    assert oobleck.kind is Kind.START and all(len(p.nodes) == 2 for p in oobleck.layout.plan.pipelines)
    with pytest.raises(RunError, match="replicates the whole model"):
        launch(tiny_config("strategy=torchft", **small), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_start_is_one_replica_group_per_node_and_changes_continue():
    strategy = make_strategy(tiny_config("strategy=torchft", **{"cluster.nodes": 4}))
    start = strategy.start([0, 1, 2, 3])
    assert start.kind is Kind.START and [p.nodes for p in start.layout.plan.pipelines] == [(0,), (1,), (2,), (3,)]
    assert strategy.worker_module == "baselines.torchft.worker"
    lost = strategy.on_change(RunState(start.layout, alive=(0, 2, 3), removed=(1,), joined=(), step=5))
    assert lost.kind is Kind.CONTINUE and lost.layout.plan == start.layout.plan and "[1]" in lost.reason
    # The dead node stays in the plan: a later join is no new loss.
    joined = strategy.on_change(RunState(lost.layout, alive=(0, 2, 3, 4), removed=(1,), joined=(4,), step=9))
    assert joined.kind is Kind.CONTINUE and joined.reason == ""
    none_left = strategy.on_change(RunState(start.layout, alive=(), removed=(0, 1, 2, 3), joined=(), step=9))
    assert none_left.kind is Kind.STOP and "min_replicas=1" in none_left.reason


def test_layouts_torchft_cannot_run_are_refused_with_the_fix():
    two_gpus = make_strategy(tiny_config("strategy=torchft", **{"cluster.gpus_per_node": 2})).start([0, 1])
    assert two_gpus.kind is Kind.STOP and "cluster.gpus_per_node=2 must be 1" in two_gpus.reason
    crowded = make_strategy(tiny_config("strategy=torchft", **{"cluster.nodes": 9})).start(list(range(9)))
    assert crowded.kind is Kind.STOP and "job.global_batch_size" in crowded.reason
    with pytest.raises(ConfigError, match="strategy.pg_timeout_s=0.0 must be > 0"):
        make_strategy(tiny_config("strategy=torchft", **{"strategy.pg_timeout_s": 0}))


def test_harness_checkpoints_are_refused_before_any_node_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint.every_steps=5; set checkpoint.every_steps=null"):
        launch(tiny_config("strategy=torchft", **{"checkpoint.every_steps": 5}), tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 0 and "neither writes nor resumes" in summary["stopped"]
    assert not (tmp_path / "run" / "torchft.json").exists()  # the lighthouse never started


def test_missing_torchft_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # what an environment without it imports
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[peers\]' \(torchft==0\.2\.0\)"):
        make_strategy(tiny_config("strategy=torchft"))

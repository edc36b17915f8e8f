"""torchft as an external peer, for real (issues 16, 25): its Manager, lighthouse and ProcessGroupGloo
on the harness's own model, batches, faults (real SIGKILL and SIGSTOP) and outputs, in both of its
quorum modes and with replica groups of two nodes.

torchft promises that replicas stay bit-identical and that every committed update is the gradient
of what the replicas trained; it does not promise to train every batch (a step whose vote fails
drops its batch, as torchft's training loops do) nor, with its default asynchronous quorum, every
shard of a batch (a lost replica group's shard is not trained). So each run is checked against
single-process training on *what it committed*: the batches, and the shards of each (exact), and
the run says what it skipped.
"""

from __future__ import annotations

import json
import math
import socket
import sys
from urllib.parse import urlparse

import pandas as pd
import pytest

from baselines.torchft.config import TorchftConfig, detection, replica_shards
from baselines.torchft.groups import resolve_shards, vacant_shard
from baselines.torchft.report import SLOT, Row, rows_of, step_report
from oobleck.elastic.job import launch, make_strategy
from oobleck.errors import ConfigError, RunError
from oobleck.strategy import Kind, RunState
from testing import assert_matches_reference, cached_reference, tiny_config

pytestmark = pytest.mark.slow  # starts processes

# Both runs' lengths only give the joiner (node 4, asked for at step 5) time to boot and heal
# before the run ends: forked from a fork server that has imported torch (tests/conftest.py
# shares one), it healed at step 13 (async) and 12 (sync) under a load average of 6 on 2 cores;
# these leave it over three times that. Every step's update is checked against the reference,
# which trains as many.
ASYNC_STEPS = 48
SYNC_STEPS = 40
BATCH = 16  # 8 microbatches of 2
HEARTBEAT_S = 5.0  # tiny_config's cluster.heartbeat_timeout_s
TWO_NODES_PER_REPLICA = {"cluster.device_memory_gb": 0.006}  # gpt3_tiny then needs n0 = 2 nodes


def committed_reference(cfg, outcome, shards: int):
    """Single-process training on the batches the run committed and, per update, the shards it trained."""
    microbatches = BATCH // int(cfg.job.microbatch_size)
    trained = []
    for row in outcome.steps:
        parts = row.get("shards")
        whole = parts is None or (isinstance(parts, float) and math.isnan(parts))
        trained.append(
            list(range(microbatches))
            if whole
            else [mb for shard in parts for mb in replica_shards(microbatches, shards, shard)]
        )
    return cached_reference(cfg, batches=[row["batch"] for row in outcome.steps], microbatches=trained)


def _run(tmp_path_factory, name: str, *groups: str, **overrides):
    cfg = tiny_config("strategy=torchft", *groups, **{"job.global_batch_size": BATCH, **overrides})
    run_dir = tmp_path_factory.mktemp(name)
    outcome, summary = launch(cfg, run_dir)
    return cfg, outcome, summary, run_dir


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """torchft's default (asynchronous quorum, a fixed shard per replica group): 4 nodes, one
    replica group each. Node 1 is SIGKILLed in the all-reduce of step 2 (the survivors' vote fails:
    that batch is dropped), node 2 freezes (SIGSTOP) as step 4 starts (torchft's gloo timeout and
    the lighthouse's heartbeat timeout drop it; the harness's heartbeats catch it and kill it),
    then a new node joins, heals from a live peer and takes the lowest shard left vacant."""
    return _run(
        tmp_path_factory,
        "torchft_async",
        **{
            "cluster.nodes": 4,
            "job.steps": ASYNC_STEPS,
            "failures.kind": "explicit",
            "failures.events": [
                {"action": "remove", "step": 2, "nodes": [1], "phase": "allreduce"},
                {"action": "remove", "step": 4, "nodes": [2], "freeze": True},
                {"action": "join", "step": 5, "count": 1},
            ],
        },
    )


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    """``strategy.async_quorum=false``: the quorum first, then the batch split over its members. Node 1
    dies in the all-reduce of step 2, a node joins at step 5. The lighthouse's heartbeat timeout is
    overridden (3 s against the run's 5 s): the run says so."""
    return _run(
        tmp_path_factory,
        "torchft_sync",
        **{
            "cluster.nodes": 4,
            "job.steps": SYNC_STEPS,
            "strategy.async_quorum": False,
            "strategy.heartbeat_timeout_ms": 3000,
            "failures.kind": "explicit",
            "failures.events": [
                {"action": "remove", "step": 2, "nodes": [1], "phase": "allreduce"},
                {"action": "join", "step": 5, "count": 1},
            ],
        },
    )


@pytest.mark.parametrize("mode", ["async_run", "sync_run"])
def test_committed_updates_equal_training_on_what_they_committed(mode, request):
    cfg, outcome, _, run_dir = request.getfixturevalue(mode)
    assert_matches_reference(cfg, outcome, run_dir, committed_reference(cfg, outcome, shards=4))


@pytest.mark.parametrize("mode", ["async_run", "sync_run"])
def test_the_batch_of_a_failed_vote_is_skipped_and_reported(mode, request):
    cfg, outcome, _, run_dir = request.getfixturevalue(mode)
    metrics = pd.read_csv(run_dir / "metrics.csv")
    batches = list(metrics["batch"])
    skipped = sorted(set(range(batches[-1] + 1)) - set(batches))
    assert skipped, "node 1 died inside the all-reduce of step 2: that attempt cannot commit"
    assert int(metrics["skipped_batches"].sum()) == len(skipped)
    lost_shards = int(BATCH * len(metrics) - metrics["samples"].sum())
    assert int(metrics["skipped_samples"].sum()) == len(skipped) * BATCH + lost_shards
    first = int(metrics.loc[metrics["skipped_batches"] > 0, "step"].iloc[0])
    assert metrics.loc[first, "attempts"] == 2 and first == 2
    # Against training on every batch, the run is equal up to the skip and differs after it.
    every = cached_reference(cfg, steps=first + 3).losses
    for step in range(first):
        assert math.isclose(metrics.loc[step, "loss"], every[step], rel_tol=1e-5)
    assert any(not math.isclose(metrics.loc[s, "loss"], every[s], rel_tol=1e-5) for s in range(first, first + 3))


def test_async_replicas_train_their_own_shard_and_a_lost_ones_is_skipped(async_run):
    _, outcome, _, run_dir = async_run
    metrics = pd.read_csv(run_dir / "metrics.csv")
    shards = [json.loads(s) for s in metrics["shards"]]
    assert shards[0] == [0, 1, 2, 3] and metrics.loc[0, "samples"] == BATCH
    assert shards[2] == [0, 2, 3] and metrics.loc[2, "skipped_samples"] == BATCH + BATCH // 4  # batch 2, shard 1
    # Node 2's shard goes when it freezes; the joiner (node 4) heals and takes shard 1, the lowest vacant.
    healed = metrics[metrics["healed"] == "[4]"]
    assert len(healed) == 1
    after = metrics[metrics["step"] >= healed.iloc[0]["step"]]
    assert all(json.loads(s) == [0, 1, 3] for s in after["shards"]) and (after["samples"] == 12).all()
    assert (metrics["samples"] == [len(s) * BATCH // 4 for s in shards]).all()
    assert metrics["quorum_s"].median() < 0.05  # the quorum overlaps the forward pass


def test_sync_updates_train_the_whole_batch(sync_run):
    _, outcome, _, run_dir = sync_run
    metrics = pd.read_csv(run_dir / "metrics.csv")
    assert (metrics["samples"] == BATCH).all() and metrics["shards"].isna().all()
    assert list(metrics["nodes"].iloc[[0, 2, -1]]) == [4, 3, 4]


@pytest.mark.parametrize("mode", ["async_run", "sync_run"])
def test_a_kill_is_a_continue_recovery_bounded_by_the_detection_timeout(mode, request):
    _, outcome, summary, run_dir = request.getfixturevalue(mode)
    recoveries = [r for r in outcome.recoveries if r["kind"] == "continue"]
    assert [r["removed"] for r in recoveries] == ([[1], [2]] if mode == "async_run" else [[1]])
    assert all(r["groups_s"] == 0 for r in recoveries)
    assert summary["generations"] == 1  # torchft never needs a new plan
    events = pd.read_csv(run_dir / "events.csv")
    assert list(events.loc[events["kind"] == "continue", "resume_step"]) == [r["resume_step"] for r in recoveries]
    report = json.loads((run_dir / "torchft.json").read_text())["detection"]
    if mode == "async_run":  # derived from the run's heartbeat timeout
        assert report["heartbeat_timeout_s"] == report["pg_timeout_s"] == HEARTBEAT_S and not report["overrides"]
    else:
        assert report["heartbeat_timeout_s"] == 3.0 and report["pg_timeout_s"] == HEARTBEAT_S
        assert report["overrides"] == ["strategy.heartbeat_timeout_ms=3000"] and "override" in report["source"]
    # The lighthouse forms no quorum without the dead replica until its heartbeats are that old.
    assert recoveries[0]["total_s"] >= 0.9 * report["heartbeat_timeout_s"]


@pytest.mark.parametrize("mode", ["async_run", "sync_run"])
def test_a_joining_replica_heals_from_a_peer_and_replicas_end_identical(mode, request):
    _, outcome, _, run_dir = request.getfixturevalue(mode)
    metrics = pd.read_csv(run_dir / "metrics.csv")
    healed = metrics[metrics["healed"] == "[4]"]
    assert len(healed) == 1, "node 4 healed exactly once"
    row = healed.iloc[0]
    assert row["heal_s"] > 0 and row["join_to_heal_s"] >= row["heal_s"]
    assert metrics[metrics["step"] >= row["step"]]["replicas"].str.contains("4").all()
    report = json.loads((run_dir / "torchft.json").read_text())
    survivors = [0, 3, 4] if mode == "async_run" else [0, 2, 3, 4]
    assert report["replicas_identical"] is True and report["nodes"] == survivors
    by_node = {r["node"]: r for r in report["replicas"]}
    assert by_node[4]["heals"] and by_node[4]["steps"] == int(metrics["step"].iloc[-1]) + 1
    assert all(r["incarnation"] == 0 for r in report["replicas"])
    assert report["failed_votes"] >= 2  # the survivors voted no when node 1 died in the all-reduce


def test_the_lighthouse_is_stopped_with_the_run(async_run):
    _, _, _, run_dir = async_run
    address = urlparse(json.loads((run_dir / "torchft.json").read_text())["lighthouse"])
    assert address.hostname == "127.0.0.1"  # loopback, as the cluster's master_addr
    with pytest.raises(OSError):
        socket.create_connection((address.hostname, address.port), timeout=2).close()


def test_groups_of_two_nodes_run_a_model_one_node_cannot_hold(tmp_path_factory):
    """gpt3_tiny at 6 MB per device needs two nodes: two replica groups of two nodes (a 2-stage
    pipeline each, a Manager per node), each training its shard. Node 3 (group 1's second stage) is
    SIGKILLed in the backward pass of step 3: group 1 is broken, node 2 leaves, group 0 trains on
    alone with its shard; a node joining at step 5 stands by."""
    cfg, outcome, _, run_dir = _run(
        tmp_path_factory,
        "torchft_groups",
        **{
            **TWO_NODES_PER_REPLICA,
            "strategy.nodes_per_replica": 2,
            "cluster.nodes": 4,
            "job.steps": 30,
            "failures.kind": "explicit",
            "failures.events": [
                {"action": "remove", "step": 3, "nodes": [3], "phase": "backward"},
                {"action": "join", "step": 5, "count": 1},
            ],
        },
    )
    assert_matches_reference(cfg, outcome, run_dir, committed_reference(cfg, outcome, shards=2))
    (recovery,) = outcome.recoveries
    assert recovery["kind"] == "continue" and recovery["removed"] == [2, 3]
    metrics = pd.read_csv(run_dir / "metrics.csv")
    assert json.loads(metrics["shards"].iloc[0]) == [0, 1] and json.loads(metrics["shards"].iloc[-1]) == [0]
    assert list(metrics["nodes"].iloc[[0, -1]]) == [4, 2] and metrics["replicas"].iloc[-1] == "[0]"
    report = json.loads((run_dir / "torchft.json").read_text())
    assert report["replicas_identical"] is True and report["nodes"] == [0, 1]
    left = {r["node"]: r for r in report["replicas"]}[2]
    assert not left["finished"] and "replica group" in left["left"]
    events = pd.read_csv(run_dir / "events.csv")
    assert "standby" in set(events["kind"])


def test_groups_of_two_nodes_survive_losing_the_node_hosting_a_groups_store(tmp_path):
    """Synchronous quorum, groups [0, 1] and [2, 3]; node 2 (group 1's first node: its TCPStore and
    its Manager server) dies in the all-reduce of step 3. Group 0 trains on with the whole batch."""
    cfg = tiny_config(
        "strategy=torchft",
        **{
            **TWO_NODES_PER_REPLICA,
            "strategy.nodes_per_replica": 2,
            "strategy.async_quorum": False,
            "cluster.nodes": 4,
            "job.global_batch_size": BATCH,
            "job.steps": 12,
            "failures.kind": "explicit",
            "failures.events": [{"action": "remove", "step": 3, "nodes": [2], "phase": "allreduce"}],
        },
    )
    outcome, _ = launch(cfg, tmp_path / "run")
    assert_matches_reference(cfg, outcome, tmp_path / "run", committed_reference(cfg, outcome, shards=2))
    (recovery,) = outcome.recoveries
    assert recovery["removed"] == [2, 3] and outcome.steps[-1]["nodes"] == 2
    assert all(row["samples"] == BATCH for row in outcome.steps)


def test_redone_batches_make_torchft_exactly_once(tmp_path):
    """redo_uncommitted_batches with the synchronous quorum: the batch of a failed vote is trained
    again (step-indexed data, as the harness's own strategies do) and every update trains the whole
    batch, so the run equals single-process training on every batch. Node 1 dies inside the
    all-reduce of step 2."""
    cfg = tiny_config(
        "strategy=torchft",
        **{
            "cluster.nodes": 2,
            "job.steps": 5,
            "job.global_batch_size": 8,
            "strategy.async_quorum": False,
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
# Decisions, refusals and the pure parts (no processes)


def test_a_model_that_does_not_fit_one_node_is_refused_and_groups_of_two_fit(tmp_path):
    small = {**TWO_NODES_PER_REPLICA, "cluster.nodes": 4}
    torchft = make_strategy(tiny_config("strategy=torchft", **small)).start([0, 1, 2, 3])
    assert torchft.kind is Kind.STOP and torchft.out_of_memory
    assert "n0=2" in torchft.reason and "cluster.device_memory_gb=0.006" in torchft.reason and "MB" in torchft.reason
    assert "set strategy.nodes_per_replica=2" in torchft.reason
    with pytest.raises(RunError, match="cannot hold gpt3_tiny"):
        launch(tiny_config("strategy=torchft", **small), tmp_path / "run")
    assert not (tmp_path / "run").exists()
    pairs = make_strategy(tiny_config("strategy=torchft", **{**small, "strategy.nodes_per_replica": 2}))
    start = pairs.start(range(5))
    assert start.kind is Kind.START and [p.nodes for p in start.layout.plan.pipelines] == [(0, 1), (2, 3)]
    assert start.layout.standby == (4,) and start.layout.description == "torchft: 2 replica groups of 2 nodes"
    lost = pairs.on_change(RunState(start.layout, alive=(0, 1, 2, 4), removed=(3,), joined=(), step=5))
    assert lost.kind is Kind.CONTINUE and "[3]" in lost.reason
    joined = pairs.on_change(RunState(lost.layout, alive=(0, 1, 2, 4, 5), removed=(3,), joined=(5,), step=9))
    assert joined.kind is Kind.CONTINUE and joined.layout.standby == (4, 5) and "stand by" in joined.reason
    broken = pairs.on_change(RunState(start.layout, alive=(0, 2, 4), removed=(1, 3), joined=(), step=9))
    assert broken.kind is Kind.STOP and "0 replica group(s)" in broken.reason and "min_replicas=1" in broken.reason


def test_start_is_one_replica_group_per_node_and_changes_continue():
    strategy = make_strategy(tiny_config("strategy=torchft", **{"cluster.nodes": 4}))
    start = strategy.start([0, 1, 2, 3])
    assert start.kind is Kind.START and [p.nodes for p in start.layout.plan.pipelines] == [(0,), (1,), (2,), (3,)]
    assert strategy.worker_module == "baselines.torchft.worker"
    lost = strategy.on_change(RunState(start.layout, alive=(0, 2, 3), removed=(1,), joined=(), step=5))
    assert lost.kind is Kind.CONTINUE and lost.layout.plan == start.layout.plan and "[1]" in lost.reason
    # The dead node stays in the plan: a later join is no new loss, and the joiner works.
    joined = strategy.on_change(RunState(lost.layout, alive=(0, 2, 3, 4), removed=(1,), joined=(4,), step=9))
    assert joined.kind is Kind.CONTINUE and joined.reason == "" and joined.layout.standby == ()
    none_left = strategy.on_change(RunState(start.layout, alive=(), removed=(0, 1, 2, 3), joined=(), step=9))
    assert none_left.kind is Kind.STOP and "min_replicas=1" in none_left.reason


def test_layouts_torchft_cannot_run_are_refused_with_the_fix():
    two_gpus = make_strategy(tiny_config("strategy=torchft", **{"cluster.gpus_per_node": 2})).start([0, 1])
    assert two_gpus.kind is Kind.STOP and "cluster.gpus_per_node=2 must be 1" in two_gpus.reason
    crowded = make_strategy(
        tiny_config("strategy=torchft", **{"cluster.nodes": 9, "strategy.async_quorum": False})
    ).start(list(range(9)))
    assert crowded.kind is Kind.STOP and "raise job.global_batch_size" in crowded.reason
    uneven = make_strategy(tiny_config("strategy=torchft", **{"cluster.nodes": 3})).start([0, 1, 2])
    assert (
        uneven.kind is Kind.STOP
        and "strategy.async_quorum=false" in uneven.reason
        and "8 microbatches" in uneven.reason
    )
    split = make_strategy(tiny_config("strategy=torchft", **{"cluster.nodes": 3, "strategy.async_quorum": False}))
    assert split.start([0, 1, 2]).kind is Kind.START  # the synchronous quorum splits any batch
    for key, value, bound in (
        ("pg_timeout_s", 0, "> 0"),
        ("nodes_per_replica", 0, "> 0"),
        ("join_timeout_ms", -1, ">= 0"),
    ):
        with pytest.raises(ConfigError, match=rf"strategy.{key}={value}(\.0)? must be {bound}"):
            make_strategy(tiny_config("strategy=torchft", **{f"strategy.{key}": value}))


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


def test_detection_derives_from_the_runs_heartbeat_timeout_unless_overridden():
    derived = detection(TorchftConfig(), 10.0)
    assert derived.heartbeat_timeout_ms == 10_000 and derived.pg_timeout_s == 10.0 and not derived.overrides
    assert "the harness's own detection timeout" in derived.describe(10.0)
    overridden = detection(TorchftConfig(heartbeat_timeout_ms=5000, pg_timeout_s=5.0), 10.0)
    assert overridden.heartbeat_timeout_ms == 5000 and overridden.pg_timeout_s == 5.0
    assert overridden.overrides == ("strategy.heartbeat_timeout_ms=5000", "strategy.pg_timeout_s=5.0")
    assert "different timeouts" in overridden.describe(10.0)


def test_shards_are_fixed_and_conflicts_resolve_the_same_everywhere():
    assert list(replica_shards(8, 4, 1)) == [2, 3] and list(replica_shards(8, 2, 1)) == [4, 5, 6, 7]
    assert vacant_shard([0, 2, 3], 4, fallback=0) == 1 and vacant_shard([0, 1], 2, fallback=1) == 1
    # Two joiners (4 and 5) took shard 1; 5 moves to the lowest shard nobody trained (2).
    assert resolve_shards([(0, 0), (4, 1), (5, 1), (3, 3)], 4) == {0: 0, 4: 1, 5: 2, 3: 3}
    # No vacant shard left: the later replica keeps its duplicate (both train it, counted twice).
    assert resolve_shards([(0, 0), (1, 1), (2, 1)], 2) == {0: 0, 1: 1, 2: 1}


def test_a_steps_report_accounts_for_every_shard_and_heal():
    rows = [Row(0, 0), Row(4, 1, heal_s=0.5, join_to_heal_s=2.0), Row(3, 3)]
    # Each participant fills its own slot; a non-participant's slot stays zero: nobody.
    assert rows_of([0.0] * SLOT + rows[0].values() + rows[1].values() + [0.0] * SLOT) == rows[:2]
    report = step_report(
        rows,
        loss_sum=33.0,
        batch=7,
        batch_size=16,
        shards=4,
        skipped_batches=1,
        attempts=2,
        nodes_per_replica=1,
        quorum_s=0.1,
    )
    assert report["samples"] == 12 and report["shards"] == [0, 1, 3] and report["skipped_samples"] == 16 + 4
    assert report["healed"] == [4] and report["heal_s"] == 0.5 and report["join_to_heal_s"] == 2.0
    assert report["replicas"] == [0, 3, 4] and report["nodes"] == 3
    whole = step_report(
        rows,
        loss_sum=33.0,
        batch=7,
        batch_size=16,
        shards=None,
        skipped_batches=0,
        attempts=1,
        nodes_per_replica=2,
        quorum_s=0.0,
    )
    assert whole["samples"] == 16 and whole["shards"] is None and whole["skipped_samples"] == 0 and whole["nodes"] == 6

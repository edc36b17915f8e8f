"""The step ledger's view of the workers' decisions: the decision values, the decision watch that
wakes the controller's loop, and commits recorded as they happen without the loop polling."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from oobleck.elastic import controller as controller_module
from oobleck.elastic.job import launch
from oobleck.elastic.ledger import DecisionWatch
from oobleck.runtime import keys
from oobleck.runtime.sealed_store import SealedStore
from testing import tiny_config

pytestmark = pytest.mark.slow  # starts processes

SPACE = keys.KeySpace("run-secret")


def test_a_commit_decision_carries_its_kind_and_step_time():
    plain, checkpointed = keys.commit_decision(False, 0.125), keys.commit_decision(True, 2.5)
    assert keys.is_commit(plain) and keys.is_commit(checkpointed) and not keys.is_commit(keys.ABORT)
    assert keys.decision_kind(plain) == keys.COMMIT and keys.decision_kind(checkpointed) == keys.COMMIT_CHECKPOINT
    assert keys.decision_step_time(plain) == 0.125 and keys.decision_step_time(checkpointed) == 2.5
    assert keys.decision_kind(keys.ABORT) == keys.ABORT and keys.decision_step_time(keys.ABORT) is None


@pytest.mark.parametrize("value", ["commit+checkpoint xyz", "commit", "commit -1.0", "commit nan", "abort 1", "", "x"])
def test_a_malformed_decision_value_is_refused_not_acted_on(value):
    with pytest.raises(ValueError, match="decision value|could not convert"):
        keys.parse_decision(value)


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    yield SealedStore(server, SPACE)


def client(server) -> SealedStore:
    raw = dist.TCPStore(
        "127.0.0.1", server.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    return SealedStore(raw, SPACE)


def test_the_decision_watch_wakes_once_per_followed_key_and_closes(store):
    woken = threading.Semaphore(0)
    watch = DecisionWatch(client(store), woken.release, dist.DistStoreError)
    watch.follow("g0/decision/0")
    assert not watch.take()
    store.set("g0/decision/0", keys.commit_decision(False, 0.1))
    assert woken.acquire(timeout=30)
    assert watch.take() and not watch.take()  # taken once
    # Following a key that is already set wakes at once; one that is not yet set, when it is.
    store.set("g0/decision/1", keys.ABORT)
    watch.follow("g0/decision/1")
    assert woken.acquire(timeout=30) and watch.take()
    watch.follow("g1/decision/1")
    store.compare_set("g1/decision/1", "", keys.ABORT)  # as the controller's own abort does
    assert woken.acquire(timeout=30) and watch.take()
    watch.follow(None)  # nothing awaited: the thread parks
    watch.close()
    assert not watch._thread.is_alive()


def test_the_decision_watch_ends_when_its_store_goes():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    watch = DecisionWatch(client(server), lambda: None, dist.DistStoreError)
    watch.follow("g0/decision/0")
    del server
    watch._thread.join(timeout=30)
    assert not watch._thread.is_alive()


def test_commits_are_recorded_as_they_are_decided_without_polling(tmp_path, monkeypatch):
    """With the loop's fall-back poll turned off, and the heartbeat checks (which look at commits
    too) too rare to matter, only the decision watch can make the controller see a commit while
    training runs (else the ledger reads them all when the workers exit)."""
    monkeypatch.setattr(controller_module, "COMMIT_POLL_S", 1e9)
    cfg = tiny_config(
        **{
            "cluster.nodes": 2,
            "job.fault_tolerance": 1,
            "job.steps": 12,
            "cluster.heartbeat_interval_s": 30.0,
            "cluster.heartbeat_timeout_s": 120.0,
        }
    )
    seen_while_training: list[bool] = []
    carried: list[bool] = []

    def watch(controller) -> None:
        def on_step(row: dict) -> None:
            generation = controller.ledger.generation
            seen_while_training.append(not controller.store.check([keys.decision(generation, cfg.job.steps - 1)]))
            decided = controller.store.get(keys.decision(generation, row["step"])).decode()
            carried.append(row["step_time_s"] == keys.decision_step_time(decided))

        controller.on_step = on_step

    outcome, _ = launch(cfg, tmp_path / "run", on_start=watch)
    assert [row["step"] for row in outcome.steps] == list(range(12))
    # Every step but the last few is recorded before the last step is even decided.
    assert sum(seen_while_training[:6]) == 6, seen_while_training
    assert all(carried)  # each row's step time is the one its decision carries

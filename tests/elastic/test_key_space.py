"""The run's key space (``oobleck.runtime.keys.KeySpace``) and the store client that speaks it.

A client without the run's secret can neither name a key before the run writes it (so it cannot
pre-empt a ``compare_set`` nor set a key the run waits for) nor write a value the run accepts; a
value it overwrites is dropped with one log line where it is read, never acted on.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch.distributed as dist

from oobleck.errors import RunError
from oobleck.runtime import keys
from oobleck.runtime.sealed_store import MAX_DROP_LINES, ForeignValue, SealedStore

SPACE = keys.KeySpace("the run's secret")


@pytest.fixture
def server():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_names_are_the_run_s_own_and_values_are_bound_to_their_key():
    name = SPACE.name(keys.decision(3, 7))
    assert name.startswith("g3/decision/7@") and name == keys.KeySpace("the run's secret").name(keys.decision(3, 7))
    assert name != keys.KeySpace("a guess").name(keys.decision(3, 7))  # another secret, another name
    assert SPACE.name(keys.decision(3, 8)) != name
    sealed = SPACE.seal(keys.abort(3), "1")
    assert SPACE.unseal(keys.abort(3), sealed) == b"1"
    assert SPACE.unseal(keys.abort(4), sealed) is None  # not replayable under another key
    assert SPACE.unseal(keys.abort(3), b"1") is None  # unsealed
    assert keys.KeySpace("a guess").unseal(keys.abort(3), sealed) is None
    with pytest.raises(ValueError, match="secret"):
        keys.KeySpace("")


def test_a_worker_without_the_secret_in_its_environment_is_told_how_to_start(monkeypatch):
    monkeypatch.delenv(keys.SECRET_ENV, raising=False)
    with pytest.raises(RunError, match=f"{keys.SECRET_ENV} is not set"):
        keys.KeySpace.from_environment()


def test_a_stranger_s_pre_emptive_compare_set_does_not_touch_the_run_s_decision(server):
    store = SealedStore(server, SPACE)
    # What an attacker who knows the protocol but not the secret can write: the logical names.
    server.compare_set(keys.decision(0, 5), "", keys.ABORT)
    server.set(keys.abort(0), "1")
    server.set(keys.CHECKPOINT_REQUEST, "garbage")
    assert not store.check([keys.abort(0)]) and store.read(keys.CHECKPOINT_REQUEST) is None
    proposal = keys.commit_decision(False, 0.5)
    assert store.compare_set(keys.decision(0, 5), "", proposal).decode() == proposal  # the run's vote stands
    assert store.compare_set(keys.decision(0, 5), "", keys.ABORT).decode() == proposal  # and is what others see


def test_an_overwritten_value_is_dropped_with_one_line(server, capfd):
    store = SealedStore(server, SPACE)
    store.set(keys.strike(1), json.dumps({"step": 3, "phase": "forward", "kind": "remove"}))
    visible = SPACE.name(keys.strike(1))  # a client that lists the store's keys sees this name
    assert visible in server.list_keys()
    server.set(visible, json.dumps({"step": 0, "phase": "forward", "kind": "remove"}))
    assert store.read(keys.strike(1)) is None and store.read(keys.strike(1)) is None
    with pytest.raises(ForeignValue, match="not written by this run"):
        store.get(keys.strike(1))
    err = capfd.readouterr().err
    assert err.count("dropped the value of store key 'strike/1'") == 1, err  # one line, however often read


def test_a_malformed_value_is_dropped_and_a_flood_is_summarised(server, capfd):
    store = SealedStore(server, SPACE)
    store.set(keys.CHECKPOINT_REQUEST, "garbage")  # sealed but not a step: dropped where it is parsed
    assert store.read(keys.CHECKPOINT_REQUEST, keys.parse_step) is None
    assert "it is malformed" in capfd.readouterr().err
    names = [keys.loss(0, step, 0) for step in range(MAX_DROP_LINES + 5)]
    for name in names:
        server.set(SPACE.name(name), "forged")
    assert store.read_present([*names, keys.loss(1, 0, 0)]) == dict.fromkeys(names)  # the missing one is absent
    err = capfd.readouterr().err
    assert err.count("dropped the value") == MAX_DROP_LINES - 1 and err.count("only the first") == 1, err

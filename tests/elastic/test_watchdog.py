"""Worker liveness: the heartbeat a worker writes and the controller's rules for who did not answer."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from oobleck.elastic.watchdog import Beat, WorkerBeats, parse_beat, stranded, unanswered
from oobleck.runtime import keys
from oobleck.runtime.liveness import Liveness
from oobleck.runtime.sealed_store import SealedStore

SPACE = keys.KeySpace("run-secret")
GEN = 3
TIMEOUT = 10.0


def waits(on, *, waited=TIMEOUT + 1, what="all-reducing gradients", generation=GEN):
    """A beat of a rank waiting ``waited`` seconds on ``on`` (None: every rank)."""
    return lambda rank: Beat(7, generation, rank, what, None if on is None else tuple(on), waited)


def computes(generation=GEN):
    return lambda rank: Beat(7, generation, rank, None, None, 0.0)


def beats(**states):
    """rank name r<k> -> a beat maker (or None: no fresh beat)."""
    return {int(name[1:]): (make(int(name[1:])) if make is not None else None) for name, make in states.items()}


def test_no_verdict_while_every_wait_is_within_the_timeout():
    assert unanswered(beats(r0=waits([1], waited=TIMEOUT - 1), r1=computes()), GEN, TIMEOUT) is None


def test_a_chain_of_waits_ends_at_the_rank_that_computes():
    # 0 waits on 1, 1 waits on 2, 2 is busy (hung in a call): only 2 did not answer.
    verdict = unanswered(beats(r0=waits([1]), r1=waits([2], waited=3.0), r2=computes(), r3=computes()), GEN, TIMEOUT)
    assert verdict is not None and verdict.waiter == 0 and verdict.culprits == (2,)
    assert verdict.what == "all-reducing gradients" and verdict.waited_s == TIMEOUT + 1


def test_a_rank_without_a_fresh_beat_or_in_an_older_generation_did_not_answer():
    verdict = unanswered(beats(r0=waits([1, 2]), r1=None, r2=computes(generation=GEN - 1)), GEN, TIMEOUT)
    assert verdict is not None and verdict.culprits == (1, 2)


def test_a_wait_on_every_rank_blames_every_rank_that_is_not_waiting():
    verdict = unanswered(
        beats(r0=waits(None, what="the commit decision of step 4"), r1=waits(None, waited=1.0), r2=computes()),
        GEN,
        TIMEOUT,
    )
    assert verdict is not None and verdict.culprits == (2,) and verdict.what == "the commit decision of step 4"


def test_waits_in_a_cycle_blame_nobody():
    verdict = unanswered(beats(r0=waits([1]), r1=waits([0], waited=2.0)), GEN, TIMEOUT)
    assert verdict is not None and verdict.culprits == ()


def _store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_parse_beat_takes_only_well_formed_beats():
    good = {"count": 1, "generation": 0, "rank": 2, "wait": None, "peers": None, "waited_s": 0.0}
    assert parse_beat(json.dumps(good).encode()) == Beat(1, 0, 2, None, None, 0.0)
    assert parse_beat(json.dumps({**good, "awaiting": 1}).encode()).awaiting == 1
    for bad in (json.dumps({**good, "peers": "x"}), "[", "\xff\xfe", json.dumps({**good, "count": None})):
        with pytest.raises((ValueError, TypeError, KeyError)):
            parse_beat(bad.encode("utf-8", "surrogateescape"))


def test_a_worker_heartbeat_carries_its_wait_and_stops_when_the_worker_does():
    store = SealedStore(_store(), SPACE)
    client = dist.TCPStore(
        "127.0.0.1", store.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    key = keys.heartbeat(1, 0, 0)
    liveness = Liveness(SealedStore(client, SPACE), key, interval_s=0.05)
    try:
        first = parse_beat(store.get(key))  # written before the worker registers
        assert first.generation == -1 and first.wait is None and first.awaiting is None
        liveness.enter(GEN, 2)
        with liveness.waiting("receiving activations of microbatch 0", (1,)):
            time.sleep(0.3)
            beat = parse_beat(store.get(key))
        assert (beat.generation, beat.rank, beat.peers) == (GEN, 2, (1,))
        assert beat.wait == "receiving activations of microbatch 0" and beat.waited_s > 0.1 and beat.count > first.count
        time.sleep(0.15)
        after = parse_beat(store.get(key))
        assert after.wait is None
        with liveness.awaiting(GEN + 1):
            time.sleep(0.15)
            waiting = parse_beat(store.get(key))
        assert waiting.awaiting == GEN + 1 and waiting.peers == () and waiting.generation == GEN
    finally:
        liveness.stop()
    time.sleep(0.2)
    stopped = parse_beat(store.get(key)).count
    time.sleep(0.3)
    assert parse_beat(store.get(key)).count == stopped


def test_worker_beats_count_only_moves_of_the_counter():
    seen = WorkerBeats()
    beat = Beat(1, 0, 0, None, None, 0.0)
    seen.update("k", beat, now=100.0)
    seen.update("k", beat, now=105.0)  # the same count again: no beat
    seen.update("k", None, now=106.0)  # a forged or unreadable value: no beat either
    assert seen.since("k") == 100.0
    seen.update("k", Beat(2, 0, 0, None, None, 0.0), now=107.0)
    assert seen.since("k") == 107.0


def test_a_rank_that_left_its_generation_is_stranded_only_past_the_timeout():
    left = Beat(5, GEN, 1, "generation 4", (), TIMEOUT + 1.0, awaiting=GEN + 1)
    early = Beat(5, GEN, 2, "generation 4", (), 1.0, awaiting=GEN + 1)
    standby = Beat(5, GEN, -1, "generation 4", (), TIMEOUT + 1.0, awaiting=GEN + 1)  # not in the plan
    beats = {0: waits([1])(0), 1: left, 2: early, 3: standby}
    assert stranded(beats, GEN, TIMEOUT) == (1,)
    # A rank waiting for the next generation is not waiting on a collective: it blames nobody.
    assert unanswered({1: left}, GEN, TIMEOUT) is None

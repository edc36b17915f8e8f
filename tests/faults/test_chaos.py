"""The chaos suite (issue 18): a random fault loop on a real local cluster, checked end to end.

One run of gpt3_tiny (f=1) starts on ``NODES`` local nodes while the schedule keeps joining nodes
(``JOINS`` of one node each, one booting at a time). A seeded chaos thread waits until the run is
settled (no failure or join in flight, ``GAP`` steps committed in the current generation, at least
``MIN_ALIVE`` nodes left after the fault) and hits one node of the plan, never two at once, with
the next fault of a seeded shuffle that holds every kind: SIGKILL of one worker, of the agent alone,
of the whole node; SIGSTOP of one worker or of the agent alone (only heartbeats reveal those); or
a strike armed through the store (signed with the run's secret, as the injector does) that kills
or freezes the node at a phase of the next step: forward, backward, gradient all-reduce,
or optimizer. (A second failure while a recovery forms is tested on chosen nodes in
``tests/faults/test_recovery.py``: at random, with f=1, it may take a layer's last replica.) Node 0 is
never hit: it is the survivor whose resources are watched. Then:

- the run equals single-process training (losses and final parameters), with every step
  committed once, in order, and every generation's replicas bit-identical;
- at least 25 generations; every fault became a failure with the cause its kind implies, and the
  detection time of a freeze is the heartbeat timeout (not 0);
- the survivor's threads, descriptors, sockets and memory, and the controller's, stay flat; the
  controller keeps no CLOSE-WAIT socket of a dead agent;
- afterwards no process of the run is alive and neither of its ports listens.

What it asserts does not depend on timing; only which fault lands where does.

Opt-in (``OOBLECK_CHAOS=1``): measured on this project's shared 2-core machine under a load
average of ~17 from other jobs, the fault loop took 506 s (25 generation changes, 16 faults) and
the reference training after it more than the 600 s hang guard, far past the suite's budget of
90 s for it. Every boot of a joining node (a torch import) is what costs, one at a time.
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import threading
import time

import pytest

from oobleck.elastic.job import launch
from oobleck.elastic.local import node_processes, run_processes
from oobleck.runtime import keys
from oobleck.runtime.testing import assert_matches_reference, tcp_states, tiny_config
from oobleck.runtime.worker import resource_probe

pytestmark = pytest.mark.skipif(
    os.environ.get("OOBLECK_CHAOS") != "1",
    reason="the chaos fault loop takes minutes on 2 shared cores; run it with OOBLECK_CHAOS=1",
)

SEED = 18
NODES = 10
# One node per join: a generation per boot. Boots are what costs (a worker imports torch), and
# the schedule starts a join only once the last is up, so they come one at a time; the nodes
# started at launch boot together, so most of the 25 generations come from them.
JOINS, JOIN_SIZE = 9, 1
STEPS = 900  # ~90 steps per join boot on this machine under load, ~70 idle
GAP = 3  # steps committed after a recovery before the next fault
MIN_ALIVE = 3  # never hit a node when fewer would be left than this (f+1 pipelines and a spare)
FAULTS = 16  # with the joins, 25 generation changes
SURVIVOR = 0
HEARTBEAT_TIMEOUT_S = 2.5
# A strike while a reconfiguration forms is a second failure during a recovery: with f=1 it may
# hit the last replica of a layer, which no recovery survives (tests/faults/test_recovery.py
# covers it on a chosen node). The chaos loop hits one node at a time.
PHASES = ("forward", "backward", "allreduce", "optimizer")
KINDS = ("kill_worker", "kill_agent", "kill_node", "freeze_worker", "freeze_agent", *(f"strike_{p}" for p in PHASES))
# What the controller must say each kind was (events.csv, the failure's reason).
REASONS = {
    "kill_worker": ("exited with code -9",),
    "kill_agent": ("agent connection closed",),
    "kill_node": ("agent connection closed", "exited with code -9"),
    "freeze_worker": ("sent no heartbeat",),
    "freeze_agent": ("no heartbeat for",),
}


class Chaos:
    """The fault loop (a thread); ``hits`` records (kind, node, generation when struck)."""

    def __init__(self) -> None:
        self.rng = random.Random(SEED)
        self.controller = None
        self.hits: list[tuple[str, int]] = []
        self.samples: list[dict] = []  # the controller's resources after each recovery
        self.ports: list[int] = []  # the store's and the agent port
        self.error: BaseException | None = None
        self._stop = threading.Event()

    def start(self, controller) -> None:
        """``launch``'s ``on_start``: watch the controller's events, strike once training runs."""
        self.controller = controller
        controller.on_event = self.on_event
        self.thread = threading.Thread(target=self._run_guarded, daemon=True, name="chaos")
        self.thread.start()

    def on_event(self, kind: str, fields: dict) -> None:
        if kind in ("reconfiguration", "failover", "restart"):
            probe = resource_probe({"close_wait": tcp_states(self.agent_port()).count("CLOSE_WAIT")})
            self.samples.append({"generation": fields["generation"], **probe})

    def agent_port(self) -> int:
        return self.controller.membership.server.getsockname()[1]

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=30)

    # ------------------------------------------------------------------ the loop
    def _run_guarded(self) -> None:
        try:
            self._run()
        except BaseException as error:  # reported by the test, not lost in a thread
            self.error = error

    def _run(self) -> None:
        from oobleck.runtime.comm import make_store

        kinds = [KINDS[i % len(KINDS)] for i in range(FAULTS)]
        self.rng.shuffle(kinds)
        c = self.controller
        while c.train_started is None and not self._stop.wait(0.05):
            pass
        self.ports = [c.store.port, self.agent_port()]
        host, _, port = c.store_address.rpartition(":")
        store = make_store(host, int(port), 30.0)
        for kind in kinds:
            victim = self._settle()
            if victim is None:
                return
            self.hits.append((kind, victim))
            self._strike(kind, victim, store, c.secret)
            self._wait_recovered(victim)

    def _settle(self) -> int | None:
        """Wait until a fault may land: no failure or join in flight, ``GAP`` steps committed in
        the current generation, and ``MIN_ALIVE`` nodes left after it; returns its victim (None:
        the run is ending)."""
        c = self.controller
        while not self._stop.wait(0.02):
            ledger, membership = c.ledger, c.membership
            if ledger.next_step > STEPS - 40:
                return None  # leave the last steps to finish the run
            generation = ledger.generations.get(ledger.generation)
            if c.recovery is not None or membership.pending() or generation is None or ledger.next_step < generation.resume_step + GAP:
                continue
            try:  # the controller's thread may be adding a joining node to the table right now
                alive = membership.alive()
            except RuntimeError:
                continue
            candidates = sorted(n for n in alive if n in generation.layout.plan.nodes and n != SURVIVOR)
            if len(alive) - 1 < MIN_ALIVE or not candidates:
                continue
            return self.rng.choice(candidates)
        return None

    def _strike(self, kind: str, victim: int, store, secret: str) -> None:
        processes = node_processes(self.controller.run_id).get(victim)
        assert processes and processes["agent"] and processes["workers"], (victim, processes)
        agent, worker = processes["agent"][0], processes["workers"][0]
        if kind.startswith("strike_"):
            phase = kind.removeprefix("strike_")
            strike = {"step": self.controller.ledger.next_step + 1, "phase": phase, "kind": self.rng.choice(["remove", "freeze"])}
            store.set(keys.strike(victim), keys.sign(secret, json.dumps(strike)))
        elif kind == "kill_worker":
            os.kill(worker, signal.SIGKILL)
        elif kind == "kill_agent":
            os.kill(agent, signal.SIGKILL)
        elif kind == "kill_node":
            os.killpg(agent, signal.SIGKILL)
        elif kind == "freeze_worker":
            os.kill(worker, signal.SIGSTOP)
        elif kind == "freeze_agent":
            os.kill(agent, signal.SIGSTOP)

    def _wait_recovered(self, victim: int) -> None:
        """Until a finished recovery removed ``victim`` (its failure and plan are then done with:
        the controller's own flags leave gaps between detecting, planning and publishing)."""
        c = self.controller
        while not any(victim in r["removed"] for r in list(c.outcome.recoveries)) and c.ledger.next_step <= STEPS - 40:
            if self._stop.wait(0.02):
                return


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("chaos") / "run"
    cfg = tiny_config(**{
        "cluster.nodes": NODES,
        "job.fault_tolerance": 1,
        "job.steps": STEPS,
        "job.warmup_steps": 5,
        "cluster.heartbeat_interval_s": 0.25,
        "cluster.heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
        "runtime.reap_margin_s": 1.0,
        "failures.kind": "explicit",
        # joins are due at once and applied one batch at a time, each once the last is up
        "failures.events": [{"action": "join", "count": JOIN_SIZE, "step": 1} for _ in range(JOINS)],
    })
    chaos = Chaos()
    started = time.monotonic()
    try:
        outcome, summary = launch(cfg, run_dir, on_start=chaos.start)
    finally:
        if chaos.controller is not None:
            chaos.stop()
    seconds = time.monotonic() - started
    assert chaos.error is None, chaos.error
    # Drop the run's last references (the store's server listens while its object lives).
    chaos.run_id = chaos.controller.run_id
    chaos.controller = None
    gc.collect()
    return cfg, outcome, summary, run_dir, chaos, seconds


def test_chaos_run_is_exact_and_long(chaos_run):
    cfg, outcome, summary, run_dir, chaos, seconds = chaos_run
    print(f"chaos: {outcome.generations - 1} generation changes, {len(chaos.hits)} faults in {seconds:.0f} s")
    assert outcome.generations - 1 >= 25, (outcome.generations, chaos.hits)
    assert {kind for kind, _ in chaos.hits} == set(KINDS), chaos.hits
    assert_matches_reference(cfg, outcome, run_dir)  # every step committed once, in order, exactly
    assert summary["consecutive_steps"] and all(r["replicas_identical"] for r in outcome.recoveries)
    assert all(crcs for crcs in outcome.checksums.values())


def test_every_fault_became_a_failure_with_its_cause(chaos_run):
    cfg, outcome, _, run_dir, chaos, _ = chaos_run
    import pandas as pd

    failures = pd.read_csv(run_dir / "events.csv")
    failures = failures[failures["kind"] == "failure"].set_index("node")
    removed = {n for r in outcome.recoveries for n in r["removed"]}
    for kind, node in chaos.hits:
        assert node in removed and node in failures.index, (kind, node)
        row = failures.loc[node]
        if kind in REASONS:
            assert any(text in row["reason"] for text in REASONS[kind]), (kind, row["reason"])
        if kind.startswith("freeze"):
            # caused from outside: the detection counts from the last heartbeat seen
            assert row["detect_s"] >= HEARTBEAT_TIMEOUT_S - 2 * cfg.cluster.heartbeat_interval_s, (kind, row["detect_s"])
    assert SURVIVOR not in removed


def test_resources_stay_flat(chaos_run):
    _, outcome, _, _, chaos, _ = chaos_run
    survivor = [p for _, ranks in sorted(outcome.probes.items()) for p in ranks.values() if tuple(p["worker"]) == (SURVIVOR, 0)]
    assert len({p["pid"] for p in survivor}) == 1, "the survivor was never restarted"
    for name, samples in (("survivor", survivor), ("controller", chaos.samples)):
        early, late = samples[2:9], samples[-7:]
        assert len(early) == len(late) == 7, (name, len(samples))
        # A leak of one thread or descriptor per generation would add 15+ between the windows;
        # within a window the counts swing with the groups the reaper still holds.
        for key, slack in (("threads", 8), ("fds", 12), ("sockets", 10)):
            assert max(p[key] for p in late) <= max(p[key] for p in early) + slack, (name, key, early, late)
        assert max(p["rss_kb"] for p in late) - max(p["rss_kb"] for p in early) < 40_000, (name, early, late)
    assert max(s["close_wait"] for s in chaos.samples) == 0, "a dead agent's socket was left in CLOSE-WAIT"


def test_nothing_is_left_behind(chaos_run):
    *_, chaos, _ = chaos_run
    assert run_processes(chaos.run_id) == []
    assert len(chaos.ports) == 2
    for port in chaos.ports:
        assert "LISTEN" not in tcp_states(port), port

"""The control plane under attack (issues 18, 28): hostile agent-port clients and foreign store writes.

A real 3-node run (f=1, a checkpoint every 5 steps) trains while a seeded attacker, which knows the
ports and the protocol but not the run's secret, keeps at it: connections to the agent port
sending random bytes, over-long and deeply nested lines, JSON of every message type with missing
or mistyped fields, ``hello`` for live nodes with a wrong secret (then closing, which once got
the real node killed), a ``hello`` whose ``pid`` is a string (which once crashed the
controller); and writes to the store. At the protocol's key names (``oobleck.runtime.keys``):
``compare_set`` of ``abort`` as the commit decision of the next steps before any worker votes
(which once stopped training with no time limit), ``abort/<g>`` (once a 180 s stall and a stop),
malformed decisions (``"commit+checkpoint xyz"``, once a controller traceback), malformed shard
records, ``checkpoint/request = "garbage"`` (once a worker's exception), ``established``, plans,
``gen``, ``stop``, strikes; none of those names is one the run uses (``keys.KeySpace``). And at the
run's own key names, listed with ``list_keys`` as any client can: heartbeats, registrations, the
config, the services, checkpoint shard records and timings, overwritten with values the run did
not seal. Both ports listen on ``cluster.master_addr`` only, so another address of the host
(127.0.0.2) gets no answer.

Nothing of that may crash the controller, kill a node, stall or stop the run, or change what is
trained: no failure, no recovery, every step committed, equal to single-process training. A
checkpoint whose shard record was overwritten before the controller read it fails, saying so;
every overwritten value that is read is dropped with one log line.
"""

from __future__ import annotations

import gc
import json
import random
import socket
import threading
import time

import pytest

from oobleck.elastic.agent_port import MAX_DROP_LINES
from oobleck.elastic.job import launch
from oobleck.elastic.local import run_processes
from oobleck.runtime import keys
from oobleck.runtime.store_client import make_store
from testing import assert_matches_reference, ports_still_listening, tiny_config

pytestmark = pytest.mark.slow  # starts processes

SEED = 18
LEFTOVER_WAIT_S = 10.0  # how long the run's ports may take to close after it returned
NODES = 3
STEPS = 30
ROUNDS = 40  # attacks (each one agent-port client and a few store writes)


def hostile_lines(rng: random.Random, nodes: list[int]) -> list[bytes]:
    """The lines one attacking client sends (each ends with a newline)."""
    node = rng.choice(nodes)
    fields = {
        "node": node,
        "pid": 4242,
        "host": "evil",
        "secret": "0" * 32,
        "time": 1.0,
        "local_rank": 0,
        "code": 0,
        "incarnation": 0,
    }
    kind = rng.choice(["hello", "hb", "exit", "start", "restart", "kill", "shutdown", "nope"])
    message = {"type": kind, **{k: v for k, v in fields.items() if rng.random() < 0.8}}
    if rng.random() < 0.5:  # a field of the wrong type
        message[rng.choice(list(fields))] = rng.choice(["x", None, [], {}, True, 1e308, -1])
    choices = [
        json.dumps(message).encode(),
        json.dumps({"type": "hello", "node": node, "pid": "x", "host": "h", "secret": "s"}).encode(),
        json.dumps({"type": "hello", "node": node, "pid": 1, "host": "h", "secret": "wrong"}).encode(),
        bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))).replace(b"\n", b""),
        b"[" * 60_000,  # nested too deep for json
        b"x" * (70_000),  # longer than protocol.MAX_LINE_BYTES
        b"\xff\xfe" + b"{}",
        json.dumps([message]).encode(),
    ]
    return [rng.choice(choices) + b"\n" for _ in range(rng.randrange(1, 4))]


class Attacker:
    """``launch``'s ``on_start``: attack once training runs (a thread)."""

    def __init__(self) -> None:
        self.rng = random.Random(SEED)
        self.controller = None
        self.rounds = 0
        self.refused_elsewhere: list[int] = []
        self.error: BaseException | None = None
        self.ports: list[int] = []
        self.overwritten = 0  # the run's own values overwritten

    def __call__(self, controller) -> None:
        self.controller = controller
        self.thread = threading.Thread(target=self._guarded, daemon=True, name="attacker")
        self.thread.start()

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as error:
            self.error = error

    def _run(self) -> None:
        c = self.controller
        deadline = time.monotonic() + 120
        while c.train_started is None and time.monotonic() < deadline:
            time.sleep(0.05)
        agent_port = c.membership.server.getsockname()[1]
        self.ports = [c.store.port, agent_port]
        for port in (c.store.port, agent_port):
            with socket.socket() as probe:
                probe.settimeout(5)
                if probe.connect_ex(("127.0.0.2", port)) != 0:
                    self.refused_elsewhere.append(port)
        host, _, port = c.store_address.rpartition(":")
        store = make_store(host, int(port), 30.0)
        nodes = list(range(NODES))
        while self.rounds < ROUNDS and c.ledger.next_step < STEPS - 5:
            self._client(agent_port, hostile_lines(self.rng, nodes))
            self._writes(store, self.rng.choice(nodes), c.ledger.next_step)
            self.rounds += 1

    def _client(self, port: int, lines: list[bytes]) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            try:
                for line in lines:
                    sock.sendall(line)
            except OSError:
                pass  # dropped mid-way: as it should be

    def _writes(self, store, node: int, step: int) -> None:
        """Foreign writes: at the protocol's logical key names, and over the run's own keys."""
        strike = json.dumps({"step": step + 1, "phase": "forward", "kind": "remove"})
        generation = self.controller.ledger.generation
        for ahead in range(1, 4):  # decisions of the next steps, before any worker votes
            store.compare_set(
                keys.decision(generation, step + ahead), "", self.rng.choice([keys.ABORT, "commit+checkpoint xyz"])
            )
        for key, value in [
            (keys.abort(generation), "1"),
            (keys.abort(generation + 1), "1"),
            (keys.CHECKPOINT_REQUEST, "garbage"),
            (keys.checkpoint_shard(step + 1, 0), self.rng.choice(["{", '{"layer": "x"}', "[]"])),
            (keys.established(generation + 1), keys.YES),
            (keys.plan(generation + 1), "{}"),
            (keys.GEN, str(generation + 7)),
            (keys.strike(node), strike),
            (keys.STOP, "pwned"),
            (keys.heartbeat(node, 0, 0), "garbage"),
            (keys.strike_time(node), self.rng.choice(["nan", "-1", "x"])),
            (f"fuzz/{self.rng.randrange(1000)}", "hello"),
        ]:
            store.set(key, value)
        # The run's own keys, as list_keys shows them: values it did not seal.
        own = [
            name
            for name in store.list_keys()
            if name.startswith(("hb/", "worker/", "config@", "services@", "checkpoint/"))
        ]
        self.overwritten += min(3, len(own))
        for name in self.rng.sample(own, min(3, len(own))):
            store.set(name, self.rng.choice(["garbage", "{}", '{"layer": 0, "file": "x", "bytes": 1, "crc32": 2}']))


def test_hostile_clients_and_foreign_writes_change_nothing(tmp_path, capfd):
    run_dir = tmp_path / "run"
    cfg = tiny_config(
        **{
            "cluster.nodes": NODES,
            "job.fault_tolerance": 1,
            "job.steps": STEPS,
            "failures.kind": "none",
            "checkpoint.every_steps": 5,
        }
    )
    attacker = Attacker()
    outcome, _ = launch(cfg, run_dir, on_start=attacker)
    attacker.thread.join(timeout=30)
    assert attacker.error is None, attacker.error
    assert attacker.rounds >= 10, attacker.rounds  # the attack ran while the run trained
    assert len(attacker.refused_elsewhere) == 2  # neither port answers on 127.0.0.2
    assert outcome.recoveries == [] and outcome.stopped is None
    assert ",failure," not in (run_dir / "events.csv").read_text()
    assert_matches_reference(cfg, outcome, run_dir)
    # A checkpoint fails only because a shard's record was overwritten before it was read, and says so.
    assert all("not valid" in f["cause"] for f in outcome.checkpoint_failures), outcome.checkpoint_failures
    assert outcome.checkpoints, "checkpoints complete while the attack goes on"
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    assert attacker.overwritten >= 10, attacker.overwritten
    dropped = attacker.controller.membership.port.dropped
    # Once the run's objects are gone, neither port listens (the store's server lives with its object).
    run_id, attacker.controller = attacker.controller.run_id, None
    gc.collect()
    assert run_processes(run_id) == [] and len(attacker.ports) == 2
    listening, threads = ports_still_listening(attacker.ports, LEFTOVER_WAIT_S)
    assert listening == [], (listening, threads)
    # every attacking client dropped before it said a valid hello; the first drops logged, one line each
    assert dropped >= attacker.rounds - 1, (dropped, attacker.rounds)
    logged = err.count("oobleck: dropped an agent connection from 127.0.0.1:")
    assert logged == min(dropped, MAX_DROP_LINES), err[-3000:]


def test_a_line_nested_too_deep_for_json_is_a_protocol_error():
    from oobleck.elastic.protocol import ProtocolError, parse

    with pytest.raises(ProtocolError, match="not JSON"):
        parse("[" * 60_000)

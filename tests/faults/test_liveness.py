"""A frozen worker (``kill -STOP`` of one worker, its agent alive) is recovered (issue 18).

The agent keeps beating, so only the worker's own heartbeat (``oobleck.runtime.liveness``) can
reveal it. Two ways, both with a real SIGSTOP of one worker process of a 3-node run (f=1):

- its heartbeat counter stops for ``cluster.heartbeat_timeout_s``: the node fails as frozen;
- with a heartbeat timeout longer than the collective timeout, the collective the others wait in
  outlasts ``cluster.collective_timeout_s`` first: the controller follows who waits on whom to the
  rank that did not answer and fails its node.

Either way the run recovers in place, equals single-process training, and the controller keeps
no CLOSE-WAIT socket of the dead agent. A frozen agent (its workers alive), caught by the agent's
heartbeat with its detection time counted from its last beat, is one of the chaos loop's faults
(``tests/faults/test_chaos.py``).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pandas as pd
import pytest

from oobleck.elastic.job import launch
from oobleck.elastic.local import node_processes, run_processes
from testing import assert_matches_reference, tcp_states, tiny_config

pytestmark = pytest.mark.slow  # starts processes

VICTIM = 1
FREEZE_AT_STEP = 3
WAIT_S = 120  # bound on how long the freezer waits for the run to reach FREEZE_AT_STEP


class Freezer:
    """``launch``'s ``on_start``: SIGSTOP ``VICTIM``'s first worker (or its agent) once
    ``FREEZE_AT_STEP`` committed; counts the controller's CLOSE-WAIT sockets on the agent port
    when the recovery is done."""

    def __init__(self, target: str = "workers") -> None:
        self.target = target
        self.controller = None
        self.frozen: list[int] = []
        self.close_wait: list[int] = []
        self.rows: list[dict] = []

    def __call__(self, controller) -> None:
        self.controller = controller
        controller.on_event = self.on_event
        controller.on_step = self.rows.append
        threading.Thread(target=self._freeze, daemon=True, name="freezer").start()

    def on_event(self, kind: str, fields: dict) -> None:
        if kind == "reconfiguration":
            port = self.controller.membership.server.getsockname()[1]
            self.close_wait.append(tcp_states(port).count("CLOSE_WAIT"))

    def _freeze(self) -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            c = self.controller
            if c.ledger is not None and c.ledger.next_step >= FREEZE_AT_STEP:
                pids = node_processes(c.run_id).get(VICTIM, {}).get(self.target, [])
                if pids:
                    os.kill(pids[0], signal.SIGSTOP)
                    self.frozen.append(pids[0])
                    return
            time.sleep(0.01)


def run_with_a_frozen_worker(tmp_path, target="workers", steps=10, **dotted):
    cfg = tiny_config(
        **{"cluster.nodes": 3, "job.fault_tolerance": 1, "job.steps": steps, "failures.kind": "none", **dotted}
    )
    freezer = Freezer(target)
    outcome, summary = launch(cfg, tmp_path / "run", on_start=freezer)
    assert freezer.frozen, "the run never reached the step to freeze at"
    assert run_processes(freezer.controller.run_id) == []  # the frozen worker was killed too
    (recovery,) = outcome.recoveries
    assert recovery["removed"] == [VICTIM]
    assert freezer.rows == outcome.steps  # the controller's on_step saw every committed step's row
    assert freezer.close_wait == [0]  # the dead agent's connection was closed, not left in CLOSE-WAIT
    assert_matches_reference(cfg, outcome, tmp_path / "run")
    events = pd.read_csv(tmp_path / "run" / "events.csv")
    (failure,) = events[events["kind"] == "failure"].itertuples()
    assert failure.node == VICTIM
    return cfg, failure


def test_a_frozen_worker_is_caught_by_its_own_heartbeat(tmp_path):
    cfg, failure = run_with_a_frozen_worker(tmp_path, **{"cluster.heartbeat_timeout_s": 2.0})
    assert "worker 0 sent no heartbeat" in failure.reason
    # caused from outside: counted from the last beat seen (at most one read interval late)
    assert failure.detect_s >= cfg.cluster.heartbeat_timeout_s - cfg.cluster.heartbeat_interval_s


def test_a_collective_nobody_answers_becomes_the_failure_of_the_silent_rank(tmp_path):
    cfg, failure = run_with_a_frozen_worker(
        tmp_path, **{"cluster.heartbeat_timeout_s": 60.0, "cluster.collective_timeout_s": 3.0}
    )
    assert "did not answer" in failure.reason and "cluster.collective_timeout_s=3.0" in failure.reason, failure.reason
    assert failure.detect_s >= cfg.cluster.collective_timeout_s

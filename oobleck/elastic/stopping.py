"""How a run ends: stops asked for from outside the loop, the stop message, and the wind-down.

- ``StopRequests``: a signal handler asks for a stop now (SIGINT, SIGTERM: the loop raises
  ``Stopped`` at its next tick), or after a checkpoint of the next step boundary (Slurm's warning
  signal before a time limit or a preemption: the run is then requeued and resumed);
- ``send_stop``: the ``stop`` key (in the run's key space: only the controller can set it), and
  the step in flight and the generation's barrier decided against, so every worker waiting on the
  store wakes and exits;
- ``wind_down``: after the loop, finished workers get a moment to exit by themselves and
  checkpoints in progress to complete (bounded), their per-phase seconds are collected, then every
  node is shut down.
"""

from __future__ import annotations

import json
import time
from typing import Any

from oobleck.elastic.checkpoints import CheckpointCoordinator
from oobleck.elastic.events import EventKind
from oobleck.elastic.ledger import Outcome, StepLedger
from oobleck.elastic.membership import Membership
from oobleck.errors import EXIT_REQUEUE, OobleckError, Stopped
from oobleck.runtime import keys

STOP_GRACE_S = 5.0  # finished workers exit within this (they only close their checkpoint writers)
DRAIN_S = 0.02  # how long each look at the agents' messages waits while winding down


class StopRequests:
    """Stops asked for from outside the controller's loop (see the module docstring)."""

    def __init__(self) -> None:
        self.now: tuple[str, int] | None = None  # (why, exit code)
        self.after_checkpoint: str | None = None  # why: checkpoint the next boundary, then stop
        self.checkpoint_step: int | None = None  # the boundary asked for

    def check(self, ledger: StepLedger, checkpoints: CheckpointCoordinator, emit: Any) -> None:
        """Raise ``Stopped`` once a requested stop is due (asking for its checkpoint first)."""
        if self.now is not None:
            raise Stopped(*self.now)
        if self.after_checkpoint is None:
            return
        if self.checkpoint_step is None:
            self.checkpoint_step = ledger.next_step + 1
            checkpoints.request(self.checkpoint_step)
            emit(EventKind.CHECKPOINT_REQUESTED, checkpoint_step=self.checkpoint_step, reason=self.after_checkpoint)
        latest = checkpoints.latest_step()
        if latest is not None and latest >= self.checkpoint_step:
            raise Stopped(
                f"{self.after_checkpoint}: checkpointed after step {latest - 1} in {checkpoints.path(latest)}; "
                "requeue the job and resume it with job.resume=auto (slurm/run.sbatch does both)",
                EXIT_REQUEUE,
            )


def send_stop(store: Any, message: str, ledger: StepLedger | None) -> None:
    """Tell every worker the run is over (``message`` says why); best effort, the store may be gone."""
    try:
        store.set(keys.STOP, message)
        if ledger is not None and ledger.generation >= 0:
            store.compare_set(keys.decision(ledger.generation, ledger.next_step), "", keys.ABORT)
            store.compare_set(keys.established(ledger.generation), "", keys.NO)
            store.set(keys.abort(ledger.generation), "1")
    except Exception:
        pass


def wind_down(
    membership: Membership,
    *,
    ledger: StepLedger | None,
    checkpoints: CheckpointCoordinator | None,
    outcome: Outcome,
    store: Any,
    finished: bool,
    cfg: Any,
) -> None:
    """Shut every node down; after a finished run, let its workers and checkpoints finish first."""
    deadline = time.monotonic() + STOP_GRACE_S
    if finished:
        plan = ledger.layout.plan if ledger is not None else None
        expected = {a.worker for a in plan.assignments()} if plan is not None else set()
        expected = {w for w in expected if not membership.nodes[w[0]].failed}
        while time.monotonic() < deadline and not expected <= membership.exited:
            try:
                membership.drain(DRAIN_S)
            except OobleckError:
                break
        if checkpoints is not None and checkpoints.pending:
            checkpoints.finish(
                time.monotonic() + float(cfg.checkpoint.write_timeout_s),
                lambda: membership.drain(DRAIN_S),
                lambda worker: worker in membership.exited or membership.nodes[worker[0]].failed,
            )
        for node, state in membership.nodes.items():
            for local_rank in range(int(cfg.cluster.gpus_per_node)):
                phases = None if state.failed else store.read(keys.phase_times(node, local_rank), parse_phases)
                if isinstance(phases, dict):
                    outcome.phase_seconds[f"{node}:{local_rank}"] = phases
    membership.shutdown(max(1.0, deadline - time.monotonic()))


def parse_phases(value: bytes) -> dict[str, float]:
    """A worker's seconds per step phase (``keys.phase_times``)."""
    data = json.loads(value)
    if not (isinstance(data, dict) and all(isinstance(v, (int, float)) for v in data.values())):
        raise ValueError(f"not seconds per phase: {value[:80]!r}")
    return {str(k): float(v) for k, v in data.items()}

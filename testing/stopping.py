"""Runs whose length is set by what they must see, not by a step count.

A run with a failure that comes after a wall-clock delay (a preemption notice's kill, a chaos
loop's faults) cannot pick ``job.steps`` for every machine: on a fast one the steps run out before
the delay does, and on a slow one the steps after the last event are spent for nothing. Such a
test gives ``job.steps`` as a bound only and hands ``launch`` a ``StopWhen``: once the events seen
satisfy its condition and ``then_steps`` more steps have committed, it asks the run to checkpoint
its next step boundary and stop, as Slurm's warning before a time limit does
(``Controller.request_checkpoint_stop``, exit code 75). ``launch_until`` runs it and
``assert_stopped_run_matches_reference`` checks what the run did against single-process training.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from testing.checks import cached_reference

Events = list[dict[str, Any]]


class StopWhen:
    """``launch``'s ``on_start``: records the run's events (``events``: kind and fields) and asks
    it to checkpoint and stop ``then_steps`` committed steps after ``seen(events)`` first holds."""

    def __init__(self, seen: Callable[[Events], bool], then_steps: int) -> None:
        self.seen = seen
        self.then_steps = then_steps
        self.events: Events = []
        self.controller: Any = None
        self.stop_after: int | None = None  # the last step to commit before asking for the stop
        self.asked_at: int | None = None  # the step after which the stop was asked for

    def __call__(self, controller: Any) -> None:
        self.controller = controller
        on_event, on_step = controller.on_event, controller.on_step

        def event(kind: str, fields: dict[str, Any]) -> None:
            if on_event is not None:
                on_event(kind, fields)
            self._on_event(kind, fields)

        def step(row: dict[str, Any]) -> None:
            if on_step is not None:
                on_step(row)
            self._on_step(row)

        controller.on_event, controller.on_step = event, step

    def _on_event(self, kind: str, fields: dict[str, Any]) -> None:
        self.events.append({"kind": kind, **fields})
        if self.stop_after is None and self.seen(self.events):
            ledger = self.controller.ledger
            self.stop_after = (int(ledger.next_step) if ledger is not None else 0) + self.then_steps - 1

    def _on_step(self, row: dict[str, Any]) -> None:
        if self.stop_after is not None and self.asked_at is None and int(row["step"]) >= self.stop_after:
            self.asked_at = int(row["step"])
            self.controller.request_checkpoint_stop("the test has seen what it runs for")


def launch_until(cfg: Any, run_dir: Path, stop: StopWhen) -> tuple[Any, dict[str, Any]]:
    """``launch(cfg, run_dir)`` stopped by ``stop``; returns the outcome and the summary. Fails
    if the run ended any other way (it ran out of ``job.steps`` before it saw what it runs for)."""
    from oobleck.elastic.job import launch
    from oobleck.errors import EXIT_REQUEUE, Stopped

    try:
        launch(cfg, run_dir, on_start=stop)
    except Stopped as error:
        assert error.exit_code == EXIT_REQUEUE, f"stopped otherwise than asked: {error}"
    else:
        raise AssertionError(f"the run ran all its {cfg.job.steps} steps without seeing what it runs for")
    assert stop.asked_at is not None
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    return stop.controller.outcome, summary


def assert_stopped_run_matches_reference(
    cfg: Any, outcome: Any, run_dir: Path, *, loss_rtol: float = 1e-5, param_atol: float = 1e-5
) -> int:
    """A run stopped by ``request_checkpoint_stop`` committed steps 0..n-1 once each, their losses
    equal single-process training on the same batches, and its newest valid checkpoint (at step
    c <= n) holds the parameters that training has after c steps. Returns c. The tolerances are
    ``assert_matches_reference``'s (justified in tests/runtime/test_exactness.py)."""
    from oobleck.checkpoint import checkpoint_root, latest_valid, restore_layer
    from oobleck.runtime.state import new_layer_state

    steps = [row["step"] for row in outcome.steps]
    assert steps == list(range(len(steps))), f"committed steps {steps}: some were skipped or repeated"
    checkpoint = latest_valid(checkpoint_root(cfg.checkpoint.dir, run_dir))
    assert checkpoint is not None and 0 < checkpoint.step <= len(steps), (checkpoint, len(steps))
    reference = cached_reference(cfg, steps=checkpoint.step)
    for row, expected in zip(outcome.steps, reference.losses):
        assert math.isclose(row["loss"], expected, rel_tol=loss_rtol), (row["step"], row["loss"], expected)
    for index, expected in reference.layers.items():
        layer = new_layer_state(cfg.model, cfg.job, index, int(cfg.job.seed), "cpu")
        restore_layer(checkpoint.step_dir, checkpoint.manifest.record(index), layer, checkpoint.step)
        for name, value in layer.module.state_dict().items():
            worst = float((value - expected[name]).abs().max())
            assert worst <= param_atol, (index, name, worst, param_atol)
    return int(checkpoint.step)

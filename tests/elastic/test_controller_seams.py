"""The controller's seams, on one real run with a real failure: a launcher named by
``cluster._target_`` starts the nodes, an observer added to ``Controller.observers`` hears the
run's hooks in order, every generation's plan document reaches it, and the run still equals
single-process training."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from oobleck.elastic.events import Continuation, Execution, RunObserver
from oobleck.elastic.job import launch
from oobleck.strategy import Kind
from testing import assert_matches_reference, tiny_config
from testing.launchers import RecordingLauncher

pytestmark = pytest.mark.slow  # starts processes

REPO = Path(__file__).resolve().parents[2]


class HookLog(RunObserver):
    def __init__(self) -> None:
        self.hooks: list[tuple] = []

    def changes_taken(self, changes, started) -> None:
        self.hooks.append(("changes_taken", tuple(changes.removed), tuple(changes.joined)))

    def executing(self, execution: Execution) -> None:
        self.hooks.append(("executing", execution.kind, execution.generation, execution.resume_step))

    def continued(self, continuation: Continuation) -> None:
        self.hooks.append(("continued", continuation.lost))

    def published(self, document, layout) -> None:
        assert document.plan == layout.plan
        self.hooks.append(("published", document.generation, document.reconfiguration is not None))

    def absorbed(self, generation: int) -> None:
        self.hooks.append(("absorbed", generation))

    def finished(self) -> None:
        self.hooks.append(("finished",))


def test_a_launcher_and_an_observer_plug_in(tmp_path, monkeypatch):
    # Worker processes import the launcher class too (it gives their gloo address).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    RecordingLauncher.started.clear()
    cfg = tiny_config(
        **{
            "cluster._target_": "testing.launchers.RecordingLauncher",
            "cluster.nodes": 3,
            "job.fault_tolerance": 1,
            "job.steps": 6,
            "failures.kind": "explicit",
            "failures.events": [{"action": "remove", "step": 3, "nodes": [1]}],
        }
    )
    log = HookLog()
    outcome, summary = launch(cfg, tmp_path / "run", on_start=lambda controller: controller.observers.append(log))
    assert RecordingLauncher.started == [0, 1, 2]
    assert [(r["kind"], r["removed"], r["resume_step"]) for r in outcome.recoveries] == [("reconfiguration", [1], 3)]
    assert log.hooks == [
        ("published", 0, False),
        ("changes_taken", (1,), ()),
        ("executing", Kind.RECONFIGURE, 1, 3),
        ("published", 1, True),
        ("absorbed", 1),
        ("finished",),
    ], log.hooks
    assert summary["reconfigurations"] == 1
    assert_matches_reference(cfg, outcome, tmp_path / "run")


def test_a_fault_lands_at_its_step_where_the_launchers_signals_come_late(tmp_path, monkeypatch):
    """A launcher whose signals reach a node seconds after they are sent (Slurm's scancel through a
    busy slurmctld): the kill still lands at the step the schedule names, as it does locally, so
    that every strategy compared on that cluster loses the node at the same step."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cfg = tiny_config(
        **{
            "cluster._target_": "testing.launchers.LateSignalLauncher",
            "cluster.nodes": 3,
            "job.fault_tolerance": 1,
            "job.steps": 8,  # ends before the late signal would land (LateSignalLauncher.DELAY_S)
            "failures.kind": "explicit",
            "failures.events": [{"action": "remove", "step": 3, "nodes": [1]}],
        }
    )
    outcome, summary = launch(cfg, tmp_path / "run")
    assert [(r["kind"], r["removed"], r["resume_step"]) for r in outcome.recoveries] == [("reconfiguration", [1], 3)]
    assert summary["resumed_at_steps"] == [3]
    assert_matches_reference(cfg, outcome, tmp_path / "run")

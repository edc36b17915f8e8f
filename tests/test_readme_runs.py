"""The README's cheap examples run as written (issue 28); the others are composed and validated in
``tests/test_readme_examples.py``.

Every local ``oobleck-run`` example (not the main job, which ``tests/elastic/test_run_cli.py`` runs
from the README's own line) and ``oobleck-plan`` run here in a subprocess. The test adds only: the
run dir (``hydra.run.dir``), no progress bar and no wandb run (``logger.progress_bar=false
logger.wandb.mode=disabled``: neither changes what is trained), and for the explicit and trace
examples a shorter ``job.steps`` (``SHORTER``) that still covers each of their failures and
joins. The Poisson example runs at its full length: its point is that it survives its failures
(its seed draws the first one 0.2 s into training, so it strikes however fast the machine).
Each training example must inject a failure and train every step with nothing left running.
Scripts (benchmarks of minutes to hours, a GPU check, the tools reading their outputs) run with
``--help``, and every option the README gives them must be one of theirs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid

import pandas as pd
import pytest

from oobleck.elastic.local import run_processes
from testing.readme import REPO, SCRIPT, Command, readme_commands, with_overrides

pytestmark = pytest.mark.slow  # starts processes

COMMANDS = readme_commands()
ADDED = ("logger.progress_bar=false", "logger.wandb.mode=disabled")
# job.steps the test gives the examples that are long only to show more of the same: the explicit
# example's events strike at steps 10 and 30; the trace removes one of its 30 nodes every 1.7 s of
# training (10 s per trace hour), the first of the run's six at once, the next about 8 s in.
SHORTER = {"failures=explicit": 34, "failures=trace": 40}


def _local_runs() -> list[Command]:
    runs = [c for c in COMMANDS if c.program == "oobleck-run" and "-m" not in c.arguments]
    main_job = runs[0]  # the Quick start's, run by tests/elastic/test_run_cli.py
    return [c for c in runs[1:] if "cluster=slurm" not in c.arguments and c is not main_job]


def _subprocess(module: str, arguments: tuple[str, ...], run_dir, timeout: int):
    run_id = uuid.uuid4().hex[:12]
    env = dict(os.environ, OOBLECK_RUN_ID=run_id, WANDB_SILENT="true")
    command = [sys.executable, "-m", module, f"hydra.run.dir={run_dir}", *arguments]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return result, run_processes(run_id)


def test_the_examples_are_found():
    assert len(_local_runs()) >= 3 and any(c.program == "oobleck-plan" for c in COMMANDS)


@pytest.mark.parametrize("command", _local_runs(), ids=str)
def test_every_local_training_example_survives_its_failures(tmp_path, command):
    shorter = [steps for choice, steps in SHORTER.items() if choice in command.arguments]
    arguments = with_overrides(command.arguments, job__steps=shorter[0]) if shorter else command.arguments
    result, strays = _subprocess("oobleck.run", (*arguments, *ADDED), tmp_path, timeout=600)
    assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
    assert strays == []
    steps = next(int(a.split("=")[1]) for a in arguments if a.startswith("job.steps="))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == steps and summary["consecutive_steps"] and not summary.get("stopped"), summary
    events = pd.read_csv(tmp_path / "events.csv")
    injected = events[events["kind"] == "fault_injected"]
    assert len(injected) >= 1, f"{command} shows no failure"
    assert summary["recoveries"] >= 1


def test_the_planner_example_runs(tmp_path):
    (command,) = [c for c in COMMANDS if c.program == "oobleck-plan"]
    result, strays = _subprocess("oobleck.plan", command.arguments, tmp_path, timeout=600)
    assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan, "an empty plan"
    assert strays == []


@pytest.mark.parametrize("command", [c for c in COMMANDS if SCRIPT.match(c.program)], ids=str)
def test_every_script_takes_the_options_the_readme_gives_it(command):
    """A benchmark renamed, removed, or an option dropped fails here."""
    entry = command.words[1:3] if command.words[1] == "-m" else command.words[1:2]
    done = subprocess.run([sys.executable, *entry, "--help"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command}\n{done.stderr[-2000:]}"
    options = re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", done.stdout)
    for word in command.arguments:
        if word.startswith("-"):
            assert word.split("=")[0] in options, f"{command}: {word} is not an option of {' '.join(entry)}"

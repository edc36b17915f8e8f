"""What every entry point shares (oobleck.cli, oobleck.errors): the run dir's log file, one-line
refusals before anything starts, a clean Ctrl-C, Hydra's tab completion of the console scripts,
and the simulator saying when it simulates the toy setting."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from oobleck.cli import Interrupted, console_log
from oobleck.config import compose_config

pytestmark = pytest.mark.slow  # starts processes

BIN = Path(sys.executable).parent
TIMEOUT_S = 240  # hang guards for the subprocesses; no test relies on them


def _env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "WANDB_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
        "OOBLECK_CACHE_DIR": str(tmp_path / "cache"),
    }


def _entry(tmp_path: Path, program: str, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", program, *overrides],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def test_the_log_holds_what_the_terminal_finally_shows(tmp_path, capsys):
    with console_log(tmp_path / "x.log"):
        print("first line")
        sys.stderr.write("\rbar 1/3\rbar 2/3\rbar 3/3\n")  # a progress bar redrawing itself
        sys.stderr.write("half a line")
    log = (tmp_path / "x.log").read_text()
    assert log == "first line\nbar 3/3\nhalf a line\n"
    assert "first line" in capsys.readouterr().out  # and the terminal still got it all


def test_a_run_dir_under_paths_output_dir_keeps_plan_log(tmp_path):
    done = _entry(tmp_path, "oobleck.plan", "profile.source=analytic", f"paths.output_dir={tmp_path / 'runs'}")
    assert done.returncode == 0, done.stderr
    (log,) = (tmp_path / "runs" / "plan").glob("*/plan.log")
    text = log.read_text()
    assert (
        "planning: templates of 6 layers" in text
        and "\nTemplates\n" in text
        and f"wrote {log.parent / 'plan.json'}" in text
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+job.stpes=3", "job.stpes is not a config key; did you mean job.steps?"),
        (
            "failures=explicit failures.events=[{action:remove,step:2,count:10}]",
            "failures.events[0].count=10 strikes more nodes than the 4 alive then",
        ),
        ("failures.max_events=-1", "failures.max_events=-1 must be >= 1"),
    ],
)
def test_run_refuses_bad_keys_and_schedules_before_anything_starts(tmp_path, override, message):
    run_dir = tmp_path / "run"
    done = _entry(tmp_path, "oobleck.run", *override.split(" "), f"hydra.run.dir={run_dir}")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("oobleck.run: error: "), done.stderr
    assert message in lines[0]
    assert not (run_dir / "plan.json").exists() and not (run_dir / "metrics.csv").exists()  # no process was started


def test_a_sweep_with_a_point_that_cannot_run_refuses_before_its_first_job_runs(tmp_path):
    sweep_dir = tmp_path / "sweep"
    done = _entry(
        tmp_path,
        "oobleck.run",
        "-m",
        "strategy=oobleck,varuna",
        "checkpoint=none",
        "failures=none",
        f"hydra.sweep.dir={sweep_dir}",
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and lines[-1].startswith("oobleck.run: error: the sweep's job strategy=varuna"), (
        done.stderr
    )
    assert "checkpoints are disabled" in lines[-1]
    assert not list(sweep_dir.glob("*/metrics.csv")) and not list(sweep_dir.glob("*/plan.json"))  # job 0 never ran


def test_slurm_outside_an_allocation_is_refused_before_the_run_dir_exists(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run_dir = tmp_path / "run"
    done = _entry(tmp_path, "oobleck.run", "cluster=slurm", f"hydra.run.dir={run_dir}")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "cluster=slurm must run inside a Slurm allocation" in lines[0] and "with cluster=local" in lines[0]
    assert not run_dir.exists()  # nothing was created: no run dir, no wandb run


@pytest.mark.parametrize(
    ("override", "checked"),
    [
        ("cluster=slurm", True),
        ("+cluster=slurm", True),
        ("cluster.kind=slurm", True),
        ("cluster._target_=oobleck.elastic.slurm.SlurmLauncher", True),
        ("experiment=paper_spot", True),
        ("cluster.nodes=2", False),
        ("cluster.gpus_per_node=4", False),
        ("job.steps=3", False),
    ],
)
def test_only_overrides_that_can_change_the_launcher_are_composed_before_hydra(override, checked):
    """``check_where_nodes_start`` composes the config (a second compose, about a second) only
    when an override can change which launcher runs; the launcher class is what it checks."""
    from oobleck.config import compose_config
    from oobleck.launcher import launcher_class
    from oobleck.run import _may_change_launcher

    assert _may_change_launcher(override) is checked
    if not checked and override.startswith("cluster."):
        assert launcher_class(compose_config(override).cluster) is launcher_class(compose_config().cluster)


def test_ctrl_c_while_profiling_is_one_line_even_pressed_twice(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "oobleck.profile",
        "model=gpt2_small",
        "profile.max_measure_s=1e9",
        f"hydra.run.dir={run_dir}",
    ]
    # A child inherits an ignored SIGINT (tests/conftest.py's pytest_configure restores it for the
    # suite started in the background); it would then never see this test's Ctrl-C.
    assert signal.getsignal(signal.SIGINT) != signal.SIG_IGN, "SIGINT is ignored in the test process"
    process = subprocess.Popen(
        command, cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    log = run_dir / "profile.log"
    deadline = time.monotonic() + TIMEOUT_S
    while not (log.is_file() and "profiling model=gpt2_small" in log.read_text()) and process.poll() is None:
        assert time.monotonic() < deadline, "the profile never started"
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)  # measuring gpt2_small takes minutes here: no race
    # A second Ctrl-C once the line is out (a user pressing twice) lands while the interpreter
    # tears torch down, most of a second: it must not turn the exit into a death by SIGINT.
    while "interrupted (Ctrl-C)" not in log.read_text() and process.poll() is None:
        assert time.monotonic() < deadline, "the first Ctrl-C was not reported"
        time.sleep(0.01)
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=TIMEOUT_S)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert process.returncode == 130, stderr
    assert (
        lines[-1] == f"oobleck.profile: interrupted (Ctrl-C); what was printed is in {log}"
        and "Traceback" not in stderr
    )
    assert log.read_text().rstrip().endswith(lines[-1])


def test_ctrl_c_in_a_simulation_keeps_the_models_it_finished(tmp_path, monkeypatch):
    import oobleck.sim.experiment as experiment
    from oobleck.simulate import run

    real, calls = experiment.run_part, []

    def interrupted_second(setup, part, **kwargs):  # Ctrl-C during the second model's simulations
        calls.append(part[0])
        if part[0] == "gpt3_medium":
            raise KeyboardInterrupt
        return real(setup, part, **kwargs)

    monkeypatch.setattr(experiment, "run_part", interrupted_second)
    cfg = compose_config(
        "experiment=paper_spot",
        "sim.models=[gpt2_small,gpt3_medium]",
        "sim.traces=[synthetic/6h]",
        "sim.strategies=[oobleck]",
        "sim.processes=1",
        "sim.band_samples=0",
        "logger.progress_bar=false",
        "logger.wandb.mode=disabled",
    )
    with pytest.raises(Interrupted, match="wrote the 1 of 2 models simulated so far \\(gpt2_small\\)"):
        run(cfg, tmp_path)
    assert calls == ["gpt2_small", "gpt3_medium"]  # one part each (no band), Ctrl-C in the second
    assert set(pd.read_csv(tmp_path / "sim_summary.csv")["model"]) == {"gpt2_small"}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["interrupted"] == {"models_done": ["gpt2_small"], "models_requested": ["gpt2_small", "gpt3_medium"]}


def test_the_toy_simulation_says_what_it_is():
    from oobleck.simulate import toy_setting_notice

    notice = toy_setting_notice(compose_config())
    assert "no experiment= given" in notice and "experiment=paper_spot" in notice and "A100-40GB" in notice
    assert toy_setting_notice(compose_config("experiment=paper_spot")) is None


@pytest.mark.parametrize(
    ("command", "line", "expected"),
    [
        (
            "oobleck-simulate",
            "oobleck-simulate experiment=pap",
            {"experiment=paper_spot", "experiment=paper_failure_frequency"},
        ),
        ("oobleck-run", "oobleck-run model=gpt3_t", {"model=gpt3_tiny"}),
        ("oobleck-plan", "oobleck-plan gpu=h", {"gpu=h100_80gb", "gpu=h200"}),
        ("oobleck-profile", "oobleck-profile job.microbatch_s", {"job.microbatch_size="}),
    ],
)
def test_tab_completion_of_the_console_scripts(tmp_path, command, line, expected):
    if shutil.which(command, path=str(BIN)) is None:
        pytest.fail(
            f"{command} is not installed next to {sys.executable}: pip install -e . installs the console scripts"
        )
    script = f'eval "$({command} -sc install=bash)"; COMP_LINE="{line}"; COMP_POINT=${{#COMP_LINE}}; COMP_CWORD=1; hydra_bash_completion; echo "${{COMPREPLY[@]}}"'
    env = {**_env(tmp_path), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr
    assert set(done.stdout.split()) == expected

"""A feature run without the optional extra it needs says which extra, in one line.

The commands run in a subprocess where the extra's packages are hidden from the import system
(a meta-path finder that refuses them), as in an environment installed without that extra.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from oobleck.errors import ConfigError
from oobleck.extras import check_launcher_overrides, missing, require

REPO = Path(__file__).resolve().parents[1]
LAUNCHER_PRESETS = sorted(p.stem for p in (REPO / "conf" / "hydra" / "launcher").glob("*.yaml"))
TIMEOUT_S = 300  # a hang guard; no test relies on it

HIDE = """
import importlib.abc, runpy, sys

HIDDEN = {hidden!r}


class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if any(name == h or name.startswith(h + ".") for h in HIDDEN):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, Hide())
sys.argv = [{module!r}, *{arguments!r}]
runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
"""


def _run_hiding(hidden: list[str], module: str, *arguments: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    code = HIDE.format(hidden=hidden, module=module, arguments=list(arguments))
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


def test_missing_sees_absent_modules_and_absent_parents():
    assert not missing("json") and not missing("hydra_plugins.hydra_submitit_launcher")
    assert missing("no_such_package_for_oobleck") and missing("no_such_package_for_oobleck.child")


def test_require_names_the_extra_and_the_command():
    require(["json"], "analysis", "a feature")
    with pytest.raises(ConfigError) as caught:
        require(["json", "no_such_package_for_oobleck"], "analysis", "the wandb dashboards")
    message = str(caught.value)
    assert message.startswith("the wandb dashboards needs the [analysis] extra (no_such_package_for_oobleck ")
    assert "pip install 'oobleck-harness[analysis]'" in message and "pip install -e '.[analysis]'" in message


@pytest.mark.parametrize("preset", LAUNCHER_PRESETS)
def test_every_slurm_launcher_preset_is_checked(preset):
    check_launcher_overrides([f"hydra/launcher={preset}", "job.steps=3"])  # installed here: no error
    check_launcher_overrides(["hydra/launcher=basic", "cluster=local"])  # Hydra's own: never checked


def test_a_slurm_sweep_without_the_slurm_extra_is_one_line(tmp_path):
    done = _run_hiding(
        ["hydra_plugins.hydra_submitit_launcher", "submitit"],
        "oobleck.simulate",
        "-m",
        "hydra/launcher=slurm_cpu",
        "sim.models=[gpt3_medium]",
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "oobleck.simulate: error: hydra/launcher=slurm_cpu (sweeps as Slurm jobs) needs the [slurm] extra "
        "(hydra_plugins.hydra_submitit_launcher, submitit not installed): pip install 'oobleck-harness[slurm]', "
        "or pip install -e '.[slurm]' in a checkout"
    ]
    assert not any(tmp_path.iterdir())  # refused before Hydra made a run or sweep dir


def test_dashboards_without_the_analysis_extra_are_one_line(tmp_path):
    done = _run_hiding(
        ["wandb_workspaces"], "analysis.dashboards", "strategies", "--entity", "me", "--group", "g", cwd=tmp_path
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "analysis.dashboards: error: the wandb dashboards needs the [analysis] extra (wandb_workspaces not "
        "installed): pip install 'oobleck-harness[analysis]', or pip install -e '.[analysis]' in a checkout"
    ]


def test_notebooks_without_the_analysis_extra_are_one_line(tmp_path):
    from analysis.notebooks import names

    out = tmp_path / "out.ipynb"
    done = _run_hiding(["jupytext", "nbclient"], "analysis.notebooks", "run", names()[0], "--out", str(out), cwd=REPO)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "analysis.notebooks: error: the analysis notebooks needs the [analysis] extra (jupytext, nbclient not "
        "installed): pip install 'oobleck-harness[analysis]', or pip install -e '.[analysis]' in a checkout"
    ]
    assert not out.exists()

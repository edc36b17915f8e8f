"""The wheel is the package a user installs: it carries the config tree and the console scripts,
and an installed copy plans from a directory outside the checkout.

``.ci/run`` builds the wheel once, installs it into a fresh venv and runs ``oobleck-run
job.steps=3`` from outside the checkout; it hands the wheel to this test through OOBLECK_WHEEL.
Without it the test builds its own (``pip wheel --no-deps``, a few seconds) and installs it with
``--no-deps`` into a folder put first on PYTHONPATH, so the installed copy, not the checkout, runs.
It builds from a private copy of the checkout's files: setuptools builds in the source tree
(``build/``, ``*.egg-info``), and two builds in one tree (two test sessions, or xdist workers)
fail on each other's files (``File exists: build/bdist.../...dist-info``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts processes

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300  # a hang guard for pip and the planner; no test relies on it
SCRIPTS = ("oobleck-run", "oobleck-plan", "oobleck-profile", "oobleck-simulate")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    given = os.environ.get("OOBLECK_WHEEL")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("dist")
    source = tmp_path_factory.mktemp("source")
    for path in _tracked(others=True):
        if (REPO / path).is_file():  # a tracked file deleted in the checkout is not in it
            (source / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / path, source / path)
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(out),
        str(source),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("*.whl")
    return built


def _tracked(*roots: str, others: bool = False) -> list[str]:
    """The checkout's files under ``roots`` that git tracks; ``others``: and those it would
    track (new files not ignored), as a build of the working tree sees them."""
    extra = ["--others", "--exclude-standard"] if others else []
    command = ["git", "ls-files", "--cached", *extra, "-z", *roots]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    return sorted(set(done.stdout.split("\0")) - {""})


def test_the_wheel_carries_the_config_tree_the_code_and_the_commands(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    conf = [path for path in _tracked("conf") if path.endswith(".yaml")]
    assert conf and {f"oobleck/{path}" for path in conf} <= names  # conf/x.yaml ships as oobleck/conf/x.yaml
    code = [path for path in _tracked("oobleck", "baselines", "analysis") if path.endswith(".py")]
    assert set(code) <= names
    assert not [n for n in names if n.startswith(("testing/", "tests/", "benchmarks/"))]  # helpers stay in the checkout
    assert {"oobleck/faults/traces/synthetic/10m.csv", "oobleck/data/corpus/python_reference.txt"} <= names
    for script in SCRIPTS:
        assert f"{script} = oobleck.{script.split('-')[1]}:cli" in entry_points


def test_an_installed_copy_plans_from_another_directory(wheel, tmp_path):
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "OOBLECK_CACHE_DIR": str(tmp_path / "cache")}
    where = subprocess.run(
        [sys.executable, "-c", "from oobleck.config import CONF_DIR; print(CONF_DIR)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert where.stdout.strip() == str(site / "oobleck" / "conf"), where.stderr
    done = subprocess.run(
        [sys.executable, "-m", "oobleck.plan", "profile.source=analytic", "model=gpt2_small", "gpu=h200"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (plan,) = (work / "outputs" / "plan").glob("*/plan.json")
    assert json.loads(plan.read_text())["config"]["cluster"]["device_memory_gb"] == 141.0

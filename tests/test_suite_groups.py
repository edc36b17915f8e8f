"""The suite's own grouping (tests/conftest.py): with ``-n 2 --dist loadgroup`` every module is one
xdist group, so its module-scoped runs happen once, on one worker, and modules that name a group
themselves share it.

A pytest session with two xdist workers runs, in a scratch directory, this suite's conftest over
three modules; xdist names a grouped test ``<node id>@<group>``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts a pytest session with two worker processes

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300  # a hang guard; no test relies on it

ONE_MODULE = """
import pytest


@pytest.fixture(scope="module")
def started():
    return []


@pytest.mark.parametrize("n", range(4))
def test_in_one_module(started, n):
    started.append(n)
"""

NAMED_GROUP = """
import pytest

pytestmark = pytest.mark.xdist_group("shared")


def test_{name}():
    pass
"""


def test_each_module_is_a_group_and_named_groups_are_shared(tmp_path):
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: multi-process tests\n")
    (tmp_path / "test_module.py").write_text(ONE_MODULE)
    for name in ("first", "second"):
        (tmp_path / f"test_{name}.py").write_text(NAMED_GROUP.format(name=name))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = {name: worker for worker, name in re.findall(r"\[(gw\d+)\].*PASSED (test_\S+)", done.stdout)}
    module = {name: worker for name, worker in ran.items() if name.startswith("test_module.py::")}
    assert len(module) == 4 and all(name.endswith("@test_module.py") for name in module), done.stdout
    assert len(set(module.values())) == 1  # one worker: the module fixture ran once
    shared = {name: worker for name, worker in ran.items() if not name.startswith("test_module.py::")}
    assert set(shared) == {"test_first.py::test_first@shared", "test_second.py::test_second@shared"}, done.stdout
    assert len(set(shared.values())) == 1

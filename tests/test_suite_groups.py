"""The suite's own grouping: with ``-n 2 --dist loadgroup`` every test marked slow runs on one
xdist worker (tests/conftest.py), as the multi-process tests' timing assumes.

A pytest session with two xdist workers runs, in a scratch directory, this suite's conftest over
two slow tests and a plain one; xdist names a grouped test ``<node id>@<group>``.
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

SCRATCH_TESTS = """
import pytest


@pytest.mark.slow
def test_first_slow():
    pass


@pytest.mark.slow
def test_second_slow():
    pass


def test_plain():
    pass
"""


def test_slow_tests_share_one_xdist_worker(tmp_path):
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: multi-process tests\n")
    (tmp_path / "test_scratch.py").write_text(SCRATCH_TESTS)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = {name: worker for worker, name in re.findall(r"\[(gw\d+)\].*PASSED test_scratch\.py::(\S+)", done.stdout)}
    assert set(ran) == {"test_first_slow@processes", "test_second_slow@processes", "test_plain"}, done.stdout
    assert ran["test_first_slow@processes"] == ran["test_second_slow@processes"]

"""Fixtures of the runtime tests."""

import pytest


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"

"""Fixtures of the runtime tests."""

from datetime import timedelta

import pytest
import torch.distributed as dist


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


@pytest.fixture(scope="module")
def shared_store():
    """A TCPStore for in-process ranks (``inprocess.run_ranks``); tests use distinct generations."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))

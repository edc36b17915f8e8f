"""Shared test helpers: composing the project's Hydra config the way the entry points do."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from oobleck.config import compose_config

REPO = Path(__file__).resolve().parents[1]
# Measured profiles of the test runs stay in the checkout (gitignored) rather than in the user's
# ~/.cache/oobleck, shared by every test session and the subprocesses the tests start.
os.environ.setdefault("OOBLECK_CACHE_DIR", str(REPO / ".oobleck_cache"))


@pytest.fixture
def make_config():
    return compose_config


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # Multi-process tests (marked slow) wait on their processes' timing: with ``-n 2 --dist
    # loadgroup`` they run one at a time on one xdist worker, while the other worker runs the
    # single-process tests, which fill the time the multi-process ones spend waiting.
    # tryfirst: xdist turns the group mark into the item's node id in its own hook of this name,
    # which pytest would otherwise call before this one (a conftest registers before xdist's
    # worker plugin), and the groups would silently not exist.
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.xdist_group("processes"))

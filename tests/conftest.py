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

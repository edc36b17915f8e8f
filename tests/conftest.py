"""Shared test helpers: composing the project's Hydra config the way the entry points do."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from oobleck.config import CONF_DIR  # also registers the schema

REPO = Path(__file__).resolve().parents[1]
# Measured profiles of the test runs stay in the checkout (gitignored) rather than in the user's
# ~/.cache/oobleck, shared by every test session and the subprocesses the tests start.
os.environ.setdefault("OOBLECK_CACHE_DIR", str(REPO / ".oobleck_cache"))


def compose_config(*overrides: str):
    """The config an entry point would see for these command-line overrides."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.fixture
def make_config():
    return compose_config

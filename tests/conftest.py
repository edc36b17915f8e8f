"""Shared test helpers: composing the project's Hydra config the way the entry points do."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import oobleck.config  # noqa: F401  (registers the schema)

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"


def compose_config(*overrides: str):
    """The config an entry point would see for these command-line overrides."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.fixture
def make_config():
    return compose_config

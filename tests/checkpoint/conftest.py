"""Fixtures of the checkpoint tests (helpers: ``ckpthelpers``)."""

from __future__ import annotations

import pytest
from ckpthelpers import trained_layers

from testing import tiny_config


@pytest.fixture(scope="session")
def cfg():
    return tiny_config()


@pytest.fixture(scope="session")
def layers(cfg):
    return trained_layers(cfg)

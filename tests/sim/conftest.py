"""Shared simulator fixtures (templates are cached in the session-scoped contexts)."""

from __future__ import annotations

import pytest
from simhelpers import make_context

from oobleck.strategy import StrategyContext


@pytest.fixture(scope="session")
def context() -> StrategyContext:
    return make_context()


@pytest.fixture(scope="session")
def tight_context() -> StrategyContext:
    """1 GB devices: templates exist (n0 = 4) but no stage can also hold its successor (Bamboo OOM)."""
    return make_context(memory_gb=1.0)

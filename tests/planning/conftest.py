"""Shared fixtures of the planner tests: small seeded profiles and clusters."""

from __future__ import annotations

import pytest

from oobleck.planning.synthetic import synthetic_profile


@pytest.fixture(scope="session")
def profile8():
    return synthetic_profile(8, seed=3)

"""Shared fixtures of the planner tests: small seeded profiles and clusters."""

from __future__ import annotations

import pytest

from oobleck.planning.inputs import ClusterSpec
from oobleck.planning.synthetic import synthetic_profile


def cluster(nodes: int, gpus: int = 1, memory: float = 1e13, intra: float = 1e10, inter: float = 1e9) -> ClusterSpec:
    return ClusterSpec(
        nodes=nodes,
        gpus_per_node=gpus,
        device_memory_bytes=memory,
        intra_node_bandwidth=intra,
        inter_node_bandwidth=inter,
    )


@pytest.fixture(scope="session")
def profile8():
    return synthetic_profile(8, seed=3)

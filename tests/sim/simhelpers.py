"""Helpers for the simulator tests: a small synthetic model on an 8-node cluster."""

from __future__ import annotations

from oobleck.planning.profile import ClusterSpec
from oobleck.planning.synthetic import synthetic_profile
from oobleck.sim.params import strategy_params
from oobleck.strategy import StrategyContext

GB = 1e9


def make_context(memory_gb: float = 2.0, nodes: int = 8, fault_tolerance: int = 1, batch: int = 64) -> StrategyContext:
    # 12 layers of ~50 MB parameters: n0 = 2 nodes at 2 GB per device (1 GPU per node).
    return StrategyContext(
        profile=synthetic_profile(12, seed=1),
        cluster=ClusterSpec(nodes, 1, memory_gb * GB, 10 * GB, 1 * GB),
        global_batch_size=batch,
        microbatch_size=1,
        fault_tolerance=fault_tolerance,
    )


def with_strategy(context: StrategyContext, name: str, **overrides) -> StrategyContext:
    """The context with conf/strategy/<name>.yaml's constants plus ``overrides`` (shares templates)."""
    return context.with_params(strategy_params(name, overrides))

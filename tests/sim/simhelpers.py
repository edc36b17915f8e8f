"""Helpers for the simulator tests: a small synthetic model on an 8-node cluster."""

from __future__ import annotations

from omegaconf import OmegaConf

from oobleck.config import CONF_DIR
from oobleck.planning.inputs import ClusterSpec
from oobleck.planning.synthetic import synthetic_profile
from oobleck.strategy import Strategy, StrategyContext, build_strategy

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


def make_strategy(context: StrategyContext, name: str, **overrides) -> Strategy:
    """Strategy ``name``: conf/strategy/<name>.yaml with ``overrides`` (nested dicts for ``costs``) on ``context``."""
    return build_strategy(OmegaConf.load(CONF_DIR / "strategy" / f"{name}.yaml"), context, overrides)

"""Bamboo's settings (``strategy.*`` of ``conf/strategy/bamboo.yaml``, checked when built) and the
state of its pipelines: which node runs each stage slot, ``FAILED`` where a predecessor has taken
the slot over. What the settings mean: ``baselines.bamboo.policy``."""

from __future__ import annotations

from dataclasses import dataclass

from baselines.fixed_depth import PipelinesState
from oobleck.planning.outputs import REDUNDANCY_MODES
from oobleck.strategy import StrategyConfig

FAILED = -1  # a stage slot whose node failed; a neighbour runs it


@dataclass
class BambooConfig(StrategyConfig):
    _target_: str = "baselines.bamboo.policy.Bamboo"
    name: str = "bamboo"
    # Assumption: Bamboo falls back to checkpoints only for adjacent failures, so it checkpoints
    # rarely (neither paper states an interval).
    checkpoint_every_steps: int = 100
    pipeline_depth: int | None = None  # None: the fastest depth whose doubled state fits
    # Redundancy needs each stage's successor on another node: depth 1 would be plain data parallelism.
    min_pipeline_depth: int = 2
    # None: a failed-over pipeline is timed by the cost model (its merged stage runs both stages);
    # a number multiplies the iteration time instead while any pipeline is failed over (the
    # Oobleck artifact's Bamboo simulator used 1.5).
    failover_slowdown: float | None = None
    # Where the redundant forward runs: lazy (Bamboo's default), eager, or inline (policy's docstring).
    redundancy: str = "lazy"
    # inline only: share of the redundant forward on a stage's critical path (1: none hidden).
    redundant_forward_exposed: float = 1.0
    # eager and inline: the redundant forward's activations stay in device memory (memory model).
    keep_redundant_activations: bool = True
    # Activations take this many times the bytes the profile counts (2.0: fp32 against a
    # bf16/fp16 profile; Bamboo's released DeepSpeed configs have no fp16 section, so it trains
    # in fp32). Memory only: the iteration time stays the profile's.
    activation_bytes_factor: float = 1.0
    # Dissolve the most degraded pipeline into the others when faster (not in real Bamboo).
    rebalance: bool = False

    def __post_init__(self) -> None:
        from oobleck.errors import ConfigError

        if self.redundancy not in REDUNDANCY_MODES:
            raise ConfigError(
                f"strategy.redundancy={self.redundancy!r} must be one of {', '.join(REDUNDANCY_MODES)} "
                "(lazy is Bamboo's default; see baselines/bamboo/policy.py)"
            )
        if not float(self.activation_bytes_factor) > 0:
            raise ConfigError(
                f"strategy.activation_bytes_factor={self.activation_bytes_factor!r} must be > 0 "
                "(2.0: fp32 activations against a bf16 profile)"
            )
        if not 0.0 <= float(self.redundant_forward_exposed) <= 1.0:
            raise ConfigError(
                f"strategy.redundant_forward_exposed={self.redundant_forward_exposed!r} must be in [0, 1] "
                "(the share of the redundant forward that adds to a stage's time)"
            )


@dataclass(frozen=True)
class BambooState(PipelinesState):
    """A slot's node is FAILED when its predecessor runs it (failed over)."""

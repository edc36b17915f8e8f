"""Typed strategy constants: defaults here, values with their sources in conf/strategy/<name>.yaml.

Each strategy's ``params:`` mapping (from its YAML file, then ``sim.params.<name>`` overrides) is
turned into one of these frozen dataclasses; an unknown key or a wrong type is a ``ConfigError``
naming the strategy, key and value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TypeVar

from omegaconf import OmegaConf

from oobleck.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

P = TypeVar("P")


@dataclass(frozen=True)
class CommonParams:
    """Constants every strategy's cost model uses."""

    # fp32 Adam: parameters, gradients, two moments (DESIGN section 3).
    state_bytes_per_param: float = 16.0
    # Aggregate bandwidth to checkpoint storage; fit to the artifact's Varuna checkpoint times.
    storage_bandwidth_gbps: float = 0.95
    checkpoint_fixed_s: float = 4.4
    # Restart = fixed (new instances, rendezvous) + reading the state back.
    restart_fixed_s: float = 45.0
    restart_bandwidth_gbps: float = 0.167
    # Measured per-model figures take precedence over the formulas (model name -> seconds).
    checkpoint_s_by_model: dict[str, float] = field(default_factory=dict)
    restart_s_by_model: dict[str, float] = field(default_factory=dict)
    checkpoint_interval: int = 0  # iterations between checkpoints; 0 = none


@dataclass(frozen=True)
class OobleckParams(CommonParams):
    # Detect + plan + rebuild process groups, before any state moves.
    reconfigure_fixed_s: float = 2.0
    # Parameters and two Adam moments move with a layer; gradients are recomputed.
    moved_bytes_per_param: float = 12.0


@dataclass(frozen=True)
class VarunaParams(CommonParams):
    checkpoint_interval: int = 10
    # On a join Varuna checkpoints and restarts to morph onto the larger cluster.
    morph_on_join: bool = True


@dataclass(frozen=True)
class BambooParams(CommonParams):
    checkpoint_interval: int = 100
    pipeline_depth: Optional[int] = None  # None: the best depth whose redundant copy fits in memory
    # Redundancy needs a successor stage on another node: depth 1 would be plain data parallelism.
    min_pipeline_depth: int = 2
    failover_s: float = 1.0
    reconfigure_fixed_s: float = 30.0
    # None: the failover slowdown comes from the cost model (the predecessor runs both stages);
    # a number multiplies the iteration time instead while any pipeline is failed over.
    failover_slowdown: Optional[float] = None
    moved_bytes_per_param: float = 12.0


PARAMS_TYPES: dict[str, type] = {"oobleck": OobleckParams, "varuna": VarunaParams, "bamboo": BambooParams}


def parse_params(strategy: str, params: dict[str, Any]) -> Any:
    """Build the typed constants of ``strategy`` from a plain mapping; errors name key and value."""
    kind = PARAMS_TYPES[strategy]
    known = {f.name: f for f in dataclasses.fields(kind)}
    values: dict[str, Any] = {}
    for key, value in params.items():
        if key not in known:
            raise ConfigError(
                f"strategy {strategy}: unknown parameter {key}={value!r}; known: {', '.join(sorted(known))}"
            )
        default = getattr(kind(), key)
        if isinstance(default, dict):
            if not isinstance(value, dict):
                raise ConfigError(f"strategy {strategy}: {key}={value!r} must be a mapping model -> seconds")
            values[key] = {str(k): float(v) for k, v in value.items()}
        elif isinstance(default, bool):
            values[key] = bool(value)
        elif value is None:
            values[key] = None
        elif isinstance(default, (int, float)) or default is None:
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"strategy {strategy}: {key}={value!r} must be a number") from None
            if number < 0:
                raise ConfigError(f"strategy {strategy}: {key}={value!r} must be >= 0")
            values[key] = int(number) if isinstance(default, int) or key == "pipeline_depth" else number
        else:
            values[key] = value
    return kind(**values)


def strategy_params(
    strategy: str,
    overrides: dict[str, Any] | None = None,
    conf_dir: Path = CONF_DIR,
    section: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A strategy's constants: its config section (``section``, e.g. the composed ``cfg.strategy``,
    else conf/strategy/<strategy>.yaml): ``params`` plus ``checkpoint_interval``; then ``overrides``."""
    data = section
    if data is None:
        path = conf_dir / "strategy" / f"{strategy}.yaml"
        data = (OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}) if path.is_file() else {}
    merged: dict[str, Any] = dict(data.get("params") or {})  # type: ignore[union-attr]
    if data.get("checkpoint_interval") is not None:  # type: ignore[union-attr]
        merged["checkpoint_interval"] = data["checkpoint_interval"]  # type: ignore[index]
    merged.update(overrides or {})
    return merged

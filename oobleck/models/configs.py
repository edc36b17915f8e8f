"""Model configs by name outside Hydra (tests, benchmarks, notebooks): ``conf/model/<name>.yaml``
merged over the ``ModelConfig`` schema, exactly what ``model=<name>`` composes in a Hydra app."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from oobleck.config import ModelConfig
from oobleck.errors import ConfigError

MODEL_CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "model"


def model_names() -> list[str]:
    return sorted(path.stem for path in MODEL_CONF_DIR.glob("*.yaml"))


def load_model_config(name: str, **overrides: Any) -> DictConfig:
    """The typed config of model ``name`` with ``overrides`` (e.g. ``n_layer=2``) applied."""
    path = MODEL_CONF_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"model={name!r} has no {path}; choose one of {', '.join(model_names())}")
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path), overrides)
    return cfg  # type: ignore[return-value]

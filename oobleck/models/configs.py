"""Model configs by name outside Hydra (tests, benchmarks, notebooks): exactly what ``model=<name>``
composes in a Hydra app (``conf/model/<name>.yaml``), typed by its family."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from oobleck.config import group_names, load_group
from oobleck.models.registry import model_config


def model_names() -> list[str]:
    return group_names("model")


def load_model_config(name: str, **overrides: Any) -> DictConfig:
    """The config of model ``name`` with ``overrides`` (e.g. ``n_layer=2``) applied, typed and
    checked by its family (a ``DictConfig`` that can still be changed, like Hydra's)."""
    typed = OmegaConf.structured(model_config(load_group("model", name, **overrides)))
    OmegaConf.set_readonly(typed, False)
    return typed

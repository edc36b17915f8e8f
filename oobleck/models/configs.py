"""Model configs by name outside Hydra (tests, benchmarks, notebooks): exactly what ``model=<name>``
composes in a Hydra app (the schema, config.yaml's shared ``model:`` values, ``conf/model/<name>.yaml``)."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from oobleck.config import group_names, load_group


def model_names() -> list[str]:
    return group_names("model")


def load_model_config(name: str, **overrides: Any) -> DictConfig:
    """The typed config of model ``name`` with ``overrides`` (e.g. ``n_layer=2``) applied."""
    return load_group("model", name, **overrides)

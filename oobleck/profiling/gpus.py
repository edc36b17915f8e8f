"""Named GPUs outside Hydra (simulator, tests, notebooks): the same values ``gpu=<name>`` puts in
``cluster.gpu`` in a Hydra app (``conf/gpu/<name>.yaml`` over the ``GPUConfig`` schema)."""

from __future__ import annotations

from omegaconf import DictConfig

from oobleck.schema import group_names, load_group


def gpu_names() -> list[str]:
    return group_names("gpu")


def load_gpu_config(name: str) -> DictConfig:
    return load_group("gpu", name)

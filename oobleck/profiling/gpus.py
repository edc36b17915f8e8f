"""Named GPUs outside Hydra (simulator, tests, notebooks): ``conf/gpu/<name>.yaml`` over the
``GPUConfig`` schema, the same values ``gpu=<name>`` puts in ``cluster.gpu`` in a Hydra app."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from oobleck.config import GPUConfig
from oobleck.errors import ConfigError

GPU_CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "gpu"


def gpu_names() -> list[str]:
    return sorted(path.stem for path in GPU_CONF_DIR.glob("*.yaml"))


def load_gpu_config(name: str) -> DictConfig:
    path = GPU_CONF_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"gpu={name!r} has no {path}; choose one of {', '.join(gpu_names())}")
    return OmegaConf.merge(OmegaConf.structured(GPUConfig), OmegaConf.load(path))  # type: ignore[return-value]

"""Small configs for tests and benchmarks of real runs.

``tiny_config`` is the command line's config (composed from conf/ by Hydra, so tests start from
the same defaults as ``python -m oobleck.run``) with gpt3_tiny, a short job, no failures, wandb
off and final parameters collected; ``config_section`` one section of those defaults.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from omegaconf import OmegaConf

from oobleck.config import compose_config


@functools.lru_cache(maxsize=1)
def _default_config() -> Any:
    return compose_config()


@functools.lru_cache(maxsize=128)
def _composed_once(overrides: tuple[str, ...]) -> Any:
    return compose_config(*overrides)


def composed(*overrides: str) -> Any:
    """``compose_config(*overrides)``, composed once per process and copied on every call.

    Hydra's compose reads and merges every YAML file again (about 0.25 s), and the suite composes
    the same few configs hundreds of times. Each caller gets its own copy to change; the copy
    keeps interpolations unresolved (``oc.env``: the environment is read when a value is used).
    Inside a running Hydra app ``compose_config`` follows that app's search path: not cached."""
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose_config(*overrides)
    return copy.deepcopy(_composed_once(tuple(overrides)))


def config_section(section: str, **values: Any) -> Any:
    """A section of the command line's default config (e.g. ``"job"``, ``"failures"``) with
    ``values`` merged in: the YAML's values, typed by the schema, without composing a whole run."""
    return OmegaConf.merge(_default_config()[section], values)


def tiny_config(*groups: str, **overrides: Any) -> Any:
    """gpt3_tiny with a 4-step job; ``groups`` are config-group choices (e.g. ``"strategy=varuna"``),
    ``overrides`` dotted keys (``**{"cluster.nodes": 6}``)."""
    cfg = composed("model=gpt3_tiny", "failures=none", *groups)
    cfg.job.steps = 4
    cfg.job.global_batch_size = 16
    cfg.job.microbatch_size = 2
    cfg.job.warmup_steps = 2
    cfg.logger.wandb.mode = "disabled"
    cfg.logger.progress_bar = False
    cfg.runtime.save_final_params = True
    cfg.cluster.heartbeat_timeout_s = 5.0
    cfg.cluster.collective_timeout_s = 20.0
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=True)
    return cfg

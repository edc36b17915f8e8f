"""The ``checkpoint:`` config section's checks, beside the code that reads it (the schema,
``CheckpointConfig``, is in ``oobleck.config`` with the others; ``oobleck.config.validate`` calls
this). Torch-free."""

from __future__ import annotations

from typing import Any

from oobleck.checks import positive
from oobleck.errors import ConfigError


def check_checkpoint(cfg: Any) -> None:
    """``checkpoint.*`` and ``job.resume`` (where a run resumes from), as ``ConfigError``."""
    checkpoint = cfg.checkpoint
    if checkpoint.every_steps is not None:
        positive("checkpoint.every_steps", checkpoint.every_steps, allow_zero=True)
    if checkpoint.every_s is not None:
        positive("checkpoint.every_s", checkpoint.every_s)
    if checkpoint.keep < 1:
        raise ConfigError(
            f"checkpoint.keep={checkpoint.keep} must be >= 1 (the newest complete checkpoint is always kept)"
        )
    positive("checkpoint.io_threads", checkpoint.io_threads)
    positive("checkpoint.max_pending", checkpoint.max_pending)
    positive("checkpoint.write_timeout_s", checkpoint.write_timeout_s)
    if checkpoint.dir is not None and not str(checkpoint.dir).strip():
        raise ConfigError(
            "checkpoint.dir='' is empty; set checkpoint.dir=<path> or checkpoint.dir=null for <run dir>/checkpoints"
        )
    if cfg.job.resume is not None and not str(cfg.job.resume).strip():
        raise ConfigError(
            "job.resume='' is empty; set job.resume=null (fresh start), job.resume=auto or job.resume=<checkpoint path>"
        )

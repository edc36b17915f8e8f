"""The ``job:`` (what is trained, on which batches) and ``runtime:`` config sections' checks,
beside the runtime that trains it; ``oobleck.config.validate`` calls them. Torch-free."""

from __future__ import annotations

from typing import Any

from oobleck.checks import choice, positive
from oobleck.errors import ConfigError
from oobleck.planning.instantiate import MAX_MICROBATCHES, microbatch_limit_message

DATASETS = ("corpus", "synthetic")


def check_job(job: Any) -> None:
    """``job.*`` as ``ConfigError`` (``job.resume``: ``oobleck.checkpoint.settings``)."""
    if job.fault_tolerance < 0:
        raise ConfigError(f"job.fault_tolerance={job.fault_tolerance} must be >= 0")
    positive("job.microbatch_size", job.microbatch_size)
    positive("job.global_batch_size", job.global_batch_size)
    if job.global_batch_size % job.microbatch_size:
        raise ConfigError(
            f"job.global_batch_size={job.global_batch_size} is not divisible by "
            f"job.microbatch_size={job.microbatch_size}; make the batch a multiple of the microbatch"
        )
    microbatches = job.global_batch_size // job.microbatch_size
    if microbatches > MAX_MICROBATCHES:
        raise ConfigError(microbatch_limit_message(job.global_batch_size, job.microbatch_size))
    if microbatches < job.fault_tolerance + 1:
        raise ConfigError(
            f"job.global_batch_size={job.global_batch_size} gives {microbatches} microbatches of "
            f"{job.microbatch_size}, fewer than the f+1={job.fault_tolerance + 1} pipelines "
            "job.fault_tolerance needs; raise the batch or lower the microbatch size"
        )
    positive("job.steps", job.steps)
    if job.seed < 0:
        raise ConfigError(f"job.seed={job.seed} must be >= 0 (seeds are non-negative)")
    positive("job.lr", job.lr)
    positive("job.min_lr", job.min_lr, allow_zero=True)
    positive("job.warmup_steps", job.warmup_steps, allow_zero=True)
    positive("job.grad_clip", job.grad_clip, allow_zero=True)
    choice("job.dataset", job.dataset, DATASETS)
    positive("job.synthetic_samples", job.synthetic_samples)


def check_runtime(runtime: Any) -> None:
    """``runtime.*`` as ``ConfigError``."""
    positive("runtime.bucket_mb", runtime.bucket_mb)
    positive("runtime.link_probe_mb", runtime.link_probe_mb, allow_zero=True)

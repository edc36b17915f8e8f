"""The ``profile:`` config section's checks and those of ``cluster.gpu`` (the hardware the analytic
profile models), beside the profiler that reads them; ``oobleck.config.validate`` calls them.
Torch-free."""

from __future__ import annotations

from typing import Any

from oobleck.checks import choice, positive
from oobleck.errors import ConfigError

PROFILE_SOURCES = ("auto", "measured", "analytic", "file")


def check_profile(profile: Any) -> None:
    """``profile.*`` as ``ConfigError``."""
    choice("profile.source", profile.source, PROFILE_SOURCES)
    if profile.source == "file" and not profile.path:
        raise ConfigError("profile.source=file needs profile.path=<profile JSON written by python -m oobleck.profile>")
    positive("profile.repeats", profile.repeats)
    positive("profile.warmup", profile.warmup, allow_zero=True)
    positive("profile.allreduce_timeout_s", profile.allreduce_timeout_s)
    for size in profile.allreduce_group_sizes:
        if size < 2:
            raise ConfigError(f"profile.allreduce_group_sizes contains {size}; all-reduce groups need >= 2 ranks")
    for nbytes in profile.allreduce_bytes:
        positive("profile.allreduce_bytes[]", nbytes)
    if profile.split_backward_max_ratio is not None:
        positive("profile.split_backward_max_ratio", profile.split_backward_max_ratio)


def check_gpu(gpu: Any) -> None:
    """``cluster.gpu.*`` (``gpu=<name>``) as ``ConfigError``."""
    for key in ("peak_tflops", "memory_gb", "memory_bandwidth_gbps", "activation_bytes_per_value"):
        positive(f"cluster.gpu.{key}", getattr(gpu, key))
    for key in ("achieved_flop_fraction", "achieved_bandwidth_fraction"):
        if not 0 < getattr(gpu, key) <= 1:
            raise ConfigError(f"cluster.gpu.{key}={getattr(gpu, key)} must be in (0, 1]")

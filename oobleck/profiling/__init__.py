"""Per-layer profiles for the planner: measured (real forward and backward per layer, all-reduce by
group size, cached as JSON), analytic (FLOP/byte roofline of a named GPU), or loaded from a file.
``get_profile(cfg)`` picks the source ``profile.source`` names (see ``oobleck.profiling.api``).

The analytic profiles, the named GPUs and the cache's names are torch-free; the measuring parts
(``api``, ``measure``, ``allreduce``) load on first use (``from oobleck.profiling import
get_profile``), so the simulator plans paper-scale models without importing torch.
"""

from typing import TYPE_CHECKING, Any

from oobleck.profiling.analytic import analytic_profile
from oobleck.profiling.cache import ProfileCacheWarning, cache_key, cache_path
from oobleck.profiling.gpus import gpu_names, load_gpu_config

if TYPE_CHECKING:
    from oobleck.profiling.allreduce import measure_allreduce
    from oobleck.profiling.api import cached_measured_profile, get_profile, load_profile_file, resolve_source
    from oobleck.profiling.measure import device_label, measure_layer, measure_profile

_NEEDS_TORCH = {
    "oobleck.profiling.allreduce": ("measure_allreduce",),
    "oobleck.profiling.api": ("cached_measured_profile", "get_profile", "load_profile_file", "resolve_source"),
    "oobleck.profiling.measure": ("device_label", "measure_layer", "measure_profile"),
}


def __getattr__(name: str) -> Any:
    import importlib

    for module, names in _NEEDS_TORCH.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'oobleck.profiling' has no attribute {name!r}")


__all__ = [
    "ProfileCacheWarning",
    "analytic_profile",
    "cache_key",
    "cache_path",
    "cached_measured_profile",
    "device_label",
    "get_profile",
    "gpu_names",
    "load_gpu_config",
    "load_profile_file",
    "measure_allreduce",
    "measure_layer",
    "measure_profile",
    "resolve_source",
]

"""Per-layer profiles for the planner: measured (real forward and backward per layer, all-reduce by
group size, cached as JSON), analytic (FLOP/byte roofline of a named GPU), or loaded from a file.
``get_profile(cfg)`` picks the source ``profile.source`` names (see ``oobleck.profiling.api``)."""

from oobleck.profiling.allreduce import measure_allreduce
from oobleck.profiling.analytic import analytic_profile
from oobleck.profiling.api import cached_measured_profile, get_profile, load_profile_file, resolve_source
from oobleck.profiling.cache import ProfileCacheWarning, cache_key, cache_path
from oobleck.profiling.gpus import gpu_names, load_gpu_config
from oobleck.profiling.measure import device_label, measure_layer, measure_profile

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

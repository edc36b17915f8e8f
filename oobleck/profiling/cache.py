"""The measured-profile cache: JSON files under ``profile.cache_dir`` (``<paths.cache_dir>/profiles``,
by default ``~/.cache/oobleck/profiles``; ``OOBLECK_CACHE_DIR`` moves it).

A file is named by model, microbatch size and device, and stores the key it was made for: a hash
of the model config, microbatch size, device, torch version, profile schema, what a
measurement holds (``MEASUREMENT``) and the bound on its split backward
(``profile.split_backward_max_ratio``). A file whose stored key differs (the model config, torch or
the schema changed: *stale*) or that does not load (truncated, not JSON, invalid values:
*corrupt*) is reported with a warning and re-profiled; the caller then overwrites it.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from oobleck.errors import ProfileError
from oobleck.plain import resolved_dict
from oobleck.planning.inputs import PROFILE_SCHEMA_VERSION, ModelProfile

# What a measured profile holds; a cached file measured before a field was added is re-measured.
# 2: the backward split into input and weight passes (LayerProfile.backward_input_s/_weight_s).
# 3: those passes as fractions of the same repeat's fused backward, their sum bounded
# (oobleck.profiling.measure.split_backward_passes).
MEASUREMENT = 3


class ProfileCacheWarning(UserWarning):
    """A cached profile was stale or corrupt and is being re-profiled."""


def _plain(model_cfg: Any) -> dict[str, Any]:
    return resolved_dict(model_cfg if isinstance(model_cfg, DictConfig) else OmegaConf.structured(model_cfg))


def cache_key(
    model_cfg: Any,
    microbatch_size: int,
    device: str,
    torch_version: str,
    *,
    split_backward_max_ratio: float | None = None,
) -> str:
    payload = {
        "model": _plain(model_cfg),
        "microbatch_size": int(microbatch_size),
        "device": device,
        "torch": torch_version,
        "schema": PROFILE_SCHEMA_VERSION,
        "measurement": MEASUREMENT,
        "split_backward_max_ratio": split_backward_max_ratio,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def cache_path(cache_dir: str | Path, model_name: str, microbatch_size: int, device: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", device)
    return Path(cache_dir).expanduser() / f"{model_name}-mb{microbatch_size}-{slug}.json"


def load_cached(path: Path, key: str) -> ModelProfile | None:
    """The cached profile at ``path`` if it exists and was made for ``key``; else ``None``
    (with a ``ProfileCacheWarning`` when a file was there but stale or corrupt)."""
    if not path.exists():
        return None
    try:
        profile = ModelProfile.load(path)
    except ProfileError as error:
        warnings.warn(f"profile cache {path} is corrupt ({error}); re-profiling", ProfileCacheWarning, stacklevel=2)
        return None
    if profile.cache_key != key:
        warnings.warn(
            f"profile cache {path} is stale (made for another model config, device or torch version); re-profiling",
            ProfileCacheWarning,
            stacklevel=2,
        )
        return None
    return profile

"""``get_profile(cfg)``: the planner's profile for a config, from the source ``profile.source`` names.

- ``file``: load ``profile.path`` (written by ``python -m oobleck.profile``) and check it matches the
  model and microbatch size of the config.
- ``measured``: measure on ``cluster.device`` here (cached under ``profile.cache_dir``, see
  ``oobleck.profiling.cache``), plus all-reduce samples for ``profile.allreduce_group_sizes`` on
  the device's backend. A measurement that would not fit the device or take longer than
  ``profile.max_measure_s`` is refused first (``oobleck.profiling.feasibility``); one that starts
  says what it measures and shows a bar over the layers.
- ``analytic``: the FLOP/byte model of ``cluster.gpu`` (``gpu=<name>``, ``conf/gpu/``).
- ``auto`` (the default): ``file`` when ``profile.path`` is set; otherwise ``measured`` when the
  configured device exists on this machine (always for ``cpu``; ``cuda`` when CUDA is available),
  so real runs plan from real numbers; otherwise ``analytic`` for ``cluster.gpu``, so paper-scale
  GPU configs can be planned and simulated on a machine without GPUs.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import torch
from omegaconf import OmegaConf

from oobleck.errors import ProfileError
from oobleck.models.registry import architecture
from oobleck.planning.inputs import ModelProfile
from oobleck.profiling.allreduce import measure_allreduce
from oobleck.profiling.analytic import analytic_profile
from oobleck.profiling.cache import cache_key, cache_path, load_cached
from oobleck.profiling.feasibility import check_measurement
from oobleck.profiling.measure import device_label, measure_profile

log = logging.getLogger(__name__)


def resolve_source(cfg: Any) -> str:
    """The concrete source (file | measured | analytic) ``profile.source`` means here."""
    source = cfg.profile.source
    if source != "auto":
        return source
    if cfg.profile.path:
        return "file"
    if cfg.cluster.device == "cpu" or torch.cuda.is_available():
        return "measured"
    return "analytic"


def load_profile_file(path: str, model_cfg: Any, microbatch_size: int) -> ModelProfile:
    profile = ModelProfile.load(path)
    expected_layers = architecture(model_cfg).num_layers
    if profile.model != model_cfg.name or profile.num_layers != expected_layers:
        raise ProfileError(
            f"{path} profiles model {profile.model!r} with {profile.num_layers} layers, but model={model_cfg.name} "
            f"has {expected_layers}; profile this model (python -m oobleck.profile model={model_cfg.name})"
        )
    if profile.microbatch_size != microbatch_size:
        raise ProfileError(
            f"{path} was profiled at microbatch size {profile.microbatch_size}, but job.microbatch_size={microbatch_size}; "
            f"re-profile with job.microbatch_size={microbatch_size} or set job.microbatch_size={profile.microbatch_size}"
        )
    return profile


def cached_measured_profile(cfg: Any, *, refresh: bool = False, progress: Any | None = None) -> ModelProfile:
    """The measured profile for ``cfg`` from the cache, measuring (and caching) it when missing,
    stale or corrupt, or when ``refresh``."""
    device = torch.device("cuda" if cfg.cluster.device == "cuda" else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError(
            "profile.source=measured with cluster.device=cuda, but CUDA is not available here; "
            "use profile.source=analytic (gpu=<name>) or cluster.device=cpu"
        )
    label = device_label(device)
    microbatch = int(cfg.job.microbatch_size)
    # A run config written before the key existed has none: no bound, as it was measured then.
    bound = OmegaConf.select(cfg, "profile.split_backward_max_ratio", default=None, throw_on_missing=False)
    key = cache_key(cfg.model, microbatch, label, torch.__version__, split_backward_max_ratio=bound)
    path = cache_path(cfg.profile.cache_dir, cfg.model.name, microbatch, label)
    if not refresh:
        cached = load_cached(path, key)
        if cached is not None:
            log.info("profile cache hit: %s", path)
            return cached
    estimate = check_measurement(cfg, device)
    say = _say if progress is None else (lambda line: None)
    layers = architecture(cfg.model).num_layers
    say(
        f"profiling model={cfg.model.name} on {label}: {layers} layers x "
        f"{int(cfg.profile.warmup) + int(cfg.profile.repeats)} x 2 forward+backward runs (fused and split "
        f"backward), {estimate.describe()}"
    )
    with _layer_bar(cfg, layers, progress) as step:
        profile = measure_profile(
            cfg.model,
            microbatch,
            device,
            warmup=int(cfg.profile.warmup),
            repeats=int(cfg.profile.repeats),
            seed=int(cfg.job.seed),
            threads=int(cfg.cluster.torch_threads) or None,
            progress=step,
            split_backward_max_ratio=None if bound is None else float(bound),
        )
    group_sizes = list(cfg.profile.allreduce_group_sizes)
    if device.type == "cuda":
        group_sizes = [k for k in group_sizes if k <= torch.cuda.device_count()]
    if group_sizes and list(cfg.profile.allreduce_bytes):
        say(
            f"profiling all-reduce on {'nccl' if device.type == 'cuda' else 'gloo'}: groups of {group_sizes} ranks (starts {max(group_sizes)} processes) ..."
        )
    samples = measure_allreduce(
        group_sizes,
        list(cfg.profile.allreduce_bytes),
        backend="nccl" if device.type == "cuda" else "gloo",
        warmup=int(cfg.profile.warmup),
        repeats=int(cfg.profile.repeats),
        timeout_s=float(cfg.profile.allreduce_timeout_s),
    )
    data = profile.to_dict()
    data["allreduce"] = [asdict(sample) for sample in samples]
    data["cache_key"] = key
    profile = ModelProfile.from_dict(data, origin="measured profile")
    profile.save(path)
    say(
        f"measured model={cfg.model.name}'s layers in {profile.metadata.get('profiling_seconds', 0.0):.1f} s; cached in {path}"
    )
    return profile


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _layer_bar(
    cfg: Any, layers: int, progress: Callable[[int, int], None] | None
) -> Iterator[Callable[[int, int], None]]:
    """The per-layer progress callback: the caller's, else a bar (``logger.progress_bar``)."""
    if progress is not None:
        yield progress
        return
    from tqdm import tqdm

    with tqdm(
        total=layers,
        desc=f"profile {cfg.model.name}",
        unit="layer",
        disable=not OmegaConf.select(cfg, "logger.progress_bar", default=True),
    ) as bar:
        yield lambda done, total: bar.update(done - bar.n)


def get_profile(cfg: Any, *, progress: Any | None = None) -> ModelProfile:
    """The per-layer profile the planner uses for ``cfg`` (see the module doc for the sources)."""
    source = resolve_source(cfg)
    microbatch = int(cfg.job.microbatch_size)
    if source == "file":
        if not cfg.profile.path:
            raise ProfileError(
                "profile.source=file needs profile.path=<profile JSON written by python -m oobleck.profile>"
            )
        return load_profile_file(cfg.profile.path, cfg.model, microbatch)
    if source == "measured":
        return cached_measured_profile(cfg, progress=progress)
    if source == "analytic":
        return analytic_profile(cfg.model, cfg.cluster.gpu, microbatch)
    raise ProfileError(f"profile.source={cfg.profile.source!r} is not one of auto, measured, analytic, file")

"""``python -m oobleck.profile``: profile a model and write ``profile.json`` to the run dir.

A Hydra app over ``conf/config.yaml``: ``model=<name>``, ``job.microbatch_size``,
``profile.source=auto|measured|analytic|file`` (``gpu=<name>`` for analytic), ``cluster.device``.
Prints one row per layer (times, memory, boundary bytes) and the all-reduce samples. A measured
profile is also cached under ``profile.cache_dir`` (``+refresh=true`` is not needed: a stale or
corrupt cache is re-profiled automatically).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

import oobleck.config  # noqa: F401  (registers the schema before Hydra composes)
from oobleck.config import validate
from oobleck.errors import report_errors, run_app
from oobleck.planning.profile import ModelProfile

MB = 1 << 20


def format_profile(profile: ModelProfile) -> str:
    """A per-layer table of ``profile`` (times in ms, sizes in MiB) and its all-reduce samples."""
    lines = [
        f"model {profile.model}  microbatch {profile.microbatch_size}  device {profile.device}  "
        f"source {profile.source}  layers {profile.num_layers}  params {profile.param_bytes / 4 / 1e6:.2f} M",
        f"{'#':>3} {'layer':<10} {'fwd ms':>10} {'bwd ms':>10} {'params MiB':>11} {'activ MiB':>10} {'output MiB':>11}",
    ]
    for index, layer in enumerate(profile.layers):
        lines.append(
            f"{index:>3} {layer.name:<10} {layer.forward_s * 1e3:>10.3f} {layer.backward_s * 1e3:>10.3f} "
            f"{layer.param_bytes / MB:>11.3f} {layer.activation_bytes / MB:>10.3f} {layer.output_bytes / MB:>11.3f}"
        )
    fwd = sum(layer.forward_s for layer in profile.layers)
    bwd = sum(layer.backward_s for layer in profile.layers)
    lines.append(f"{'':>3} {'total':<10} {fwd * 1e3:>10.3f} {bwd * 1e3:>10.3f} {profile.param_bytes / MB:>11.3f}")
    if profile.tied_layers:
        lines.append(f"tied layers: {', '.join(f'{a}<->{b}' for a, b in profile.tied_layers)}")
    for sample in profile.allreduce:
        lines.append(
            f"all-reduce {sample.scope}: {sample.group_size} ranks, {sample.nbytes / MB:.1f} MiB: {sample.seconds * 1e3:.3f} ms"
        )
    return "\n".join(lines)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    with report_errors("oobleck.profile"):
        validate(cfg)
        from oobleck.profiling import get_profile  # imports torch: after the config is known good

        profile = get_profile(cfg)
        out = Path(HydraConfig.get().runtime.output_dir) / "profile.json"
        profile.save(out)
        print(format_profile(profile))
        print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    run_app(main, "oobleck.profile")

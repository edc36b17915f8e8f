"""``python -m oobleck.profile``: profile a model and write ``profile.json`` to the run dir.

A Hydra app over ``conf/config.yaml``: ``model=<name>``, ``job.microbatch_size``,
``profile.source=auto|measured|analytic|file`` (``gpu=<name>`` for analytic), ``cluster.device``.
Prints one row per layer (times, memory, boundary bytes) and the all-reduce samples. A measured
profile is also cached under ``profile.cache_dir`` (``paths.cache_dir``; a stale or corrupt cache
is re-profiled automatically). A progress bar follows the layers; a measurement that would not
fit this device or would take longer than ``profile.max_measure_s`` is refused before it starts.
Installed, the command is ``oobleck-profile``.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from oobleck.cli import entry, run_app
from oobleck.config import CONF_DIR, register_configs, validate
from oobleck.planning.inputs import ModelProfile

PROGRAM = "oobleck.profile"
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


register_configs()  # before @hydra.main composes: conf/config.yaml starts from the schema


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with entry(PROGRAM) as run_dir:
        validate(cfg)
        from oobleck.profiling import get_profile  # imports torch: after the config is known good

        profile = get_profile(cfg)
        out = run_dir / "profile.json"
        profile.save(out)
        print(format_profile(profile))
        print(f"wrote {out}", file=sys.stderr)


def cli() -> None:
    """The ``oobleck-profile`` command."""
    run_app(main, PROGRAM)


if __name__ == "__main__":
    cli()

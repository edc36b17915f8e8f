"""``python -m oobleck.simulate``: trace-driven simulation of resilience strategies (Hydra app).

Runs every (model, trace, shifted start, strategy) of the ``sim:`` section
(``experiment=paper_failure_frequency`` or ``experiment=paper_spot`` set it up like the paper),
then writes to the Hydra run dir: ``sim_metrics.csv`` (throughput over time), ``sim_events.csv``,
``sim_summary.csv`` (one row per model, trace, start and strategy), ``sim_ratios.csv`` (Oobleck's
speedups: median and range over the starts), ``summary.json`` and, unless ``sim.figures=false``,
the seaborn figures of ``analysis.figures`` (PNG and PDF); unless ``logger.wandb.mode=disabled``,
one wandb run per (model, trace, strategy) of the unshifted start (``oobleck.metrics.simulation``).
Installed, the command is ``oobleck-simulate``.

Without ``experiment=`` it simulates the config's own cluster, the local toy settings (CPU-sized
links, batch 32), which is not the paper's setting; it says so before and after. Ctrl-C writes the
outputs of the models simulated so far. Examples::

    python -m oobleck.simulate experiment=paper_failure_frequency
    python -m oobleck.simulate experiment=paper_spot sim.models=[gpt3_2_7b] sim.traces=[spot/ec2_p3_scaled] sim.strategies=[oobleck,varuna]
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, open_dict

from oobleck.cli import Interrupted, entry, run_app
from oobleck.config import CONF_DIR, group_names, register_configs, to_container, validate

PROGRAM = "oobleck.simulate"


def summary_table(summary) -> str:
    """A compact text table: throughput per (model, trace) and strategy, plus Oobleck's speedups
    (``OOM`` where a baseline does not fit in memory)."""
    from analysis.load import format_throughput_table

    if summary.empty:
        return "(no runs)"
    note = "\n(ratios: median [min-max] over the shifted starts; * kept no durable progress in some start)"
    starts = summary["start"].nunique() if "start" in summary else 1
    return format_throughput_table(summary) + (
        note if starts > 1 or ("no_durable_progress" in summary and summary["no_durable_progress"].any()) else ""
    )


def run_sections(cfg: DictConfig, model: str, strategy: str) -> dict[str, Any]:
    """The ``model`` and ``strategy`` sections of one simulated run's config, as it ran (its wandb run
    shows them where a real run's config has them)."""
    from omegaconf import OmegaConf

    from oobleck.sim.experiment import model_config, strategy_settings

    return {
        "model": OmegaConf.to_container(model_config(model), resolve=True),
        "strategy": strategy_settings(cfg, strategy),
    }


def toy_setting_notice(cfg: DictConfig) -> str | None:
    """The loud line for a simulation without ``experiment=`` (None with one): what it simulates."""
    if cfg.experiment != "default":
        return None
    cluster, job = cfg.cluster, cfg.job
    experiments = ", ".join(f"experiment={name}" for name in group_names("experiment"))
    return (
        f"{PROGRAM}: NOTE: no experiment= given, so this simulates the config's own toy setting "
        f"(cluster={cluster.kind}: {cluster.gpus_per_node} {cluster.gpu.name} per node, "
        f"{cluster.inter_node_bandwidth_gbps:g} GB/s between nodes, batch {job.global_batch_size} of "
        f"{job.microbatch_size}), not the paper's; for the paper's settings use {experiments}"
    )


def _one_model(cfg: DictConfig, model: str) -> DictConfig:
    part = copy.deepcopy(cfg)
    with open_dict(part):
        part.sim.models = [model]
    return part


def _combined(parts: list) -> Any:
    """The per-model results as one experiment's (each table concatenated, the wall times summed)."""
    import pandas as pd

    from oobleck.sim.experiment import ExperimentResult

    def table(name: str) -> pd.DataFrame:
        frames = [getattr(part, name) for part in parts if not getattr(part, name).empty]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    return ExperimentResult(
        table("metrics"), table("events"), table("summary"), sum(part.seconds for part in parts), table("ratios")
    )


def run(cfg: DictConfig, run_dir: Path) -> dict:
    from tqdm import tqdm

    from oobleck.sim.experiment import run_experiment, write_outputs

    validate(cfg)
    notice = toy_setting_notice(cfg)
    if notice:
        print(notice, file=sys.stderr, flush=True)
    models = list(cfg.sim.models)
    total = len(models) * len(cfg.sim.traces) * int(cfg.sim.trace_starts) * len(cfg.sim.strategies)
    parts: list = []
    interrupted = False
    with tqdm(total=total, desc="simulate", unit="run", disable=not cfg.logger.progress_bar) as bar:

        def progress(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)

        # One model at a time (its templates are shared by its traces and strategies), so Ctrl-C
        # keeps every model finished before it.
        try:
            for model in models:
                parts.append(run_experiment(_one_model(cfg, model), progress=progress))
        except KeyboardInterrupt:
            interrupted = True
    result = _combined(parts)
    config = to_container(cfg)
    done = [str(m) for m in models[: len(parts)]]
    extra = {"experiment": cfg.experiment, "sim": config["sim"]}
    if interrupted:
        extra["interrupted"] = {"models_done": done, "models_requested": models}
    paths = write_outputs(result, run_dir, extra=extra)
    if interrupted:
        raise Interrupted(
            f"wrote the {len(done)} of {len(models)} models simulated so far ({', '.join(done) or 'none'}) "
            f"to {paths['summary_csv']} and the other sim_*.csv in {run_dir}"
        )
    figures = []
    if cfg.sim.figures:
        from analysis.figures import write_figures

        print(f"{PROGRAM}: writing figures to {run_dir} ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        figures = write_figures(result.metrics, result.summary, run_dir, bin_s=float(cfg.sim.timeline_bin_s))
        print(
            f"{PROGRAM}: wrote {len(figures)} figure files in {time.perf_counter() - started:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    if cfg.logger.wandb.mode != "disabled":
        from oobleck.metrics.simulation import log_simulation

        print(
            f"{PROGRAM}: logging {len(result.summary)} simulations to wandb ({cfg.logger.wandb.mode}) ...",
            file=sys.stderr,
            flush=True,
        )
        log_simulation(cfg, result.first_start(), figures, run_dir, config, lambda m, s: run_sections(cfg, m, s))
    print(summary_table(result.summary), flush=True)
    print(f"{PROGRAM}: {total} simulations in {result.seconds:.1f} s; outputs in {run_dir}", flush=True)
    if notice:
        print(notice, file=sys.stderr, flush=True)
    return {k: str(v) for k, v in paths.items()}


register_configs()  # before @hydra.main composes: conf/config.yaml starts from the schema


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with entry(PROGRAM) as run_dir:
        run(cfg, run_dir)


def cli() -> None:
    """The ``oobleck-simulate`` command."""
    run_app(main, PROGRAM)


if __name__ == "__main__":
    cli()

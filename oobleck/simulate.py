"""``python -m oobleck.simulate``: trace-driven simulation of resilience strategies (Hydra app).

Runs every (model, trace, shifted start, strategy) of the ``sim:`` section
(``experiment=paper_failure_frequency`` or ``experiment=paper_spot`` set it up like the paper),
then writes to the Hydra run dir: ``sim_metrics.csv`` (throughput over time), ``sim_events.csv``,
``sim_summary.csv`` (one row per model, trace, start and strategy), ``sim_ratios.csv`` (Oobleck's
speedups: median and range over the starts), ``summary.json`` and, unless ``sim.figures=false``,
the seaborn figures of ``analysis.figures`` (PNG and PDF); unless ``logger.wandb.mode=disabled``,
one wandb run per (model, trace, strategy) of the unshifted start (``oobleck.metrics.simulation``).
Examples::

    python -m oobleck.simulate experiment=paper_failure_frequency
    python -m oobleck.simulate sim.models=[gpt3_2_7b] sim.traces=[spot/ec2_p3_scaled] sim.strategies=[oobleck,varuna]
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

import oobleck.config  # noqa: F401  (registers the schema)
from oobleck.config import to_container, validate
from oobleck.errors import report_errors, run_app

PROGRAM = "oobleck.simulate"


def summary_table(summary) -> str:
    """A compact text table: throughput per (model, trace) and strategy, plus Oobleck's speedups
    (``OOM`` where a baseline does not fit in memory)."""
    from analysis.load import format_throughput_table

    if summary.empty:
        return "(no runs)"
    note = "\n(ratios: median [min-max] over the shifted starts; * kept no durable progress in some start)"
    starts = summary["start"].nunique() if "start" in summary else 1
    return format_throughput_table(summary) + (note if starts > 1 or ("no_durable_progress" in summary and summary["no_durable_progress"].any()) else "")


def run(cfg: DictConfig, run_dir: Path) -> dict:
    from tqdm import tqdm

    from oobleck.sim.experiment import run_experiment, write_outputs

    validate(cfg)
    total = len(cfg.sim.models) * len(cfg.sim.traces) * int(cfg.sim.trace_starts) * len(cfg.sim.strategies)
    with tqdm(total=total, desc="simulate", unit="run", disable=not cfg.logger.progress_bar) as bar:

        def progress(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)

        result = run_experiment(cfg, progress=progress)
    config = to_container(cfg)
    paths = write_outputs(result, run_dir, extra={"experiment": cfg.experiment, "sim": config["sim"]})
    figures = []
    if cfg.sim.figures:
        from analysis.figures import write_figures

        figures = write_figures(result.metrics, result.summary, run_dir, bin_s=float(cfg.sim.timeline_bin_s))
    if cfg.logger.wandb.mode != "disabled":
        from oobleck.metrics.simulation import log_simulation

        log_simulation(cfg, result.first_start(), figures, run_dir, config)
    print(summary_table(result.summary), flush=True)
    print(f"{PROGRAM}: {total} simulations in {result.seconds:.1f} s; outputs in {run_dir}", flush=True)
    return {k: str(v) for k, v in paths.items()}


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    with report_errors(PROGRAM):
        run(cfg, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    run_app(main, PROGRAM)

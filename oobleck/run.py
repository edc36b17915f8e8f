"""``python -m oobleck.run``: real training on a local (or Slurm) cluster, with failures injected.

With no arguments: a local 4-node cluster, gpt3_tiny, ``job.steps`` steps, one node SIGKILLed
mid-run (``failures=explicit``) and recovered in place; the run dir (Hydra's) gets plan.json,
metrics.csv, events.csv, summary.json and an offline wandb run; a summary table is printed.
Errors (bad config, CUDA missing, busy port, a worker's exception, too many failures) print one
message (with the worker's traceback when there is one) and exit with status 2.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

import oobleck.config  # noqa: F401  (registers the structured schema)
from oobleck.errors import report_errors, run_app


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from oobleck.elastic.job import launch

    with report_errors("oobleck.run"):
        launch(cfg, HydraConfig.get().runtime.output_dir, handle_signals=True)


if __name__ == "__main__":
    run_app(main, "oobleck.run")

"""``python -m oobleck.run``: real training on a local (or Slurm) cluster, with failures injected.

With no arguments: a local 4-node cluster, gpt3_tiny, ``job.steps`` steps, one node SIGKILLed
mid-run (``failures=explicit``) and recovered in place; the run dir (Hydra's) gets plan.json,
metrics.csv, events.csv, summary.json and an offline wandb run; a summary table is printed.
Errors (bad config, CUDA missing, busy port, a worker's exception, too many failures) print one
message (with the worker's traceback when there is one) and exit with status 2. What was printed
is also in ``<run dir>/run.log``. Installed, the command is ``oobleck-run``.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from oobleck.cli import entry
from oobleck.config import CONF_DIR, register_configs
from oobleck.errors import run_app

PROGRAM = "oobleck.run"


register_configs()  # before @hydra.main composes: conf/config.yaml starts from the schema


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from oobleck.elastic.job import launch

    with entry(PROGRAM) as run_dir:
        launch(cfg, run_dir, handle_signals=True)


def cli() -> None:
    """The ``oobleck-run`` command."""
    run_app(main, PROGRAM)


if __name__ == "__main__":
    cli()

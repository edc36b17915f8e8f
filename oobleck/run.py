"""``python -m oobleck.run``: real training on a local (or Slurm) cluster, with failures injected.

With no arguments: a local 4-node cluster, gpt3_tiny, ``job.steps`` steps, one node SIGKILLed
mid-run (``failures=explicit``) and recovered in place; the run dir (Hydra's) gets plan.json,
metrics.csv, events.csv, summary.json and an offline wandb run; a summary table is printed.
Errors (bad config, CUDA missing, busy port, a worker's exception, too many failures) print one
message (with the worker's traceback when there is one) and exit with status 2. What was printed
is also in ``<run dir>/run.log``. Installed, the command is ``oobleck-run``.
"""

from __future__ import annotations

import contextlib

import hydra
from omegaconf import DictConfig

from oobleck.cli import entry, run_app
from oobleck.config import CONF_DIR, register_configs, validate
from oobleck.elastic.forkserver import fork_server_for
from oobleck.elastic.protocol import new_run_id

PROGRAM = "oobleck.run"


register_configs()  # before @hydra.main composes: conf/config.yaml starts from the schema


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with entry(PROGRAM) as run_dir:
        validate(cfg)
        # The fork server (cluster.fork_workers) imports torch while this process does the same
        # and plans: started before anything here imports torch.
        run_id = new_run_id()
        with fork_server_for(cfg, run_id) or contextlib.nullcontext() as fork_server:
            from oobleck.elastic.job import launch

            launch(cfg, run_dir, handle_signals=True, run_id=run_id, fork_server=fork_server)


def cli() -> None:
    """The ``oobleck-run`` command."""
    run_app(main, PROGRAM)


if __name__ == "__main__":
    cli()

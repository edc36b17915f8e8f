"""``python -m oobleck.run``: real training on a local (or Slurm) cluster, with failures injected.

With no arguments: a local 4-node cluster, gpt3_tiny, ``job.steps`` steps, no failure; the README's
main job (``failures=demo``) SIGKILLs one node at step 10, recovered in place. The run dir (Hydra's) gets plan.json,
metrics.csv, events.csv, summary.json and an offline wandb run; a summary table is printed.
Errors (bad config, CUDA missing, busy port, a worker's exception, too many failures) print one
message (with the worker's traceback when there is one) and exit with status 2. What was printed
is also in ``<run dir>/run.log``. Installed, the command is ``oobleck-run``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from oobleck.cli import entry, hydra_error_message, run_app
from oobleck.config import CONF_DIR, compose_config, register_configs, validate
from oobleck.elastic.forkserver import fork_server_for
from oobleck.elastic.protocol import new_run_id
from oobleck.errors import EXIT_USER_ERROR, ConfigError, OobleckError, exit_with

PROGRAM = "oobleck.run"


register_configs()  # before @hydra.main composes: conf/config.yaml starts from the schema


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with entry(PROGRAM) as run_dir:
        validate(cfg)
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode == RunMode.MULTIRUN and int(hydra_cfg.job.num) == 0:
            check_sweep(sys.argv[1:])
        # The fork server (cluster.fork_workers) forked from this process once it has imported
        # torch, before the controller starts a thread: it then imports only what workers add.
        run_id = new_run_id()
        with fork_server_for(cfg, run_id, from_this_process=True) or contextlib.nullcontext() as fork_server:
            from oobleck.elastic.job import launch

            launch(cfg, run_dir, handle_signals=True, run_id=run_id, fork_server=fork_server)


def sweep_points(arguments: Sequence[str]) -> list[list[str]]:
    """The override lists of every job of a ``-m`` sweep given by ``arguments`` (Hydra's basic
    sweeper's cartesian product, ``hydra.*`` overrides left out)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = [a for a in arguments if not a.startswith("-") and not a.lstrip("+~").startswith(("hydra.", "hydra/"))]
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [list(point) for point in BasicSweeper.split_arguments(parsed, max_batch_size=None)[0]]


def check_sweep(arguments: Sequence[str]) -> None:
    """Before a sweep's first job runs, every point of it is checked as its own job would check it
    before starting anything: the config (``validate``), where its nodes start
    (``Launcher.check_environment``) and its failure schedule. A bad point is refused with its
    overrides named (``ConfigError``), so no job of a sweep that cannot finish runs."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from oobleck.faults.schedule import build_schedule
    from oobleck.launcher import launcher_class

    for point in sweep_points(arguments):
        try:
            cfg = compose_config(*point)
            validate(cfg)
            launcher_class(cfg.cluster).check_environment(cfg.cluster)
            build_schedule(cfg.failures, nodes=int(cfg.cluster.nodes), steps=int(cfg.job.steps))
        except (OobleckError, HydraException, OmegaConfBaseException) as error:
            reason = str(error) if isinstance(error, OobleckError) else hydra_error_message(error, PROGRAM)
            raise ConfigError(f"the sweep's job {' '.join(point)} cannot run, so none runs: {reason}") from None


def check_where_nodes_start(arguments: Sequence[str]) -> None:
    """Before Hydra makes the run dir (and a wandb run is started there): can this run start its
    nodes from here (``Launcher.check_environment``, e.g. ``cluster=slurm`` inside an allocation)?
    Refuses with one line and exit status 2. Anything else about the arguments (a Hydra flag, an
    override Hydra refuses) is left to Hydra and to the checks in ``main``."""
    from oobleck.launcher import launcher_class

    if any(a.startswith("-") for a in arguments):
        return  # --help, --cfg, -m (a sweep checks every point in its first job), shell completion
    overrides = [a for a in arguments if not a.lstrip("+~").startswith(("hydra.", "hydra/"))]
    if not any(_may_change_launcher(a) for a in overrides):
        return  # the default cluster (local) starts nodes anywhere: no composing on every run's start
    try:
        cfg = compose_config(*overrides)
    except Exception:  # Hydra says what is wrong with the overrides when it composes them itself
        return
    try:
        launcher_class(cfg.cluster).check_environment(cfg.cluster)
    except OobleckError as error:
        exit_with(f"{PROGRAM}: error: {error}", EXIT_USER_ERROR)


# The keys that can change which launcher a run gets (``launcher_class``: ``cluster._target_``,
# else ``cluster.kind``): the cluster group, those two keys, and an experiment (which may choose a
# cluster). Other cluster keys (``cluster.nodes``...) leave the launcher and where it may start.
LAUNCHER_KEYS = ("cluster", "cluster.kind", "cluster._target_")


def _may_change_launcher(override: str) -> bool:
    key = override.lstrip("+~").split("=", 1)[0]
    return key in LAUNCHER_KEYS or key == "experiment" or key.startswith("experiment/")


def cli() -> None:
    """The ``oobleck-run`` command."""
    check_where_nodes_start(sys.argv[1:])
    run_app(main, PROGRAM)


if __name__ == "__main__":
    cli()

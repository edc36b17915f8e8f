"""Configuration: ``validate(cfg)`` checks a composed config before any process starts, and the
schema's names are re-exported from ``oobleck.schema`` (where the dataclasses, the config tree and
the group loaders live) for the entry points, tools and tests that import them from here.

``validate`` checks that every key is one the schema knows (Hydra's ``+`` adds any key;
``check_known_keys`` names the closest known one), then each section with the checks that live
beside its component, raising ``ConfigError`` with one message that names the key, the value and
the fix: ``model`` (its family, ``oobleck.models.registry``), ``cluster`` (``oobleck.launcher``),
``cluster.gpu`` and ``profile`` (``oobleck.profiling.settings``), ``job`` and ``runtime``
(``oobleck.runtime.settings``), ``planner`` (``oobleck.planning.settings``), ``failures``
(``oobleck.faults.schedule``), ``strategy`` (its class, ``oobleck.strategy``), ``sim``
(``oobleck.sim.settings``; its uncertain constants: ``oobleck.uncertainty``), ``logger``
(``oobleck.metrics.wandb_run``) and ``checkpoint`` (``oobleck.checkpoint.settings``). What needs the
model profile (n0, memory) is checked by the planner, which raises ``PlanningError`` alike.

Sections mirror the config groups: ``paths``, ``model/`` (typed by its family: ``oobleck.models``),
``cluster/`` (``gpu/`` fills ``cluster.gpu``), ``profile``, ``job``, ``planner``, ``failures/``,
``strategy/``, ``checkpoint/``, ``sim`` (filled by ``experiment/``) and ``logger/``.
"""

from __future__ import annotations

from omegaconf import MISSING, DictConfig, OmegaConf

from oobleck.checkpoint.settings import check_checkpoint
from oobleck.errors import ConfigError, unknown_key_message
from oobleck.launcher import check_cluster
from oobleck.metrics.wandb_run import check_logger
from oobleck.plain import resolved_dict
from oobleck.planning.inputs import ClusterSpec
from oobleck.planning.settings import check_planner
from oobleck.profiling.settings import check_gpu, check_profile
from oobleck.runtime.settings import check_job, check_runtime
from oobleck.schema import (
    CONF_DIR,
    CheckpointConfig,
    ClusterConfig,
    Config,
    FailureEventConfig,
    FailuresConfig,
    GPUConfig,
    JobConfig,
    LoggerConfig,
    PathsConfig,
    PlannerConfig,
    ProfileConfig,
    RuntimeConfig,
    SimConfig,
    WandbConfig,
    check_known_keys,
    compose_config,
    find_conf_dir,
    from_container,
    group_names,
    load_group,
    load_model_config,
    model_names,
    register_configs,
    schema_keys,
    schema_type,
    strategy_names,
    to_container,
)
from oobleck.sim.settings import check_sim

__all__ = [
    "CONF_DIR",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "FailureEventConfig",
    "FailuresConfig",
    "GPUConfig",
    "JobConfig",
    "LoggerConfig",
    "PathsConfig",
    "PlannerConfig",
    "ProfileConfig",
    "RuntimeConfig",
    "SimConfig",
    "WandbConfig",
    "check_known_keys",
    "compose_config",
    "find_conf_dir",
    "from_container",
    "group_names",
    "load_group",
    "load_model_config",
    "model_names",
    "register_configs",
    "schema_keys",
    "schema_type",
    "strategy_names",
    "to_container",
    "validate",
]


def validate(cfg: Config | DictConfig) -> None:
    """Check every section's values and cross-field constraints; raise ``ConfigError`` naming the
    first problem (the module docstring lists where each section's checks live)."""
    if isinstance(cfg, DictConfig):
        check_known_keys(cfg)
    _validate_model(cfg)
    check_cluster(cfg.cluster)
    ClusterSpec.from_config(cfg.cluster)  # the planner's limits on memory and bandwidth (NaN, 1e-300 GB/s)
    check_gpu(cfg.cluster.gpu)
    check_profile(cfg.profile)
    check_job(cfg.job)
    check_planner(cfg.planner)
    check_runtime(cfg.runtime)

    from oobleck.faults.schedule import check_failures

    # The section's own values; what depends on the run (steps, nodes, the trace file) is checked
    # when oobleck.run builds the schedule, still before any process starts.
    check_failures(cfg.failures)

    _validate_strategy(cfg)
    check_sim(cfg.sim, int(cfg.job.microbatch_size))
    from oobleck.uncertainty import declared

    declared(cfg)  # each uncertain constant: its key, range, scale and source
    check_logger(cfg.logger)
    check_checkpoint(cfg)


def _validate_model(cfg: Config | DictConfig) -> None:
    from oobleck.models.registry import model_config  # torch-free: the family's schema and checks

    if OmegaConf.is_missing(cfg, "model") if isinstance(cfg, DictConfig) else cfg.model is MISSING:
        raise ConfigError("no model is chosen; set model=<name> (conf/model/)")
    model_config(cfg.model)


def _validate_strategy(cfg: Config | DictConfig) -> None:
    from oobleck.strategy import checkpoint_every_steps, strategy_class, strategy_config

    if OmegaConf.is_missing(cfg, "strategy") if isinstance(cfg, DictConfig) else cfg.strategy is MISSING:
        raise ConfigError(f"no strategy is chosen; set strategy=<one of {', '.join(strategy_names())}>")
    config = strategy_config(cfg.strategy)
    if config.checkpoint_every_steps < 0:
        raise ConfigError(f"strategy.checkpoint_every_steps={config.checkpoint_every_steps} must be >= 0")
    for name, overrides in (cfg.sim.params or {}).items() if getattr(cfg, "sim", None) is not None else ():
        key = f"sim.params.{name}"
        if name not in strategy_names():
            raise ConfigError(
                unknown_key_message(key, strategy_names(), "(sim.params.<strategy>: one of conf/strategy/)")
            )
        if not isinstance(overrides, DictConfig):
            raise ConfigError(
                f"{key}={overrides!r} must be a mapping of that strategy's settings, e.g. {key}.checkpoint_every_steps=100"
            )
        section = (
            cfg.strategy if cfg.strategy.get("name") == name else OmegaConf.load(CONF_DIR / "strategy" / f"{name}.yaml")
        )
        assert isinstance(section, DictConfig)  # conf/strategy/*.yaml are mappings
        strategy_config(section, resolved_dict(overrides), where=key)
    if strategy_class(cfg.strategy).requires_checkpoints and checkpoint_every_steps(cfg, config) <= 0:
        raise ConfigError(
            f"strategy={config.name} restarts from checkpoints, but checkpoints are disabled "
            f"(checkpoint.every_steps={getattr(getattr(cfg, 'checkpoint', None), 'every_steps', None)}); "
            "set checkpoint.every_steps=<k> > 0"
        )

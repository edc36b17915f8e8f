"""The configuration's schema and where it lives: the typed dataclass of every Hydra config
section, the config tree (``CONF_DIR``: installed or in the checkout), composing it
(``compose_config``, ``register_configs``), one group's section without Hydra (``load_group``),
the schema's own key checks (``check_known_keys``), and a config's plain-dict round trip
(``to_container`` / ``from_container``, e.g. into a worker process).

The dataclasses are registered in Hydra's ConfigStore as ``oobleck_schema`` by ``register_configs``;
``conf/config.yaml`` puts that schema first in its defaults list, so every key a YAML file or a
command-line override sets is type-checked. The schema holds types only (``MISSING`` everywhere):
every value lives in ``conf/``. Value checks are not here: each section's are beside its component,
and ``oobleck.config.validate`` runs them all. This module imports no other part of the package
but ``oobleck.errors``, so every component can read configs without an import cycle.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from oobleck.errors import ConfigError, unknown_key_message
from oobleck.plain import merged, resolved_dict


def find_conf_dir() -> Path:
    """The Hydra config tree: ``oobleck/conf`` in an installed wheel (setup.py ships ``conf/`` there),
    else ``conf/`` at the top of the checkout (an editable install or a plain checkout)."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise ConfigError(
        f"no config tree: neither {package / 'conf'} nor {package.parent / 'conf'} holds config.yaml; reinstall the package"
    )


# Every entry point, test and tool finds the config tree here (``@hydra.main(config_path=...)``,
# ``initialize_config_dir``, the per-group loaders of oobleck.models and oobleck.profiling).
CONF_DIR = find_conf_dir()


# The schema holds types only: every value lives in conf/ (config.yaml gives what every choice
# starts from, the group files what their choice changes). A field is MISSING here so that the
# YAML must say; nested sections are typed nodes (``default_factory``), never values. The one
# exception is ``FailureEventConfig``: the type of a list element a user writes, whose defaults
# say "not given".


@dataclass
class PathsConfig:
    """Where runs write: shared caches and the run dirs (``paths:`` in config.yaml)."""

    cache_dir: str = MISSING  # measured profiles and other caches shared by runs (~ is expanded)
    output_dir: str = MISSING  # run dirs: <output_dir>/<program>/<date_time>
    multirun_dir: str = MISSING  # sweeps: <multirun_dir>/<date_time>/<job number>


@dataclass
class GPUConfig:
    """A named accelerator (``gpu=<name>``, ``conf/gpu/``): analytic profiles, simulation, and the
    device memory the planner uses (``cluster.device_memory_gb`` follows ``memory_gb``)."""

    name: str = MISSING
    peak_tflops: float = MISSING  # dense fp16/bf16 tensor-core peak
    memory_gb: float = MISSING
    memory_bandwidth_gbps: float = MISSING  # HBM bytes/s in GB/s
    achieved_flop_fraction: float = MISSING  # fraction of peak FLOP/s a transformer layer achieves
    achieved_bandwidth_fraction: float = MISSING  # fraction of peak bandwidth memory-bound work achieves
    activation_bytes_per_value: int = MISSING  # bytes per activation value (bf16/fp16: 2)


@dataclass
class ClusterConfig:
    """Where workers run: ``local`` (processes on this machine) or ``slurm`` (one agent per node)."""

    _target_: str = MISSING  # the launcher class (oobleck.launcher.Launcher), e.g. oobleck.elastic.local.LocalLauncher
    kind: str = MISSING  # local | slurm: the cluster's name, the one its launcher launches
    nodes: int = MISSING
    gpus_per_node: int = MISSING
    device: str = MISSING  # cpu (gloo) | cuda (nccl)
    backend: str = MISSING  # auto (gloo on cpu, nccl on cuda) | nccl | gloo (also on cuda tensors)
    gpu: GPUConfig = field(default_factory=GPUConfig)
    device_memory_gb: float = MISSING  # memory the planner may use on one device
    intra_node_bandwidth_gbps: float = MISSING  # GB/s between devices of one node
    inter_node_bandwidth_gbps: float = MISSING  # GB/s between nodes
    master_addr: str = MISSING
    master_port: int = MISSING  # 0: pick a free port
    heartbeat_interval_s: float = MISSING
    heartbeat_timeout_s: float = MISSING
    failure_settle_s: float = MISSING  # failures detected this soon after the first are decided on together
    collective_timeout_s: float = MISSING
    data_plane_probe_timeout_s: float = MISSING  # a node whose data-plane address does not answer is cut off
    startup_timeout_s: float = MISSING
    torch_threads: int = MISSING  # torch threads per worker; 0 lets torch choose
    fork_workers: bool = MISSING  # local only: fork workers from a process that imported torch once
    node_address_base: str | None = MISSING  # local only: node n's workers bind gloo to this address + n


@dataclass
class ProfileConfig:
    """Where the planner's per-layer profile comes from."""

    source: str = MISSING  # auto | measured | analytic | file
    path: str | None = MISSING  # profile JSON for source=file
    cache_dir: str = MISSING
    warmup: int = MISSING
    repeats: int = MISSING
    max_measure_s: float = MISSING  # refuse a measurement estimated to take longer
    # Bound on the split backward's passes, a multiple of the fused backward (null: no bound).
    split_backward_max_ratio: float | None = MISSING
    allreduce_group_sizes: list[int] = MISSING
    allreduce_bytes: list[int] = MISSING
    allreduce_timeout_s: float = MISSING


@dataclass
class JobConfig:
    """The training job: fault tolerance, batch sizes, steps and optimiser."""

    fault_tolerance: int = MISSING  # f: simultaneous node failures to survive without restart
    global_batch_size: int = MISSING
    microbatch_size: int = MISSING
    steps: int = MISSING
    seed: int = MISSING
    dataset: str = MISSING  # corpus | synthetic
    synthetic_samples: int = MISSING
    lr: float = MISSING
    min_lr: float = MISSING
    warmup_steps: int = MISSING
    weight_decay: float = MISSING
    beta1: float = MISSING
    beta2: float = MISSING
    grad_clip: float = MISSING  # 0 disables
    resume: str | None = MISSING  # null | auto | <checkpoint path>


@dataclass
class PlannerConfig:
    """Template generation and instantiation settings."""

    reference_microbatches_per_stage: int = MISSING
    max_gpus_per_stage: int | None = MISSING
    transfer_sources: int = MISSING
    copy_piece_mb: float = MISSING
    replan_horizon: str = MISSING  # schedule | fixed
    replan_horizon_steps: int = MISSING
    progress_every_s: float = MISSING


@dataclass
class FailureEventConfig:
    """One scheduled event (an element of ``failures.events``): at a step or after a time, an action
    on nodes. Its defaults mean "not given"; ``action`` must be given."""

    action: str = MISSING  # remove | freeze | raise | join (oobleck.faults.kinds.FaultKind)
    step: int | None = None
    time_s: float | None = None
    nodes: list[int] | None = None  # explicit node ids
    count: int | None = None  # or how many (chosen deterministically from the seed)
    phase: str = "any"  # any | forward | backward | allreduce | optimizer | reconfigure (Phase)
    # remove only: seconds of warning before the kill, as spot providers give (0: a crash);
    # null: failures.notice_s.
    notice_s: float | None = None
    freeze: bool = False  # deprecated: action=freeze says it


@dataclass
class FailuresConfig:
    """The failure schedule: none | explicit | poisson | trace."""

    kind: str = MISSING
    events: list[FailureEventConfig] = MISSING
    mtbf_s: float = MISSING
    max_events: int | None = MISSING
    seed: int = MISSING
    trace: str | None = MISSING
    seconds_per_trace_hour: float = MISSING
    notice_s: float = MISSING  # seconds of warning before every removal (0: crashes)


@dataclass
class RuntimeConfig:
    """Worker runtime knobs (oobleck/runtime)."""

    bucket_mb: float = MISSING  # gradient all-reduce bucket size (MiB)
    overlap_grad_reduce: bool = MISSING
    link_probe_mb: float = MISSING
    prefault_copies: bool = MISSING
    reap_margin_s: float = MISSING
    save_final_params: bool = MISSING
    record_work: bool = MISSING


@dataclass
class CheckpointConfig:
    """Periodic by-layer checkpoints (``oobleck/checkpoint``); ``conf/checkpoint/<name>.yaml``."""

    # null: the strategy's own default (checkpoint_every_steps in conf/strategy/<name>.yaml).
    every_steps: int | None = MISSING
    every_s: float | None = MISSING
    dir: str | None = MISSING  # null: <run dir>/checkpoints; on Slurm a path every node shares
    keep: int = MISSING
    async_write: bool = MISSING
    io_threads: int = MISSING
    max_pending: int = MISSING
    write_timeout_s: float = MISSING


@dataclass
class SimConfig:
    """Simulator experiments (set by ``experiment/``)."""

    models: list[str] = MISSING
    traces: list[str] = MISSING
    strategies: list[str] = MISSING
    duration_h: float | None = MISSING
    figures: bool = MISSING
    # sim.params.<strategy>.<key>: typed by that strategy's config (oobleck.strategy).
    params: dict[str, Any] = MISSING
    profile_source: str = MISSING  # analytic | auto | measured | file
    nodes: int | None = MISSING
    timeline_bin_s: float = MISSING
    costs: dict[str, Any] = MISSING
    node_creation_s: float = MISSING
    trace_starts: int = MISSING
    trace_start_spacing_s: float | None = MISSING
    global_batch_size_by_model: dict[str, int] = MISSING
    testbed: str = MISSING  # the cluster preset (conf/testbed/) an experiment runs on
    # sim.uncertain.<name>: {key, low, high, scale, source} (oobleck.uncertainty).
    uncertain: dict[str, Any] = MISSING
    band_samples: int = MISSING  # cost samples per grid point of the bands (0: nominal only)
    band_seed: int = MISSING
    processes: int = MISSING  # simulation processes (0: one per core of this machine)


@dataclass
class WandbConfig:
    mode: str = MISSING  # offline | online | disabled
    project: str = MISSING
    entity: str | None = MISSING
    group: str | None = MISSING
    tags: list[str] = MISSING


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress_bar: bool = MISSING


@dataclass
class Config:
    paths: PathsConfig = field(default_factory=PathsConfig)
    # conf/model/<name>.yaml: ``family`` names the model family, whose config dataclass types the
    # rest (checked by ``validate`` through ``oobleck.models.registry.model_config``).
    model: Any = MISSING
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    job: JobConfig = field(default_factory=JobConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    failures: FailuresConfig = field(default_factory=FailuresConfig)
    # conf/strategy/<name>.yaml: ``_target_`` names the strategy class, whose ``Config`` dataclass
    # types the rest (checked by ``validate`` through ``oobleck.strategy.strategy_config``).
    strategy: Any = MISSING
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    experiment: str = MISSING


def register_configs() -> None:
    """Register the schema with Hydra; ``conf/config.yaml`` lists ``oobleck_schema`` first.

    Every place that composes through Hydra calls this first: the entry points at import (before
    ``@hydra.main`` composes) and ``compose_config``. It is not done at import of this module, so
    that a process that only reads a config (a worker: ``from_container``) never imports Hydra,
    about 0.2 s of every worker's start. Registering again replaces the entry with the same one.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="oobleck_schema", node=Config)


def compose_config(*overrides: str, return_hydra_config: bool = False) -> DictConfig:
    """The config ``python -m oobleck.run <overrides>`` would run with, composed by Hydra's compose
    API from ``CONF_DIR`` (inside a Hydra app already running, with that app's search path)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    if GlobalHydra.instance().is_initialized():
        return compose("config", overrides=list(overrides), return_hydra_config=return_hydra_config)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=return_hydra_config)


# Config groups whose files fill one section outside Hydra too (tools, tests, the simulator). The
# model section is typed by its family (``load_model_config`` below types it).
_GROUP_SECTIONS: dict[str, tuple[str, Any]] = {"model": ("model", None), "gpu": ("cluster.gpu", GPUConfig)}


def group_names(group: str) -> list[str]:
    """The options of a config group (``conf/<group>/*.yaml``), e.g. the ``model=`` names."""
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def load_group(group: str, name: str, **overrides: Any) -> DictConfig:
    """``<group>=<name>`` as Hydra composes that section (``model`` or ``gpu``), without Hydra:
    the section's base values in config.yaml, then ``conf/<group>/<name>.yaml``, then ``overrides``,
    typed by the schema (the model section: untyped here)."""
    section, schema = _GROUP_SECTIONS[group]
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"{group}={name!r} has no {path}; choose one of {', '.join(group_names(group))}")
    base = OmegaConf.select(OmegaConf.load(CONF_DIR / "config.yaml"), section, default=None) or {}
    typed = [OmegaConf.structured(schema)] if schema is not None else []
    return merged(*typed, base, OmegaConf.load(path), overrides)


def model_names() -> list[str]:
    """The ``model=`` names (``conf/model/*.yaml``)."""
    return group_names("model")


def load_model_config(name: str, **overrides: Any) -> DictConfig:
    """The config of model ``name`` outside Hydra (tests, benchmarks, notebooks), with ``overrides``
    (e.g. ``n_layer=2``) applied: exactly what ``model=<name>`` composes in a Hydra app, typed and
    checked by its family (a ``DictConfig`` that can still be changed, like Hydra's)."""
    from oobleck.models.registry import model_config  # torch-free: the family's schema and checks

    typed = OmegaConf.structured(model_config(load_group("model", name, **overrides)))
    OmegaConf.set_readonly(typed, False)
    return typed


def _section_schema(section: str) -> Any:
    """The schema dataclass of a dotted section ("" for the top level; list indices allowed), or
    None when the schema has no such section."""
    node: Any = Config
    for part in filter(None, section.split(".")):
        node = _element_type(_field_types(node).get(part.split("[")[0]))
    return node if dataclasses.is_dataclass(node) else None


def schema_keys(section: str) -> list[str]:
    """The field names the schema declares for a dotted section ("" for the top level). The model
    section is typed by its family: the keys of every family."""
    if section == "model":
        from oobleck.models.registry import FAMILIES  # torch-free

        return sorted({f.name for family in FAMILIES.values() for f in dataclasses.fields(family.config)})
    return list(_field_types(_section_schema(section)))


def _field_types(schema: Any) -> dict[str, Any]:
    return typing.get_type_hints(schema) if dataclasses.is_dataclass(schema) else {}


def _element_type(hint: Any) -> Any:
    """The dataclass a field holds, directly, as Optional[...] or as the elements of a list."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, list) and len(args) == 1:
        return _element_type(args[0])
    return hint


def schema_type(key: str) -> str | None:
    """The type the schema declares for a dotted key, e.g. ``int`` or ``str or null`` (None when
    the key is unknown or not a scalar)."""
    parent, _, leaf = key.rpartition(".")
    hint = _field_types(_section_schema(parent)).get(leaf.split("[")[0])
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = typing.get_origin(hint) is typing.Union and len(args) == 1
    scalar = args[0] if optional else hint
    if scalar in (int, float, str, bool):
        return scalar.__name__ + (" or null" if optional else "")
    return None


def check_known_keys(cfg: DictConfig) -> None:
    """Every key of ``cfg`` is one the schema declares: ``+job.stpes=3`` (Hydra's ``+`` adds any
    key) is refused before anything starts. The strategy section is typed by its own class and
    checked there (``oobleck.strategy.strategy_config``)."""

    def walk(node: Any, schema: Any, prefix: str) -> None:
        fields = _field_types(schema)
        for key in map(str, node.keys()) if isinstance(node, DictConfig) else ():
            dotted = f"{prefix}{key}"
            if key not in fields:
                raise ConfigError(unknown_key_message(dotted, fields))
            inner = _element_type(fields[key])
            if not dataclasses.is_dataclass(inner):
                continue
            value = node._get_node(key)
            if isinstance(value, ListConfig):
                for index, item in enumerate(value):
                    walk(item, inner, f"{dotted}[{index}].")
            else:
                walk(value, inner, f"{dotted}.")

    walk(cfg, Config, "")


def strategy_names() -> tuple[str, ...]:
    """The strategies of ``conf/strategy/`` (``strategy=<name>``)."""
    return tuple(sorted(path.stem for path in (CONF_DIR / "strategy").glob("*.yaml")))


def to_container(cfg: Config | DictConfig) -> dict[str, Any]:
    """A plain, resolved dict of the config (for plan.json, wandb and worker processes)."""
    return resolved_dict(cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg))


def from_container(data: dict[str, Any]) -> DictConfig:
    """Rebuild a typed config from ``to_container``'s output (e.g. in a worker process)."""
    return merged(OmegaConf.structured(Config), data)

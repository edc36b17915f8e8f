"""Structured configuration: the schema of every Hydra config group, and its validation.

The dataclasses here are registered in Hydra's ConfigStore as ``oobleck_schema``; ``conf/config.yaml``
puts that schema first in its defaults list, so every key a YAML file or a command-line override
sets is type-checked and an unknown key is an error. ``validate(cfg)`` then checks values and
cross-field constraints before any process starts, raising ``ConfigError`` with one message that
names the key, the value and the fix.

Sections mirror the config groups: ``model/``, ``cluster/``, ``profile``, ``job``, ``planner``,
``failures/``, ``strategy/``, ``checkpoint/``, ``sim`` (filled by ``experiment/``) and ``logger/``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from oobleck.errors import ConfigError
from oobleck.planning.instantiate import MAX_MICROBATCHES, microbatch_limit_message
from oobleck.planning.profile import ClusterSpec

# The Hydra config tree (conf/ at the top of the repository).
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


@dataclass
class ModelConfig:
    """A GPT-family model; ``conf/model/<name>.yaml`` holds the published sizes."""

    name: str = MISSING
    n_layer: int = MISSING  # transformer blocks (the layered model adds embedding, final norm, head)
    n_embd: int = MISSING
    n_head: int = MISSING
    vocab_size: int = 50257
    seq_len: int = 1024
    ffn_mult: int = 4
    dropout: float = 0.0
    init_std: float = 0.02
    # Tied input embedding and LM head. When true the runtime all-reduces the tied weight's
    # gradient between the stages holding the two ends, so training stays exact.
    tie_embeddings: bool = True


@dataclass
class GPUConfig:
    """A named accelerator for analytic profiles and simulation (``cluster.gpu``)."""

    name: str = "A100-40GB"
    peak_tflops: float = 312.0  # dense fp16/bf16 tensor-core peak (NVIDIA A100 datasheet)
    memory_gb: float = 40.0
    memory_bandwidth_gbps: float = 1555.0  # HBM bytes/s in GB/s (A100 40GB datasheet)
    # Fraction of peak FLOP/s a transformer layer achieves; an assumption, see conf/gpu/.
    achieved_flop_fraction: float = 0.45
    # Fraction of peak memory bandwidth memory-bound work achieves (an assumption, see conf/gpu/).
    achieved_bandwidth_fraction: float = 0.7
    # Bytes per activation / boundary value in mixed-precision training (bf16/fp16).
    activation_bytes_per_value: int = 2


@dataclass
class ClusterConfig:
    """Where workers run: ``local`` (processes on this machine) or ``slurm`` (one agent per node)."""

    kind: str = "local"
    nodes: int = 4
    gpus_per_node: int = 1
    device: str = "cpu"  # cpu (gloo) | cuda (nccl)
    gpu: GPUConfig = field(default_factory=GPUConfig)
    # Memory the planner may use on one device. For cpu "devices" this is a per-worker budget.
    device_memory_gb: float = 4.0
    intra_node_bandwidth_gbps: float = 10.0  # GB/s between devices of one node
    inter_node_bandwidth_gbps: float = 1.0  # GB/s between nodes
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: pick a free port
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 10.0
    collective_timeout_s: float = 60.0
    startup_timeout_s: float = 180.0
    # Torch threads per worker; 0 lets torch choose. Keep 1 on small CPU machines.
    torch_threads: int = 1


@dataclass
class ProfileConfig:
    """Where the planner's per-layer profile comes from."""

    source: str = "auto"  # auto | measured | analytic | file
    path: Optional[str] = None  # profile JSON for source=file
    cache_dir: str = ".oobleck_cache/profiles"
    warmup: int = 2
    repeats: int = 5
    # Measured profiles also time all-reduce for these group sizes and message sizes (bytes) on the
    # current backend; an empty list skips it (group sizes above the local device count are skipped).
    allreduce_group_sizes: list[int] = field(default_factory=lambda: [2])
    allreduce_bytes: list[int] = field(default_factory=lambda: [1 << 20, 16 << 20])
    allreduce_timeout_s: float = 120.0


@dataclass
class JobConfig:
    """The training job: fault tolerance, batch sizes, steps and optimiser."""

    fault_tolerance: int = 1  # f: simultaneous node failures to survive without restart
    global_batch_size: int = 32
    microbatch_size: int = 2
    steps: int = 30
    seed: int = 0
    dataset: str = "corpus"  # corpus (shipped text, byte-level) | synthetic (seeded tokens)
    synthetic_samples: int = 4096  # samples in the synthetic dataset (job.dataset=synthetic)
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    # Resume from a checkpoint: null (start fresh), auto (the newest valid one under checkpoint.dir,
    # fresh if none), or a path (a step-NNNNNNNN dir, or a checkpoint dir for its newest valid one).
    resume: Optional[str] = None


@dataclass
class PlannerConfig:
    """Template generation and instantiation settings."""

    # Templates are ranked at m = reference_microbatches_per_stage * S microbatches (paper: 4 * S).
    reference_microbatches_per_stage: int = 4
    # Only plan stage widths the runtime can execute (a stage on g GPUs of one node).
    max_gpus_per_stage: Optional[int] = None
    # Reconfiguration splits each layer copy across up to this many surviving holders.
    transfer_sources: int = 4
    # Steps over which a fresh plan's faster iterations must repay its extra layer copying for
    # reconfiguration to re-plan instead of regrouping in place (conf/config.yaml sets it).
    replan_horizon_steps: int = 100


@dataclass
class FailureEventConfig:
    """One scheduled membership change: at a step or after a time, remove or join nodes."""

    action: str = "remove"  # remove | join | raise (a worker raises: tests the error path)
    step: Optional[int] = None
    time_s: Optional[float] = None
    nodes: Optional[list[int]] = None  # explicit node ids
    count: Optional[int] = None  # or how many (chosen deterministically from the seed)
    # Where in the step to strike for removals at a step: any | forward | backward | allreduce |
    # optimizer | reconfigure (during the next reconfiguration after that step)
    phase: str = "any"
    freeze: bool = False  # SIGSTOP instead of SIGKILL: caught by the heartbeat timeout


@dataclass
class FailuresConfig:
    """The failure schedule: none | explicit | poisson | trace."""

    kind: str = "none"
    events: list[FailureEventConfig] = field(default_factory=list)
    mtbf_s: float = 60.0  # poisson: mean time between node failures
    max_events: Optional[int] = None
    seed: int = 0
    trace: Optional[str] = None  # trace file, or a shipped name such as synthetic/10m
    # Real runs replay a trace faster: seconds of run time per hour of trace time.
    seconds_per_trace_hour: float = 10.0


@dataclass
class RuntimeConfig:
    """Worker runtime knobs (oobleck/runtime)."""

    bucket_mb: float = 4.0  # gradient all-reduce bucket size (MiB)
    # An abandoned process group (aborted generation) is released once none of its operations
    # is pending, and at the latest cluster.collective_timeout_s + reap_margin_s after it was
    # abandoned (gloo has failed its pending operations by then).
    reap_margin_s: float = 5.0
    # Collect every layer's final parameters into final_params.pt in the run dir (exactness checks).
    save_final_params: bool = False


@dataclass
class CheckpointConfig:
    """Periodic by-layer checkpoints (``oobleck/checkpoint``); ``conf/checkpoint/<name>.yaml``."""

    # Checkpoint after every this many committed steps (0: not by steps); null: the strategy's own
    # default (``checkpoint_every_steps`` in conf/strategy/<name>.yaml; oobleck.strategy.checkpoint_every_steps).
    every_steps: Optional[int] = None
    every_s: Optional[float] = None  # and/or once this many seconds passed since the last; None = not by time
    dir: Optional[str] = None  # None: <run dir>/checkpoints; on Slurm a path every node shares
    keep: int = 2  # retention: the newest this many complete checkpoints (>= 1)
    async_write: bool = True  # write in the background (only the host snapshot is on the training path)
    io_threads: int = 2  # threads per process writing shards, and checking checksums on resume
    max_pending: int = 1  # checkpoints in flight per worker before the next one waits for one to finish
    write_timeout_s: float = 600.0  # bound on every wait for a checkpoint write


@dataclass
class SimConfig:
    """Simulator experiments (set by ``experiment/``)."""

    models: list[str] = field(default_factory=lambda: ["gpt3_medium"])
    traces: list[str] = field(default_factory=lambda: ["synthetic/1h"])
    strategies: list[str] = field(default_factory=lambda: ["oobleck", "varuna", "bamboo"])
    duration_h: Optional[float] = None  # None: the whole trace
    figures: bool = True
    # Per-strategy overrides of a strategy's config in a simulation: sim.params.<strategy>.<key>
    # (e.g. sim.params.oobleck.checkpoint_every_steps=100, sim.params.varuna.costs.restart_fixed_s=60);
    # the strategy's typed config (conf/strategy/<name>.yaml, oobleck.strategy) checks them.
    params: dict[str, Any] = field(default_factory=dict)
    # Where each simulated model's profile comes from: analytic (cluster.gpu's FLOP/byte model, and
    # cluster.gpu.memory_gb per device) or auto | measured | file as in profile.source (real runs).
    profile_source: str = "analytic"
    # Nodes the templates are generated for; None: the most nodes alive at once in any trace.
    nodes: Optional[int] = None
    # Time bins (seconds) of the throughput-over-time tables and figures.
    timeline_bin_s: float = 300.0
    # Cost constants of the simulated cluster, applied to every strategy (oobleck.sim.costs,
    # CostConstants: host_copy_gbps, storage_write_gbps, restart_fixed_s, ...); a strategy's own
    # sim.params.<name>.costs.<key> wins over them.
    costs: dict[str, Any] = field(default_factory=dict)
    # Seconds from a trace adding a node to the node being usable (instance creation); the
    # cluster a trace starts with waits for it too.
    node_creation_s: float = 0.0
    # Replays of every trace from shifted starts: start k begins k * trace_start_spacing_s into
    # the trace (None: the trace's median time between membership changes / trace_starts), with
    # the nodes alive there, for the same duration (duration_h, or the trace's span less the
    # last start's offset); ratios are reported as median and range.
    trace_starts: int = 1
    trace_start_spacing_s: Optional[float] = None
    # Global batch per simulated model (job.global_batch_size for the others).
    global_batch_size_by_model: dict[str, int] = field(default_factory=dict)


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "oobleck"
    entity: Optional[str] = None
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress_bar: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
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
    experiment: str = "default"


def register_configs() -> None:
    """Register the schema with Hydra; ``conf/config.yaml`` lists ``oobleck_schema`` first."""
    ConfigStore.instance().store(name="oobleck_schema", node=Config)


register_configs()


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}; set {key}=<one of them>")


def _positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    bound = ">= 0" if allow_zero else "> 0"
    if value is None or (isinstance(value, float) and not math.isfinite(value)):  # NaN passes every comparison below
        raise ConfigError(f"{key}={value} must be a finite number {bound}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {bound}")


def validate(cfg: Config | DictConfig) -> None:
    """Check values and cross-field constraints; raise ``ConfigError`` naming the first problem.

    Constraints that need the model profile (n0, memory) are checked by the planner, which
    raises ``PlanningError`` with the same kind of message.
    """
    model, cluster, job = cfg.model, cfg.cluster, cfg.job
    for key in ("n_layer", "n_embd", "n_head", "vocab_size", "seq_len"):
        _positive(f"model.{key}", getattr(model, key))
    if model.n_embd % model.n_head:
        raise ConfigError(
            f"model.n_embd={model.n_embd} is not divisible by model.n_head={model.n_head}; "
            "choose a head count that divides the width"
        )
    _choice("cluster.kind", cluster.kind, ("local", "slurm"))
    _choice("cluster.device", cluster.device, ("cpu", "cuda"))
    _positive("cluster.nodes", cluster.nodes)
    _positive("cluster.gpus_per_node", cluster.gpus_per_node)
    ClusterSpec.from_config(cluster)  # the planner's limits on memory and bandwidth (NaN, 1e-300 GB/s)
    for key in ("heartbeat_interval_s", "heartbeat_timeout_s", "collective_timeout_s", "startup_timeout_s"):
        _positive(f"cluster.{key}", getattr(cluster, key))
    if cluster.heartbeat_timeout_s <= cluster.heartbeat_interval_s:
        raise ConfigError(
            f"cluster.heartbeat_timeout_s={cluster.heartbeat_timeout_s} must exceed "
            f"cluster.heartbeat_interval_s={cluster.heartbeat_interval_s}"
        )
    if not 0 <= cluster.master_port <= 65535:
        raise ConfigError(f"cluster.master_port={cluster.master_port} must be in 0..65535 (0 picks a free port)")
    _choice("profile.source", cfg.profile.source, ("auto", "measured", "analytic", "file"))
    if cfg.profile.source == "file" and not cfg.profile.path:
        raise ConfigError("profile.source=file needs profile.path=<profile JSON written by python -m oobleck.profile>")
    _positive("profile.repeats", cfg.profile.repeats)
    _positive("profile.warmup", cfg.profile.warmup, allow_zero=True)
    _positive("profile.allreduce_timeout_s", cfg.profile.allreduce_timeout_s)
    for size in cfg.profile.allreduce_group_sizes:
        if size < 2:
            raise ConfigError(f"profile.allreduce_group_sizes contains {size}; all-reduce groups need >= 2 ranks")
    for nbytes in cfg.profile.allreduce_bytes:
        _positive("profile.allreduce_bytes[]", nbytes)
    gpu = cluster.gpu
    for key in ("peak_tflops", "memory_gb", "memory_bandwidth_gbps", "activation_bytes_per_value"):
        _positive(f"cluster.gpu.{key}", getattr(gpu, key))
    for key in ("achieved_flop_fraction", "achieved_bandwidth_fraction"):
        if not 0 < getattr(gpu, key) <= 1:
            raise ConfigError(f"cluster.gpu.{key}={getattr(gpu, key)} must be in (0, 1]")

    if job.fault_tolerance < 0:
        raise ConfigError(f"job.fault_tolerance={job.fault_tolerance} must be >= 0")
    _positive("job.microbatch_size", job.microbatch_size)
    _positive("job.global_batch_size", job.global_batch_size)
    if job.global_batch_size % job.microbatch_size:
        raise ConfigError(
            f"job.global_batch_size={job.global_batch_size} is not divisible by "
            f"job.microbatch_size={job.microbatch_size}; make the batch a multiple of the microbatch"
        )
    microbatches = job.global_batch_size // job.microbatch_size
    if microbatches > MAX_MICROBATCHES:
        raise ConfigError(microbatch_limit_message(job.global_batch_size, job.microbatch_size))
    if microbatches < job.fault_tolerance + 1:
        raise ConfigError(
            f"job.global_batch_size={job.global_batch_size} gives {microbatches} microbatches of "
            f"{job.microbatch_size}, fewer than the f+1={job.fault_tolerance + 1} pipelines "
            "job.fault_tolerance needs; raise the batch or lower the microbatch size"
        )
    _positive("job.steps", job.steps)
    _positive("job.lr", job.lr)
    _positive("job.min_lr", job.min_lr, allow_zero=True)
    _positive("job.warmup_steps", job.warmup_steps, allow_zero=True)
    _positive("job.grad_clip", job.grad_clip, allow_zero=True)
    _choice("job.dataset", job.dataset, ("corpus", "synthetic"))
    _positive("job.synthetic_samples", job.synthetic_samples)
    _positive("planner.reference_microbatches_per_stage", cfg.planner.reference_microbatches_per_stage)
    _positive("planner.transfer_sources", cfg.planner.transfer_sources)
    _positive("planner.replan_horizon_steps", cfg.planner.replan_horizon_steps, allow_zero=True)

    failures = cfg.failures
    _choice("failures.kind", failures.kind, ("none", "explicit", "poisson", "trace"))
    if failures.kind == "poisson":
        _positive("failures.mtbf_s", failures.mtbf_s)
    if failures.kind == "trace" and not failures.trace:
        raise ConfigError("failures.kind=trace needs failures.trace=<file or shipped name, e.g. synthetic/10m>")
    for index, event in enumerate(failures.events):
        key = f"failures.events[{index}]"
        _choice(f"{key}.action", event.action, ("remove", "join", "raise"))
        _choice(f"{key}.phase", event.phase, ("any", "forward", "backward", "allreduce", "optimizer", "reconfigure"))
        if (event.step is None) == (event.time_s is None):
            raise ConfigError(f"{key} needs exactly one of step=<int> or time_s=<seconds>")
        if event.nodes is None and event.count is None:
            raise ConfigError(f"{key} needs nodes=[ids] or count=<n>")

    _validate_strategy(cfg)
    sim = cfg.sim
    known = strategy_names()
    for index, name in enumerate(sim.strategies):
        _choice(f"sim.strategies[{index}]", name, known)
    _choice("sim.profile_source", sim.profile_source, ("analytic", "auto", "measured", "file"))
    if sim.duration_h is not None:
        _positive("sim.duration_h", sim.duration_h)
    if sim.nodes is not None:
        _positive("sim.nodes", sim.nodes)
    _positive("sim.timeline_bin_s", sim.timeline_bin_s)
    _positive("sim.node_creation_s", sim.node_creation_s, allow_zero=True)
    if not (isinstance(sim.trace_starts, int) and sim.trace_starts >= 1):
        raise ConfigError(f"sim.trace_starts={sim.trace_starts!r} must be an integer >= 1")
    if sim.trace_start_spacing_s is not None:
        _positive("sim.trace_start_spacing_s", sim.trace_start_spacing_s)
    for name, batch in (sim.global_batch_size_by_model or {}).items():
        if not (isinstance(batch, int) and batch >= 1):
            raise ConfigError(f"sim.global_batch_size_by_model.{name}={batch!r} must be an integer >= 1")
        if batch % int(cfg.job.microbatch_size):
            raise ConfigError(
                f"sim.global_batch_size_by_model.{name}={batch} is not a multiple of job.microbatch_size={cfg.job.microbatch_size}"
            )
    _choice("logger.wandb.mode", cfg.logger.wandb.mode, ("offline", "online", "disabled"))
    _validate_checkpoint(cfg)


def _validate_checkpoint(cfg: Config | DictConfig) -> None:
    checkpoint = cfg.checkpoint
    if checkpoint.every_steps is not None:
        _positive("checkpoint.every_steps", checkpoint.every_steps, allow_zero=True)
    if checkpoint.every_s is not None:
        _positive("checkpoint.every_s", checkpoint.every_s)
    if checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.keep={checkpoint.keep} must be >= 1 (the newest complete checkpoint is always kept)")
    _positive("checkpoint.io_threads", checkpoint.io_threads)
    _positive("checkpoint.max_pending", checkpoint.max_pending)
    _positive("checkpoint.write_timeout_s", checkpoint.write_timeout_s)
    if checkpoint.dir is not None and not str(checkpoint.dir).strip():
        raise ConfigError("checkpoint.dir='' is empty; set checkpoint.dir=<path> or checkpoint.dir=null for <run dir>/checkpoints")
    if cfg.job.resume is not None and not str(cfg.job.resume).strip():
        raise ConfigError("job.resume='' is empty; set job.resume=null (fresh start), job.resume=auto or job.resume=<checkpoint path>")


def strategy_names() -> tuple[str, ...]:
    """The strategies of ``conf/strategy/`` (``strategy=<name>``)."""
    return tuple(sorted(path.stem for path in (CONF_DIR / "strategy").glob("*.yaml")))


def _validate_strategy(cfg: Config | DictConfig) -> None:
    from oobleck.strategy import checkpoint_every_steps, strategy_class, strategy_config

    if OmegaConf.is_missing(cfg, "strategy") if isinstance(cfg, DictConfig) else cfg.strategy is MISSING:
        raise ConfigError(f"no strategy is chosen; set strategy=<one of {', '.join(strategy_names())}>")
    config = strategy_config(cfg.strategy)
    if config.checkpoint_every_steps < 0:
        raise ConfigError(f"strategy.checkpoint_every_steps={config.checkpoint_every_steps} must be >= 0")
    if strategy_class(cfg.strategy).requires_checkpoints and checkpoint_every_steps(cfg, config) <= 0:
        raise ConfigError(
            f"strategy={config.name} restarts from checkpoints, but checkpoints are disabled "
            f"(checkpoint.every_steps={cfg.checkpoint.every_steps if 'checkpoint' in cfg else None}); "
            "set checkpoint.every_steps=<k> > 0"
        )


def to_container(cfg: Config | DictConfig) -> dict[str, Any]:
    """A plain, resolved dict of the config (for plan.json, wandb and worker processes)."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def from_container(data: dict[str, Any]) -> DictConfig:
    """Rebuild a typed config from ``to_container``'s output (e.g. in a worker process)."""
    return OmegaConf.merge(OmegaConf.structured(Config), data)  # type: ignore[return-value]

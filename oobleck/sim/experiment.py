"""Simulation experiments: strategies x models x traces from one config, as tidy pandas tables.

``run_experiment(cfg)`` builds one ``StrategyContext`` per model and grid point of the uncertain
constants that change iteration times (profile, cluster, job, the model's batch from
``sim.global_batch_size_by_model``; the planner's templates are generated once per context and
shared by all traces, samples and strategies), runs ``oobleck.sim.engine.simulate`` for every
(model, trace, shifted start, strategy) (``oobleck.sim.replay``: ``sim.trace_starts`` replays of
each trace from shifted starts; decisions shared between them) at the nominal constants and at
every band sample (``oobleck.uncertainty``: decisions shared between the samples of a grid
point too) and returns DataFrames:

- ``metrics``: one row per period of constant state (throughput over time), ``sim_metrics.csv``;
- ``events``: one row per failure, join, reconfiguration, failover, restart, checkpoint, OOM, stop;
- ``summary``: one row per (model, trace, start, strategy) with throughput, the effective-time
  breakdown and Oobleck's speedups over each baseline on the same start (``add_speedups``);
  these three at the nominal constants;
- ``band``: one compact row per (model, trace, start, strategy, sample), ``sim_band.csv``, and
  ``samples``: the constants of every sample, ``sim_samples.csv``;
- ``ratios``: one row per (model, trace, baseline): the median and range of Oobleck's speedups over
  the starts, their band over the samples and whether that band crosses the cliff
  (``oobleck.sim.ratios``), ``sim_ratios.csv``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig, OmegaConf, open_dict

from oobleck.errors import ConfigError, PlanningError
from oobleck.faults.trace import Trace, load_trace
from oobleck.plain import merged, resolved_dict
from oobleck.planning.inputs import GB, ClusterSpec, ModelProfile
from oobleck.schema import CONF_DIR
from oobleck.sim.charges import CostCache
from oobleck.sim.engine import simulate
from oobleck.sim.ratios import add_speedups, speedup_ranges
from oobleck.sim.replay import DecisionMemo, Memoized, failure_interval_s, shifted_trace, start_offsets
from oobleck.strategy import Strategy, StrategyContext, build_strategy
from oobleck.uncertainty import Sample, band_samples, declared, with_values


def model_config(name: str) -> DictConfig:
    """``model=<name>`` as Hydra would compose it (``oobleck.config.load_group``)."""
    from oobleck.schema import group_names, load_group

    if name not in group_names("model"):
        raise ConfigError(
            f"sim.models has {name!r}, which is not in conf/model/; use one of: {', '.join(group_names('model'))}"
        )
    return load_group("model", name)


def model_profile(cfg: Any, name: str) -> ModelProfile:
    """The profile the simulator uses for model ``name`` (``sim.profile_source``)."""
    from oobleck.profiling import analytic_profile, get_profile

    model = model_config(name) if name != cfg.model.name else cfg.model
    if cfg.sim.profile_source == "analytic":
        return analytic_profile(model, cfg.cluster.gpu, int(cfg.job.microbatch_size))
    local = copy.deepcopy(cfg)
    with open_dict(local):
        local.model = model
        local.profile.source = cfg.sim.profile_source
    return get_profile(local)


def model_batch(cfg: Any, model: str) -> int:
    """The global batch a simulation of ``model`` uses (``sim.global_batch_size_by_model``, else ``job``)."""
    by_model = cfg.sim.get("global_batch_size_by_model") or {}
    return int(by_model.get(model, cfg.job.global_batch_size))


def build_context(cfg: Any, profile: ModelProfile, nodes: int, *, named_gpu: bool | None = None) -> StrategyContext:
    """The strategies' context for ``nodes`` nodes of ``cfg.cluster``.

    With analytic profiles the devices are the named GPU (``cluster.gpu``), so its memory
    (``cluster.gpu.memory_gb``) is the per-device budget; otherwise ``cluster.device_memory_gb``.
    ``named_gpu`` forces one or the other (validation uses the real run's own budget).
    """
    cluster = ClusterSpec.from_config(cfg.cluster)
    memory = cluster.device_memory_bytes
    if named_gpu if named_gpu is not None else cfg.sim.profile_source == "analytic":
        memory = float(cfg.cluster.gpu.memory_gb) * GB
    cluster = ClusterSpec(
        nodes=nodes,
        gpus_per_node=cluster.gpus_per_node,
        device_memory_bytes=memory,
        intra_node_bandwidth=cluster.intra_node_bandwidth,
        inter_node_bandwidth=cluster.inter_node_bandwidth,
    )
    context = StrategyContext.from_config(cfg, profile, cluster)
    context.global_batch_size = model_batch(cfg, profile.model)
    return context


def strategy_section(cfg: Any, name: str) -> Any:
    """The config of strategy ``name``: the composed ``cfg.strategy`` when that is the one chosen
    (so ``strategy.<key>=...`` overrides apply), else ``conf/strategy/<name>.yaml``."""
    if cfg.strategy.get("name") == name:
        return cfg.strategy
    path = CONF_DIR / "strategy" / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in (CONF_DIR / "strategy").glob("*.yaml")))
        raise ConfigError(f"sim.strategies has {name!r}, which is not in conf/strategy/; use one of: {known}")
    return OmegaConf.load(path)


def sim_overrides(cfg: Any, name: str) -> dict[str, Any]:
    """What a simulation changes in strategy ``name``'s config (typed when applied): the cluster's
    ``sim.costs`` under its ``costs``, then ``sim.params.<name>`` (which wins)."""
    overrides = cfg.sim.params.get(name) if cfg.sim.params else None
    if overrides is not None and not isinstance(overrides, (dict, DictConfig)):
        raise ConfigError(f"sim.params.{name}={overrides!r} must be a mapping of that strategy's settings")
    cluster_costs = cfg.sim.get("costs") or {}
    if not isinstance(cluster_costs, (dict, DictConfig)):
        raise ConfigError(
            f"sim.costs={cluster_costs!r} must be a mapping of cost constants (oobleck/recovery_costs.py, CostConstants)"
        )
    return resolved_dict(merged({"costs": cluster_costs} if cluster_costs else {}, overrides or {}))


def strategy_settings(cfg: Any, name: str) -> dict[str, Any]:
    """Strategy ``name``'s typed settings as the simulator runs it, as a plain dict (for logs)."""
    import dataclasses

    from oobleck.strategy import strategy_config

    return dataclasses.asdict(strategy_config(strategy_section(cfg, name), sim_overrides(cfg, name)))


def simulated_strategy(cfg: Any, name: str, context: StrategyContext, extra: dict[str, Any] | None = None) -> Strategy:
    """Strategy ``name`` as the simulator runs it: its config, ``sim.params.<name>``, then ``extra``."""
    overrides = merged(sim_overrides(cfg, name), extra or {})
    return build_strategy(strategy_section(cfg, name), context, resolved_dict(overrides))


@dataclass
class ExperimentResult:
    metrics: pd.DataFrame
    events: pd.DataFrame
    summary: pd.DataFrame
    seconds: float  # wall time of the whole experiment
    ratios: pd.DataFrame = field(default_factory=pd.DataFrame)
    # Every band sample's simulations (one compact row each) and the samples' constants.
    band: pd.DataFrame = field(default_factory=pd.DataFrame)
    samples: pd.DataFrame = field(default_factory=pd.DataFrame)

    def first_start(self) -> ExperimentResult:
        """The rows of each trace's unshifted replay (start 0) only: one timeline per run."""

        def keep(frame: pd.DataFrame) -> pd.DataFrame:
            return frame[frame["start"] == 0] if "start" in frame else frame

        return ExperimentResult(
            keep(self.metrics),
            keep(self.events),
            keep(self.summary),
            self.seconds,
            self.ratios,
            self.band,
            self.samples,
        )


# What a band row keeps of a simulation's summary.
BAND_COLUMNS = (
    "throughput",
    "oom",
    "ran",
    "no_durable_progress",
    "recovery_cycle_s",
    "restart_s_mean",
    "restart_share",
)


def _strategy_configs(cfg: Any, names: list[str]) -> dict[str, tuple[type[Strategy], Any]]:
    """Each strategy's class and typed config as the simulator runs it under ``cfg``."""
    from oobleck.strategy import strategy_class, strategy_config

    out = {}
    for name in names:
        section = strategy_section(cfg, name)
        out[name] = (strategy_class(section), strategy_config(section, sim_overrides(cfg, name)))
    return out


@dataclass
class Setup:
    """What every part of an experiment shares: traces and their windows, the band samples and
    each sample's strategy configs (built once, in the process that forks the others)."""

    cfg: Any
    nodes: int
    creation_s: float
    windows: list[tuple[Trace, list[float], float, float]]  # trace, start offsets, duration, failure interval
    constants: list[Any]
    samples: list[Sample]
    configs: dict[int, dict[str, tuple[type[Strategy], Any]]]  # sample -> strategy -> (class, config)

    @property
    def grids(self) -> dict[int, list[Sample]]:
        out: dict[int, list[Sample]] = {}
        for sample in self.samples:
            out.setdefault(sample.grid, []).append(sample)
        return out

    def parts(self) -> list[tuple[str, int]]:
        """(model, grid point) pairs: the unit of work a process takes (one context each)."""
        return [(str(model), grid) for model in self.cfg.sim.models for grid in self.grids]

    def simulations(self, part: tuple[str, int]) -> int:
        per_sample = sum(len(offsets) for _, offsets, _, _ in self.windows) * len(self.cfg.sim.strategies)
        return per_sample * len(self.grids[part[1]])


def prepare(cfg: Any) -> Setup:
    """The ``Setup`` of ``cfg``'s experiment."""
    traces: list[Trace] = [load_trace(name) for name in cfg.sim.traces]
    starts = int(cfg.sim.get("trace_starts", 1) or 1)
    spacing = cfg.sim.get("trace_start_spacing_s")
    constants = declared(cfg)
    samples = band_samples(constants, int(cfg.sim.get("band_samples", 0) or 0), int(cfg.sim.get("band_seed", 0) or 0))
    names = list(cfg.sim.strategies)
    return Setup(
        cfg=cfg,
        nodes=int(cfg.sim.nodes) if cfg.sim.nodes else max(t.max_nodes() for t in traces),
        creation_s=float(cfg.sim.get("node_creation_s", 0.0) or 0.0),
        windows=[(trace, *_window(trace, starts, spacing, cfg)) for trace in traces],
        constants=constants,
        samples=samples,
        configs={sample.index: _strategy_configs(with_values(cfg, sample.values), names) for sample in samples},
    )


def run_part(
    setup: Setup,
    part: tuple[str, int],
    *,
    progress: Callable[[str], None] | None = None,
    profile: ModelProfile | None = None,
) -> ExperimentResult:
    """Every simulation of one model at one grid point of the timing constants (all its samples);
    the summary has no speedups yet (``combine`` adds them over the whole experiment)."""
    started = time.perf_counter()
    cfg, (model, grid) = setup.cfg, part
    group = setup.grids[grid]
    names = list(cfg.sim.strategies)
    timing_keys = [c.key for c in setup.constants if c.changes_timing]
    point = with_values(cfg, {k: group[0].values[k] for k in timing_keys})
    profile = profile or model_profile(point, model)
    context = build_context(point, profile, setup.nodes)  # shared: templates are generated once per grid point
    memos = {name: DecisionMemo() for name in names}
    # One instance per strategy for the whole part, so that what it caches per context (Bamboo's
    # plans and memory) is built once; each sample sets its own config (costs only: decisions do
    # not depend on them) and each simulation starts from the instance's initial state (Memoized).
    instances = {
        name: setup.configs[group[0].index][name][0](setup.configs[group[0].index][name][1], context) for name in names
    }
    metrics: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    band: list[dict[str, Any]] = []
    for sample in group:
        # Per-plan costs under this sample's constants (the plans' bytes shared by all).
        caches = {name: CostCache(memos[name].geometry) for name in names}
        for trace, offsets, duration, interval in setup.windows:
            for index, offset in enumerate(offsets):
                replay = shifted_trace(trace, offset)
                for name in names:
                    if progress:
                        progress(f"{model} {trace.name} start {index} {name} sample {sample.index}")
                    clock = time.perf_counter()
                    inner = instances[name]
                    inner.config = setup.configs[sample.index][name][1]
                    strategy = Memoized(inner, memos[name])
                    labels = {
                        "model": model,
                        "trace": trace.name,
                        "start": index,
                        "start_offset_s": offset,
                        "strategy": name,
                    }
                    try:
                        result = simulate(
                            strategy,
                            replay,
                            duration_s=duration,
                            labels=labels,
                            node_creation_s=setup.creation_s,
                            cache=caches[name],
                        )
                    except PlanningError as error:
                        raise PlanningError(f"simulating {name} on {model} over {trace.name}: {error}") from None
                    row = {key: result.summary[key] for key in (*labels, *BAND_COLUMNS)}
                    band.append({**row, "sample": sample.index, "grid": grid, "failure_interval_s": interval})
                    if sample.index != 0:
                        continue
                    result.summary["global_batch_size"] = context.global_batch_size
                    result.summary["failure_interval_s"] = interval
                    result.summary["sim_wall_s"] = time.perf_counter() - clock
                    metrics.extend(result.segments)
                    events.extend(result.events)
                    summaries.append(result.summary)
    frames = (pd.DataFrame(metrics), pd.DataFrame(events), pd.DataFrame(summaries))
    return ExperimentResult(*frames, time.perf_counter() - started, band=pd.DataFrame(band))


def combine(setup: Setup, parts: list[ExperimentResult], seconds: float) -> ExperimentResult:
    """The parts of an experiment as one result: tables concatenated in the order given, Oobleck's
    speedups, the ratios with their bands, and the samples' constants."""

    def table(name: str) -> pd.DataFrame:
        frames = [getattr(part, name) for part in parts if not getattr(part, name).empty]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    summary, band = table("summary"), table("band")
    ratios = pd.DataFrame()
    if not summary.empty:
        summary = add_speedups(summary)
        ratios = speedup_ranges(summary, band)
    testbed = str(setup.cfg.sim.get("testbed", "none"))
    for frame in (summary, band, ratios):
        if not frame.empty:
            frame.insert(0, "testbed", testbed)  # the cluster preset: tables of two presets stay apart
    return ExperimentResult(
        table("metrics"), table("events"), summary, seconds, ratios, band, sample_table(setup.constants, setup.samples)
    )


def run_experiment(
    cfg: Any, *, progress: Callable[[str], None] | None = None, profiles: dict[str, ModelProfile] | None = None
) -> ExperimentResult:
    """Simulate every (model, trace, start, strategy) of ``cfg.sim`` at the nominal constants and at
    every band sample (``oobleck.uncertainty``), in this process; ``profiles`` overrides per
    model (then the uncertain constants of the GPU do not act on that model's profile)."""
    started = time.perf_counter()
    setup = prepare(cfg)
    parts = [run_part(setup, part, progress=progress, profile=(profiles or {}).get(part[0])) for part in setup.parts()]
    return combine(setup, parts, time.perf_counter() - started)


def _window(trace: Trace, starts: int, spacing: Any, cfg: Any) -> tuple[list[float], float, float]:
    """The shifted starts of ``trace``, the length every start replays, and its failure interval."""
    offsets = start_offsets(trace, starts, None if spacing is None else float(spacing))
    # Every start replays the same length: sim.duration_h, or inside the trace (its span less the
    # last offset).
    span = (trace.end_ms - trace.start_ms) / 1000.0 - offsets[-1]
    if span <= 0 and len(offsets) > 1:
        raise ConfigError(
            f"sim.trace_start_spacing_s={spacing}: the last of sim.trace_starts={starts} starts is "
            f"{offsets[-1]:.0f} s into {trace.name}, past its end; use a smaller spacing"
        )
    duration = float(cfg.sim.duration_h) * 3600.0 if cfg.sim.duration_h else span
    return offsets, duration, failure_interval_s(trace)


def sample_table(constants: list[Any], samples: list[Sample]) -> pd.DataFrame:
    """One row per band sample: its index, grid point and the value of every uncertain constant."""
    rows = [{"sample": s.index, "grid": s.grid, **{c.name: s.values[c.key] for c in constants}} for s in samples]
    return pd.DataFrame(rows)


def write_outputs(result: ExperimentResult, run_dir: Path, extra: dict[str, Any] | None = None) -> dict[str, Path]:
    """``sim_metrics.csv``, ``sim_events.csv``, ``sim_summary.csv`` and ``summary.json`` in ``run_dir``."""
    import json
    import math

    run_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "metrics": run_dir / "sim_metrics.csv",
        "events": run_dir / "sim_events.csv",
        "summary_csv": run_dir / "sim_summary.csv",
        "ratios": run_dir / "sim_ratios.csv",
        "band": run_dir / "sim_band.csv",
        "samples": run_dir / "sim_samples.csv",
        "summary": run_dir / "summary.json",
    }
    result.metrics.to_csv(paths["metrics"], index=False)
    result.events.to_csv(paths["events"], index=False)
    result.summary.to_csv(paths["summary_csv"], index=False)
    result.ratios.to_csv(paths["ratios"], index=False)
    result.band.to_csv(paths["band"], index=False)
    result.samples.to_csv(paths["samples"], index=False)

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if hasattr(value, "item"):
            return clean(value.item())
        return value

    runs = [{k: clean(v) for k, v in row.items()} for row in result.summary.to_dict(orient="records")]
    ratios = [{k: clean(v) for k, v in row.items()} for row in result.ratios.to_dict(orient="records")]
    payload = {**(extra or {}), "wall_time_s": result.seconds, "runs": runs, "ratios": ratios}
    paths["summary"].write_text(json.dumps(payload, indent=1))
    return paths

"""wandb runs of a simulation: one per (model, trace, strategy), and one with the experiment's figures.

Each simulated run looks like a real one in a dashboard: grouped by experiment, job type = the
strategy, config keys ``model.name``, ``strategy.name`` and ``failures.trace`` as real runs have
them, and numeric history over simulated time (``sim_time_h``): throughput, nodes alive and
nodes used as step functions (a point at both ends of every period of constant state), events
as markers and as a typed table, the run's summary row (throughput, counts, effective-time
breakdown, Oobleck's speedups) as its summary, and its own slice of the output tables as an
artifact. The extra ``figures`` run holds the figures, the summary table and all output files.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from oobleck.metrics.wandb_run import (
    RunIdentity,
    WandbRun,
    choose_group,
    config_yaml,
    run_dir_files,
    run_identity,
    sweep_job,
)

SIM_TIME = "sim_time_h"
SIM_AXES = {"sim/": SIM_TIME, "event/": SIM_TIME}
LABELS = ("model", "trace", "strategy")
SEGMENT_VALUES = ("samples_per_s", "nodes_alive", "nodes_used", "iteration_s")
OUTPUT_FILES = ("sim_metrics.csv", "sim_events.csv", "sim_summary.csv", "summary.json")


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in str(text))


def _rows(frame: Any, model: str, trace: str, strategy: str) -> Any:
    if frame.empty:
        return frame
    return frame[(frame["model"] == model) & (frame["trace"] == trace) & (frame["strategy"] == strategy)]


# (model name, strategy name) -> the ``model`` and ``strategy`` sections of that simulated run's
# config, as the simulator ran it (``oobleck.simulate`` passes them: the simulator's own modules
# sit above these writers).
RunSections = Callable[[str, str], Mapping[str, Any]]


def run_config(
    config: Mapping[str, Any], sections: RunSections, model: str, trace: str, strategy: str
) -> dict[str, Any]:
    """The experiment's config with this run's model, strategy and failure trace in the places a
    real run's config has them, so one dashboard filter or grouping works for both."""
    out = dict(config)
    out.update(sections(model, strategy))
    out["failures"] = {"kind": "trace", "trace": trace}
    out["sim_run"] = {"model": model, "trace": trace, "strategy": strategy}
    return out


def _log_one(
    cfg: Any,
    result: Any,
    run_dir: Path,
    config: Mapping[str, Any],
    sections: RunSections,
    summary: Mapping[str, Any],
    sweep: Any,
) -> Path:
    model, trace, strategy = (str(summary[k]) for k in LABELS)
    segments = _rows(result.metrics, model, trace, strategy)
    events = _rows(result.events, model, trace, strategy)
    nodes = int(segments["nodes_alive"].max()) if not segments.empty else 0
    settings = cfg.logger.wandb
    identity = run_identity(
        strategy=strategy,
        model=model,
        nodes=nodes,
        failures=trace,
        experiment=cfg.experiment,
        group=settings.group,
        tags=list(settings.tags or []),
        sweep=sweep,
        simulated=True,
        default_group=f"sim-{run_dir.name}",
    )
    run = WandbRun(
        settings,
        identity,
        run_config(config, sections, model, trace, strategy),
        run_dir,
        axes=SIM_AXES,
        time_key=SIM_TIME,
        id_key=f"{model}|{trace}|{strategy}",
    )
    start = float(segments["t_start_s"].min()) if not segments.empty else 0.0
    for segment in segments.to_dict(orient="records"):
        values = {f"sim/{k}": segment[k] for k in SEGMENT_VALUES if k in segment}
        for edge in ("t_start_s", "t_end_s"):
            run.log({SIM_TIME: (float(segment[edge]) - start) / 3600.0, **values})
    own = [c for c in events.columns if c not in LABELS]
    for event in events.to_dict(orient="records"):
        run.event(
            str(event["kind"]), (float(event["time_s"]) - start) / 3600.0, {k: event[k] for k in own if k != "kind"}
        )
    run.table("events", [{k: e[k] for k in own} for e in events.to_dict(orient="records")], own)
    texts = {
        "sim_metrics.csv": segments.to_csv(index=False),
        "sim_events.csv": events.to_csv(index=False),
        "sim_summary.csv": _rows(result.summary, model, trace, strategy).to_csv(index=False),
        "config.yaml": config_yaml(run_config(config, sections, model, trace, strategy)),
    }
    run.artifact(f"sim-files-{run.run.id}", "sim-files", {}, texts)
    return run.finish(dict(summary))


def _log_figures(
    cfg: Any, result: Any, figures: list[Path], run_dir: Path, config: Mapping[str, Any], sweep: Any, group: str
) -> Path:
    settings = cfg.logger.wandb
    experiment = cfg.experiment if cfg.experiment != "default" else run_dir.name
    identity = RunIdentity(
        name=f"sim-{experiment}-figures" + (f"-j{sweep.num}" if sweep is not None else ""),
        group=group,
        job_type="figures",
        tags=tuple(
            dict.fromkeys(["simulation", "figures", f"experiment={experiment}", *map(str, settings.tags or [])])
        ),
    )
    run = WandbRun(settings, identity, config, run_dir, axes={}, time_key=SIM_TIME, id_key="figures")
    for path in figures:
        if path.suffix == ".png":
            run.image(f"figures/{path.stem}", path)
    run.table("summary", result.summary.to_dict(orient="records"), list(result.summary.columns))
    files = run_dir_files(run_dir, OUTPUT_FILES)
    files.update({p.name: p for p in figures})
    run.artifact(f"sim-outputs-{run.run.id}", "sim-outputs", files, {"config.yaml": config_yaml(config)})
    return run.finish({"runs": int(len(result.summary)), "wall_time_s": float(result.seconds)})


def log_simulation(
    cfg: Any, result: Any, figures: list[Path], run_dir: Path, config: Mapping[str, Any], sections: RunSections
) -> list[Path]:
    """Log every simulated run and the figures run; returns their local wandb folders."""
    sweep = sweep_job(run_dir)
    folders = [
        _log_one(cfg, result, run_dir, config, sections, row, sweep) for row in result.summary.to_dict(orient="records")
    ]
    group = choose_group(cfg.logger.wandb.group, cfg.experiment, sweep, f"sim-{run_dir.name}")
    folders.append(_log_figures(cfg, result, figures, run_dir, config, sweep, group))
    return folders

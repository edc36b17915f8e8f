"""``python -m oobleck.simulate``: trace-driven simulation of resilience strategies (Hydra app).

Runs every (model, trace, shifted start, strategy) of the ``sim:`` section
(``experiment=paper_failure_frequency`` or ``experiment=paper_spot`` set it up like the paper),
then writes to the Hydra run dir: ``sim_metrics.csv`` (throughput over time), ``sim_events.csv``,
``sim_summary.csv`` (one row per model, trace, start and strategy), ``sim_ratios.csv`` (Oobleck's
speedups: median and range over the starts), ``summary.json`` and, unless ``sim.figures=false``,
the seaborn figures of ``analysis.figures`` (PNG and PDF); unless ``logger.wandb.mode=disabled``,
one wandb run per (model, trace, strategy) of the unshifted start (``oobleck.metrics.simulation``).
Installed, the command is ``oobleck-simulate``.

Without ``experiment=`` it simulates the config's own cluster, the local toy settings (CPU-sized
links, batch 32), which is not the paper's setting; it says so before and after. Ctrl-C writes the
outputs of the models simulated so far. Examples::

    python -m oobleck.simulate experiment=paper_failure_frequency
    python -m oobleck.simulate experiment=paper_spot sim.models=[gpt3_2_7b] sim.traces=[spot/ec2_p3_scaled] sim.strategies=[oobleck,varuna]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from oobleck.cli import Interrupted, entry, run_app
from oobleck.config import CONF_DIR, group_names, register_configs, to_container, validate

PROGRAM = "oobleck.simulate"


def summary_table(summary, ratios=None) -> str:
    """A compact text table: throughput per (model, trace) and strategy, plus Oobleck's speedups
    (``OOM`` where a baseline does not fit in memory), their bands over the uncertain constants
    and, below it, the threshold each cell marked "!" crosses."""
    from analysis.load import cliff_notes, format_throughput_table

    if summary.empty:
        return "(no runs)"
    starts = summary["start"].nunique() if "start" in summary else 1
    notes = []
    if starts > 1 or ("no_durable_progress" in summary and summary["no_durable_progress"].any()):
        notes.append("ratios: median [min-max] over the shifted starts; * kept no durable progress in some start")
    if ratios is not None and "ratio_low" in ratios:
        notes.append(
            "{low-high}: the band over the uncertain constants (sim.uncertain) and the starts; ! the band crosses "
            "the cliff where a restart plus a checkpoint interval stops fitting between failures, !! lies beyond it:"
        )
        notes += [f"  {line}" for line in cliff_notes(ratios)]
    return format_throughput_table(summary, ratios) + "".join(
        f"\n({n})" if not n.startswith("  ") else f"\n{n}" for n in notes
    )


def run_sections(cfg: DictConfig, model: str, strategy: str) -> dict[str, Any]:
    """The ``model`` and ``strategy`` sections of one simulated run's config, as it ran (its wandb run
    shows them where a real run's config has them)."""
    from omegaconf import OmegaConf

    from oobleck.sim.experiment import model_config, strategy_settings

    return {
        "model": OmegaConf.to_container(model_config(model), resolve=True),
        "strategy": strategy_settings(cfg, strategy),
    }


def toy_setting_notice(cfg: DictConfig) -> str | None:
    """The loud line for a simulation without ``experiment=`` (None with one): what it simulates."""
    if cfg.experiment != "default":
        return None
    cluster, job = cfg.cluster, cfg.job
    experiments = ", ".join(f"experiment={name}" for name in group_names("experiment"))
    return (
        f"{PROGRAM}: NOTE: no experiment= given, so this simulates the config's own toy setting "
        f"(cluster={cluster.kind}: {cluster.gpus_per_node} {cluster.gpu.name} per node, "
        f"{cluster.inter_node_bandwidth_gbps:g} GB/s between nodes, batch {job.global_batch_size} of "
        f"{job.microbatch_size}), not the paper's; for the paper's settings use {experiments}"
    )


def _parts_done(setup: Any, done: dict) -> list[str]:
    """The models every part of which has finished, in the config's order (up to the first gap)."""
    finished = []
    for model in setup.cfg.sim.models:
        if not all(part in done for part in setup.parts() if part[0] == model):
            break
        finished.append(str(model))
    return finished


def simulate_parts(setup: Any, processes: int, bar: Any) -> tuple[dict, bool]:
    """Run every part of the experiment (one model at one grid point), over ``processes`` processes
    when that is more than one (see below how they start); returns the results by part and whether
    Ctrl-C stopped it."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from oobleck.sim import experiment

    done: dict = {}
    parts = setup.parts()
    try:
        if processes <= 1 or len(parts) <= 1:

            def progress(label: str) -> None:
                bar.set_postfix_str(label)
                bar.update(1)

            for part in parts:
                done[part] = experiment.run_part(setup, part, progress=progress)
            return done, False
        import multiprocessing
        import threading

        # Forked where this process runs no other thread: the children share the parent's imports
        # (a simulation uses no CUDA). A fork of a process with other threads (a test runner after
        # other work, an application embedding this) copies locks those threads held, and a child
        # crashed in its first garbage collection so; then a fork server, started clean, forks them.
        context = multiprocessing.get_context("fork" if threading.active_count() == 1 else "forkserver")
        if context.get_start_method() == "forkserver":
            # The server imports the simulator once and its children fork from it; without this
            # every child imports it again (~1 s of CPU each). Applies when the server starts.
            context.set_forkserver_preload(["oobleck.sim.experiment"])
        with ProcessPoolExecutor(max_workers=min(processes, len(parts)), mp_context=context) as pool:
            futures = {pool.submit(experiment.run_part, setup, part): part for part in parts}
            try:
                for future in as_completed(futures):
                    part = futures[future]
                    done[part] = future.result()
                    bar.set_postfix_str(f"{part[0]} grid point {part[1]}")
                    bar.update(setup.simulations(part))
            except KeyboardInterrupt:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    except KeyboardInterrupt:
        return done, True
    return done, False


def run(cfg: DictConfig, run_dir: Path) -> dict:
    import os

    from tqdm import tqdm

    from oobleck.sim.experiment import combine, prepare, write_outputs

    validate(cfg)
    notice = toy_setting_notice(cfg)
    if notice:
        print(notice, file=sys.stderr, flush=True)
    started = time.perf_counter()
    setup = prepare(cfg)
    models = [str(m) for m in cfg.sim.models]
    total = sum(setup.simulations(part) for part in setup.parts())
    processes = int(cfg.sim.processes) or (os.cpu_count() or 1)
    with tqdm(total=total, desc="simulate", unit="run", disable=not cfg.logger.progress_bar) as bar:
        # A part is one model at one grid point (its templates and decisions are shared by its
        # traces, starts and samples); Ctrl-C keeps every model all of whose parts finished.
        done, interrupted = simulate_parts(setup, processes, bar)
    finished = _parts_done(setup, done)
    kept = [done[part] for part in setup.parts() if part[0] in finished]
    result = combine(setup, kept, time.perf_counter() - started)
    config = to_container(cfg)
    extra = {"experiment": cfg.experiment, "sim": config["sim"]}
    if interrupted:
        extra["interrupted"] = {"models_done": finished, "models_requested": models}
    paths = write_outputs(result, run_dir, extra=extra)
    if interrupted:
        raise Interrupted(
            f"wrote the {len(finished)} of {len(models)} models simulated so far ({', '.join(finished) or 'none'}) "
            f"to {paths['summary_csv']} and the other sim_*.csv in {run_dir}"
        )
    figures = []
    if cfg.sim.figures:
        from analysis.figures import write_figures

        print(f"{PROGRAM}: writing figures to {run_dir} ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        figures = write_figures(
            result.metrics,
            result.summary,
            run_dir,
            bin_s=float(cfg.sim.timeline_bin_s),
            band=result.band,
            ratios=result.ratios,
        )
        print(
            f"{PROGRAM}: wrote {len(figures)} figure files in {time.perf_counter() - started:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    if cfg.logger.wandb.mode != "disabled":
        from oobleck.metrics.simulation import log_simulation

        print(
            f"{PROGRAM}: logging {len(result.summary)} simulations to wandb ({cfg.logger.wandb.mode}) ...",
            file=sys.stderr,
            flush=True,
        )
        log_simulation(cfg, result.first_start(), figures, run_dir, config, lambda m, s: run_sections(cfg, m, s))
    print(summary_table(result.summary, result.ratios), flush=True)
    print(f"{PROGRAM}: {total} simulations in {result.seconds:.1f} s; outputs in {run_dir}", flush=True)
    if notice:
        print(notice, file=sys.stderr, flush=True)
    return {k: str(v) for k, v in paths.items()}


register_configs()  # before @hydra.main composes: conf/config.yaml starts from the schema


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with entry(PROGRAM) as run_dir:
        run(cfg, run_dir)


def cli() -> None:
    """The ``oobleck-simulate`` command."""
    run_app(main, PROGRAM)


if __name__ == "__main__":
    cli()

"""One real training job end to end: checks, the strategy's first decision, the controller, outputs.

``launch(cfg, run_dir)`` is what ``python -m oobleck.run`` calls (and what tests call in-process):
it validates everything that can be checked before any process starts (``check_run``: config,
the cluster's environment and devices, the failure schedule and trace; then the checkpoint to
resume from, and that the checkpoint directory can take the run's checkpoints), builds the
strategy the config names and asks it for its starting layout (a strategy that cannot start, e.g.
a Bamboo layout that does not fit in memory, stops here with its reason), starts the controller
(which starts the local agents), and writes plan.json, metrics.csv, events.csv, summary.json and
the wandb run through ``RunRecorder``. A run resumed in its own run dir continues it: the
earlier attempts' rows stay, and summary.json covers them all (``earlier_attempts``). Whatever
stops the controller, summary.json is written.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from oobleck.checkpoint.durable import describe_cause
from oobleck.config import to_container, validate
from oobleck.elastic.accounting import HostReport, earlier_attempts, summarize
from oobleck.elastic.controller import Controller
from oobleck.elastic.forkserver import ForkServer, fork_server_for
from oobleck.elastic.ledger import Outcome
from oobleck.elastic.protocol import new_run_id
from oobleck.elastic.store_host import RunPorts, bind_run_ports
from oobleck.errors import RunError, unwritable_message
from oobleck.faults.schedule import FaultEvent, build_schedule
from oobleck.launcher import launcher_class
from oobleck.metrics.host import HostSnapshot
from oobleck.planning.horizon import mean_change_gap_s, replan_horizon_steps
from oobleck.planning.outputs import ExecutionPlan
from oobleck.schedules import checked_schedule
from oobleck.strategy import Decision, Kind, Strategy, StrategyContext, build_strategy


def check_device(cfg: Any) -> None:
    """Refuse devices the run cannot have where it starts (its launcher's ``check_devices``)."""
    launcher_class(cfg.cluster).check_devices(cfg.cluster)


def check_run(cfg: Any) -> tuple[FaultEvent, ...]:
    """Everything about a run checked before anything is created: the config (``validate``), where
    its nodes start (``Launcher.check_environment``: e.g. inside a Slurm allocation), its devices,
    and its failure schedule (a trace file, events past the run). Returns the schedule."""
    validate(cfg)
    launcher = launcher_class(cfg.cluster)
    launcher.check_environment(cfg.cluster)
    launcher.check_devices(cfg.cluster)
    return build_schedule(cfg.failures, nodes=int(cfg.cluster.nodes), steps=int(cfg.job.steps))


def check_checkpoint_dir(cfg: Any, run_dir: Path, strategy: Strategy) -> None:
    """A run that writes checkpoints gets a checkpoint directory it can write, with room for one
    checkpoint of its model (``oobleck.checkpoint.storage``), before any process starts."""
    from oobleck.checkpoint import checkpoint_root
    from oobleck.checkpoint.storage import checkpoint_bytes, probe_checkpoint_dir
    from oobleck.models.registry import architecture
    from oobleck.strategy import checkpoint_every_steps

    if checkpoint_every_steps(cfg, strategy.config) <= 0 and cfg.checkpoint.every_s is None:
        return
    model = architecture(cfg.model)
    needed = checkpoint_bytes([model.params(layer) for layer in range(model.num_layers)])
    probe_checkpoint_dir(checkpoint_root(cfg.checkpoint.dir, run_dir), needed, int(cfg.checkpoint.keep))


def make_strategy(cfg: Any) -> Strategy:
    """The run's strategy (``cfg.strategy``) on its profile, cluster and job."""
    from oobleck.profiling import get_profile

    return build_strategy(cfg.strategy, StrategyContext.from_config(cfg, get_profile(cfg)))


def initial_decision(strategy: Strategy, nodes: int, initial_plan: ExecutionPlan | None) -> Decision:
    """The layout to start on: the strategy's, or ``initial_plan`` (a hand-built Oobleck plan, for tests)."""
    if initial_plan is not None:
        from oobleck.strategies.oobleck import plan_layout

        return Decision(Kind.START, plan_layout(initial_plan))
    decision = strategy.start(list(range(nodes)))
    if decision.kind is Kind.STOP:
        raise RunError(f"strategy={strategy.name} cannot run on {nodes} nodes: {decision.reason}")
    return decision


@contextlib.contextmanager
def stop_on_signals(controller: Controller) -> Iterator[None]:
    """SIGINT / SIGTERM stop the run cleanly (workers stopped, summary and events written, wandb
    closed; exit 130 / 143); SIGUSR1 (what ``slurm/run.sbatch`` asks Slurm to send before a time
    limit or a preemption) checkpoints the next step boundary first and exits 75 to be requeued."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {
        signal.SIGINT: lambda *_: controller.request_stop("interrupted (SIGINT)", 128 + signal.SIGINT),
        signal.SIGTERM: lambda *_: controller.request_stop("terminated (SIGTERM)", 128 + signal.SIGTERM),
        signal.SIGUSR1: lambda *_: controller.request_checkpoint_stop("the job is about to end (SIGUSR1)"),
    }
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def launch(
    cfg: Any,
    run_dir: str | Path,
    *,
    initial_plan: ExecutionPlan | None = None,
    recorder: bool = True,
    handle_signals: bool = False,
    on_start: Callable[[Controller], None] | None = None,
    run_id: str | None = None,
    fork_server: ForkServer | None = None,
) -> tuple[Outcome, dict[str, Any]]:
    """Run the job; returns what happened and the summary. Raises ``RunError`` if it had to stop
    (after writing the summary of what it did). ``handle_signals``: see ``stop_on_signals``;
    ``on_start`` is handed the controller before it starts (tests watch or attack the run).
    ``fork_server`` (with its ``run_id``): one the caller started early and closes; without it, a
    config that forks workers gets one started here, before planning, and closed at the end
    (forked from this process where it can be: ``ForkServer``)."""
    schedule = check_run(cfg)
    # The run's ports first: one in use is a clear error before any process (fork server, wandb) starts.
    with bind_run_ports(cfg.cluster) as ports:
        run_id = run_id or new_run_id()
        own = fork_server_for(cfg, run_id, from_this_process=True) if fork_server is None else None
        try:
            return _launch(
                cfg,
                Path(run_dir),
                schedule,
                initial_plan,
                recorder,
                handle_signals,
                on_start,
                run_id,
                fork_server or own,
                ports,
            )
        finally:
            if own is not None:
                own.close()


def _launch(
    cfg: Any,
    run_dir: Path,
    schedule: tuple[FaultEvent, ...],
    initial_plan: ExecutionPlan | None,
    recorder: bool,
    handle_signals: bool,
    on_start: Callable[[Controller], None] | None,
    run_id: str,
    fork_server: ForkServer | None,
    ports: RunPorts,
) -> tuple[Outcome, dict[str, Any]]:
    from oobleck.checkpoint import resume_checkpoint

    host = HostReport(cfg, HostSnapshot.now())  # before this run starts any process
    resume = resume_checkpoint(cfg, run_dir)
    if resume is not None and resume.step >= int(cfg.job.steps):
        raise RunError(f"{resume.step_dir} already holds all job.steps={cfg.job.steps} steps; nothing to resume")
    strategy = make_strategy(cfg)
    started = time.perf_counter()
    initial = initial_decision(strategy, int(cfg.cluster.nodes), initial_plan)
    assert initial.layout is not None
    checked_schedule(initial.layout.plan)  # a plan whose schedule cannot run fails before any process starts
    horizon, why = replan_horizon(cfg, schedule, initial.layout.iteration_s)
    strategy.context.replan_horizon_steps = horizon
    print(
        f"planning: strategy={strategy.name} starts on {initial.layout.description} "
        f"(predicted {initial.layout.iteration_s:.3g} s per step), planned in {time.perf_counter() - started:.2f} s; "
        f"regroup-or-re-plan horizon {horizon} steps ({why})",
        file=sys.stderr,
        flush=True,
    )
    check_writable(run_dir)
    check_checkpoint_dir(cfg, run_dir, strategy)
    config_dict = to_container(cfg)
    save_resolved_config(config_dict, run_dir)
    rec = None
    if recorder:
        from oobleck.metrics import RunRecorder

        rec = RunRecorder(
            run_dir,
            config_dict,
            total_steps=int(cfg.job.steps),
            strategy=strategy.name,
            wandb=cfg.logger.wandb,
            progress_bar=bool(cfg.logger.progress_bar),
            # A resume (or job.resume=auto finding nothing yet) continues the run dir's files and
            # wandb run: the earlier attempts' rows stay.
            resume=cfg.job.resume is not None,
            host=host.start.as_start(),
        )
    earlier = None
    if rec is not None and (rec.earlier_metrics or rec.earlier_events):
        earlier = earlier_attempts(rec.earlier_metrics, rec.earlier_events, resume.step if resume is not None else 0)
    controller = Controller(
        cfg,
        config_dict,
        strategy=strategy,
        initial=initial,
        run_dir=run_dir,
        recorder=rec,
        schedule=schedule,
        resume=resume,
        run_id=run_id,
        fork_server=fork_server,
        earlier=earlier,
        ports=ports,
    )
    controller.observers.append(host)
    if on_start is not None:
        on_start(controller)
    try:
        with stop_on_signals(controller) if handle_signals else contextlib.nullcontext():
            outcome = controller.run()
    except BaseException:  # whatever stopped it (a bug too): the summary says what the run did
        if rec is not None:
            try:
                rec.finish(**summarize(controller.outcome, cfg), host=host.record())
            except OSError as error:  # the run dir itself cannot be written: the original error wins
                print(
                    f"oobleck: summary.json could not be written ({describe_cause(error)})", file=sys.stderr, flush=True
                )
        raise
    summary = summarize(outcome, cfg)
    summary["host"] = host.record()
    if cfg.runtime.save_final_params:
        save_final_params(controller, run_dir / "final_params.pt")
    if cfg.runtime.record_work:
        save_work_ledger(controller, run_dir / "work.json")
    if rec is not None:
        rec.write_json(
            "probes.json", {str(g): {str(r): p for r, p in ranks.items()} for g, ranks in outcome.probes.items()}
        )
        summary = rec.finish(**summary)
    return outcome, summary


def replan_horizon(cfg: Any, schedule: tuple[FaultEvent, ...], iteration_s: float) -> tuple[int, str]:
    """The steps over which a fresh plan must repay its extra copying (``planner.replan_horizon``,
    ``oobleck.planning.horizon``), and where the figure comes from: the mean gap between the
    schedule's membership changes (poisson: ``failures.mtbf_s``; explicit: the run's steps over
    its changes; a trace: its span over its changes) over the first plan's predicted step time."""
    fixed = int(cfg.planner.replan_horizon_steps)
    if cfg.planner.replan_horizon != "schedule":
        return fixed, "planner.replan_horizon=fixed"
    if not schedule:
        return fixed, "no failure schedule to derive it from: planner.replan_horizon_steps"
    if cfg.failures.kind == "poisson":
        gap: float | None = float(cfg.failures.mtbf_s)
        source = f"failures.mtbf_s={cfg.failures.mtbf_s}"
    else:
        times = [e.time_s if e.time_s is not None else (e.step or 0) * iteration_s for e in schedule]
        span = int(cfg.job.steps) * iteration_s if cfg.failures.kind == "explicit" else None
        gap = mean_change_gap_s(times, span)
        source = f"{len(set(times))} membership changes of failures={cfg.failures.kind}"
    if gap is None:
        return fixed, "the failure schedule spans no time: planner.replan_horizon_steps"
    steps = replan_horizon_steps(gap, iteration_s, fixed)
    return steps, f"{source}: one every {gap:.3g} s, at {iteration_s:.3g} s per step"


def check_writable(run_dir: Path) -> None:
    """Refuse a run dir the run could not write its files to, before any process starts."""
    probe = run_dir / f".oobleck-write-check-{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise RunError(unwritable_message(error, f"the run dir {run_dir}")) from None


def save_resolved_config(config: dict[str, Any], run_dir: Path) -> None:
    """``.hydra/config.yaml`` as Hydra writes it, for a run launched without Hydra's CLI (tests,
    benchmarks), so every run dir can be loaded (``analysis.load``) and validated alike."""
    path = run_dir / ".hydra" / "config.yaml"
    if path.exists():
        return
    from omegaconf import OmegaConf

    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(config), path)


def save_work_ledger(controller: Controller, path: Path) -> None:
    """Every committed step's compute ops, per rank (``runtime.record_work``), into one JSON file:
    ``{step: {"generation": g, "ranks": {rank: {"worker": [node, gpu], "ops": [[kind, microbatch,
    start, end, lo, hi], ...]}}}}``."""
    from oobleck.runtime import keys

    store = controller.store
    assert controller.ledger is not None and store is not None
    ledger: dict[str, Any] = {}
    for row in controller.outcome.steps:
        step, generation = int(row["step"]), int(row["generation"])
        plan = controller.ledger.generations[generation].layout.plan
        ranks = {}
        for a in plan.assignments():
            key = keys.work(generation, step, a.rank)
            if not store.check([key]):
                raise RunError(f"rank {a.rank} of generation {generation} did not record its work of step {step}")
            ranks[str(a.rank)] = {"worker": list(a.worker), "ops": json.loads(store.get(key))}
        ledger[str(step)] = {"generation": generation, "ranks": ranks}
    path.write_text(json.dumps(ledger))


def save_final_params(controller: Controller, path: Path) -> None:
    """Collect each layer's final parameters (published by one holder) into one file."""
    import torch

    from oobleck.runtime import keys

    store = controller.store
    assert controller.ledger is not None and store is not None
    plan = controller.ledger.layout.plan
    state: dict[str, Any] = {}
    for layer in range(plan.num_layers):
        key = keys.final_params(layer)
        if not store.check([key]):
            raise RunError(f"layer {layer}'s final parameters were not published")
        state[str(layer)] = torch.load(io.BytesIO(store.get(key)), weights_only=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)

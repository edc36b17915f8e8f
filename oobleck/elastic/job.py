"""One real training job end to end: checks, profile and templates, the controller, the outputs.

``launch(cfg, run_dir)`` is what ``python -m oobleck.run`` calls (and what tests call in-process):
it validates everything that can be checked before any process starts (config, CUDA, the failure
schedule and trace), plans, starts the controller (which starts the local agents), and writes
plan.json, metrics.csv, events.csv, summary.json and the wandb run through ``RunRecorder``.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Optional

from oobleck.config import to_container, validate
from oobleck.elastic.controller import Controller, Outcome, summarize
from oobleck.errors import ConfigError, OobleckError, RunError
from oobleck.faults.schedule import build_schedule
from oobleck.planning.plan import ExecutionPlan


def check_strategy(cfg: Any) -> None:
    """Real runs execute Oobleck; the baselines exist in the simulator only (see README)."""
    name = str(cfg.strategy.name)
    if name != "oobleck":
        raise ConfigError(
            f"strategy={name} runs in the simulator only: python -m oobleck.simulate sim.strategies=[{name},oobleck]; "
            "real runs (python -m oobleck.run) use strategy=oobleck"
        )


def check_device(cfg: Any) -> None:
    if cfg.cluster.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise RunError("cluster.device=cuda but CUDA is not available on this machine; use cluster.device=cpu")
    if cfg.cluster.kind == "local" and torch.cuda.device_count() < int(cfg.cluster.gpus_per_node):
        raise RunError(
            f"cluster.gpus_per_node={cfg.cluster.gpus_per_node} but this machine has {torch.cuda.device_count()} CUDA devices"
        )
    if cfg.cluster.kind == "local" and int(cfg.cluster.nodes) > 1:
        # A worker takes device cuda:<local rank>, so every local "node" would put its workers on
        # the same GPUs, and NCCL refuses two ranks of one communicator on one device
        # ("Duplicate GPU detected", ncclInvalidUsage, in its init).
        raise RunError(
            f"cluster.kind=local with cluster.device=cuda runs on one machine's GPUs, but cluster.nodes={cfg.cluster.nodes} "
            "local nodes would all use devices cuda:0.. (NCCL refuses two ranks on one GPU); use cluster.nodes=1 "
            "(cluster.gpus_per_node up to the device count), cluster=slurm, or cluster.device=cpu"
        )


def plan_inputs(cfg: Any) -> tuple[Any, list[int]]:
    """Templates for the cluster and the per-layer parameter bytes (for transfer planning)."""
    from oobleck.planning.profile import ClusterSpec
    from oobleck.planning.templates import generate_templates
    from oobleck.profiling import get_profile

    profile = get_profile(cfg)
    templates = generate_templates(
        profile,
        ClusterSpec.from_config(cfg.cluster),
        int(cfg.job.fault_tolerance),
        reference_microbatches_per_stage=int(cfg.planner.reference_microbatches_per_stage),
        max_gpus_per_stage=cfg.planner.max_gpus_per_stage,
    )
    return templates, [layer.param_bytes for layer in profile.layers]


def launch(
    cfg: Any,
    run_dir: str | Path,
    *,
    initial_plan: Optional[ExecutionPlan] = None,
    templates: Any = None,
    layer_param_bytes: Optional[list[int]] = None,
    recorder: bool = True,
) -> tuple[Outcome, dict[str, Any]]:
    """Run the job; returns what happened and the summary. Raises ``RunError`` if it had to stop
    (after writing the summary of what it did)."""
    validate(cfg)
    check_strategy(cfg)
    check_device(cfg)
    schedule = build_schedule(cfg.failures, nodes=int(cfg.cluster.nodes), steps=int(cfg.job.steps))
    if templates is None and (initial_plan is None or schedule):
        templates, layer_param_bytes = plan_inputs(cfg)
    config_dict = to_container(cfg)
    run_dir = Path(run_dir)
    rec = None
    if recorder:
        from oobleck.metrics import RunRecorder

        rec = RunRecorder(
            run_dir,
            config_dict,
            total_steps=int(cfg.job.steps),
            strategy=str(cfg.strategy.name),
            wandb=cfg.logger.wandb,
            progress_bar=bool(cfg.logger.progress_bar),
        )
    controller = Controller(
        cfg,
        config_dict,
        recorder=rec,
        templates=templates,
        initial_plan=initial_plan,
        schedule=schedule,
        layer_param_bytes=layer_param_bytes,
    )
    try:
        outcome = controller.run()
    except OobleckError:
        if rec is not None:
            rec.finish(**summarize(controller.outcome, cfg))
        raise
    summary = summarize(outcome, cfg)
    if cfg.runtime.save_final_params:
        save_final_params(controller, run_dir / "final_params.pt")
    if rec is not None:
        rec.write_json("probes.json", {str(g): {str(r): p for r, p in ranks.items()} for g, ranks in outcome.probes.items()})
        summary = rec.finish(**summary)
    return outcome, summary


def save_final_params(controller: Controller, path: Path) -> None:
    """Collect each layer's final parameters (published by one holder) into one file."""
    import torch

    from oobleck.runtime import keys

    plan = controller.plans[controller.generation]
    state: dict[str, Any] = {}
    for layer in range(plan.num_layers):
        key = keys.final_params(layer)
        controller_store = controller.store
        if not controller_store.check([key]):
            raise RunError(f"layer {layer}'s final parameters were not published")
        state[str(layer)] = torch.load(io.BytesIO(controller_store.get(key)), weights_only=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)

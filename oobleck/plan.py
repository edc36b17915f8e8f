"""``python -m oobleck.plan``: print the pipeline templates and the chosen plan, write plan.json.

A Hydra app over the project's config tree. The profile comes from ``oobleck.profiling.get_profile``
(``profile.source=file|measured|analytic|auto``; a measurement shows a progress bar and is refused
up front when it would not fit this device or take too long). Each planning phase says what it
does and how long it took. Bad input prints one line and exits with 2; what was printed is also
in ``<run dir>/plan.log``. Installed, the command is ``oobleck-plan``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import hydra
from omegaconf import DictConfig

from oobleck.cli import entry, run_app
from oobleck.config import CONF_DIR, register_configs, to_container, validate
from oobleck.planning.inputs import ClusterSpec, ModelProfile
from oobleck.planning.instantiate import instantiate
from oobleck.planning.outputs import ExecutionPlan
from oobleck.planning.reconfigure import check_fault_tolerance
from oobleck.planning.templates import TemplateProgress, TemplateSet, generate_templates

PROGRAM = "oobleck.plan"


def _layers(stages: Any) -> str:
    return " ".join(f"{s.start}-{s.end - 1}" if s.end - s.start > 1 else f"{s.start}" for s in stages)


def templates_table(templates: TemplateSet) -> str:
    rows = [
        f"{'nodes':>5}  {'stages':>6}  {'iter s (m=' + 'r*S)':>14}  {'GB/GPU':>7}  layers per stage | GPUs per stage"
    ]
    for n, t in sorted(templates.templates.items()):
        gpus = " ".join(str(s.gpus) for s in t.stages)
        rows.append(
            f"{n:>5}  {t.num_stages:>6}  {t.reference_iteration_s:>14.4f}  {max(t.stage_memory_bytes) / 1e9:>7.2f}  "
            f"{_layers(t.stages)} | {gpus}"
        )
    return "\n".join(rows)


def plan_table(plan: ExecutionPlan) -> str:
    rows = [f"{'pipeline':>8}  {'nodes':<24}  {'stages':>6}  {'microbatches':>12}  {'iter s':>9}"]
    for p in plan.pipelines:
        nodes = ",".join(str(n) for n in p.nodes)
        rows.append(
            f"{p.index:>8}  {nodes:<24}  {p.template.num_stages:>6}  {p.microbatches:>12}  {p.predicted_iteration_s:>9.4f}"
        )
    rows.append(
        f"predicted iteration {plan.predicted_iteration_s:.4f} s (with gradient sync), "
        f"{plan.predicted_samples_per_s:.2f} samples/s, {len(plan.pipelines)} pipelines, "
        f"{plan.num_microbatches} microbatches of {plan.microbatch_size}"
    )
    return "\n".join(rows)


def make_plan(
    cfg: DictConfig, profile: ModelProfile, *, say: Callable[[str], None] | None = None
) -> tuple[TemplateSet, ExecutionPlan, float]:
    """Templates and the initial plan for ``cfg`` (no I/O), and the planning time in seconds.
    ``say`` gets one line as each phase starts and ends (what it does, how long it took)."""
    say = say or (lambda line: None)
    cluster = ClusterSpec.from_config(cfg.cluster)
    f = int(cfg.job.fault_tolerance)
    started = time.perf_counter()
    say(
        f"planning: templates of {profile.num_layers} layers for up to {cluster.nodes} nodes of "
        f"{cluster.gpus_per_node} devices ({cluster.device_memory_bytes / 1e9:.4g} GB each), f={f} ..."
    )
    every = float(cfg.planner.progress_every_s)
    last = [started]

    def progress(at: TemplateProgress) -> None:
        now = time.perf_counter()
        if now - last[0] >= every:
            last[0] = now
            say(
                f"planning: templates: {at.settled} of {at.node_counts} node counts settled, candidate bottleneck "
                f"{at.threshold} of {at.thresholds}, {now - started:.1f} s ..."
            )

    templates = generate_templates(
        profile,
        cluster,
        f,
        reference_microbatches_per_stage=int(cfg.planner.reference_microbatches_per_stage),
        max_gpus_per_stage=cfg.planner.max_gpus_per_stage,
        progress=progress,
    )
    check_fault_tolerance(templates, cluster.nodes, f)
    generated = time.perf_counter()
    say(
        f"planning: {len(templates.templates)} templates ({templates.min_nodes}..{templates.max_nodes} nodes) in {generated - started:.2f} s; instantiating ..."
    )
    plan = instantiate(templates, range(cluster.nodes), int(cfg.job.global_batch_size), int(cfg.job.microbatch_size), f)
    say(
        f"planning: {len(plan.pipelines)} pipelines over {cluster.nodes} nodes in {time.perf_counter() - generated:.2f} s"
    )
    return templates, plan, time.perf_counter() - started


def plan_document(
    cfg: DictConfig, profile: ModelProfile, templates: TemplateSet, plan: ExecutionPlan
) -> dict[str, Any]:
    """What plan.json holds: the config, the profile's identity, the templates and the plan."""
    return {
        "config": to_container(cfg),
        "profile": {
            "model": profile.model,
            "source": profile.source,
            "device": profile.device,
            "num_layers": profile.num_layers,
            "microbatch_size": profile.microbatch_size,
            "param_bytes": profile.param_bytes,
        },
        "templates": templates.to_dict(),
        "plan": plan.to_dict(),
        "predicted_iteration_s": plan.predicted_iteration_s,
        "predicted_samples_per_s": plan.predicted_samples_per_s,
    }


register_configs()  # before @hydra.main composes: conf/config.yaml starts from the schema


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with entry(PROGRAM) as run_dir:
        validate(cfg)
        from oobleck.profiling import get_profile  # imports torch: only after the config is valid

        profile = get_profile(cfg)
        templates, plan, seconds = make_plan(cfg, profile, say=lambda line: print(line, file=sys.stderr, flush=True))
        path = run_dir / "plan.json"
        path.write_text(json.dumps(plan_document(cfg, profile, templates, plan), indent=1))
        print(
            f"{profile.model}: {profile.num_layers} layers ({profile.source} profile), "
            f"{cfg.cluster.nodes} nodes x {cfg.cluster.gpus_per_node} GPUs, f={cfg.job.fault_tolerance}, "
            f"n0={templates.min_nodes}; planned in {seconds:.2f} s"
        )
        print("\nTemplates")
        print(templates_table(templates))
        print("\nPlan")
        print(plan_table(plan))
        print(f"\nwrote {path}")


def cli() -> None:
    """The ``oobleck-plan`` command."""
    run_app(main, PROGRAM)


if __name__ == "__main__":
    cli()

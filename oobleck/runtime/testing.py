"""Small configs and hand-built plans for tests and benchmarks of the runtime.

``tiny_config`` is gpt3_tiny with a short job, wandb off and final parameters collected;
``template``/``hand_plan`` build an ``ExecutionPlan`` directly (no planner), so a test can run any
layout: heterogeneous pipelines, sharded stages, a single deep pipeline, pure data parallelism.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from oobleck.config import Config
from oobleck.planning.plan import ExecutionPlan, PipelineInstance, PipelineTemplate, StageSpec

CONF = Path(__file__).resolve().parents[2] / "conf"  # the repository's Hydra config tree


def tiny_config(**overrides):
    cfg = OmegaConf.structured(Config)
    cfg.model = OmegaConf.merge(cfg.model, OmegaConf.load(CONF / "model" / "gpt3_tiny.yaml"))
    cfg.job.steps = 4
    cfg.job.global_batch_size = 16
    cfg.job.microbatch_size = 2
    cfg.job.warmup_steps = 2
    cfg.logger.wandb.mode = "disabled"
    cfg.logger.progress_bar = False
    cfg.runtime.save_final_params = True
    cfg.cluster.heartbeat_timeout_s = 5.0
    cfg.cluster.collective_timeout_s = 20.0
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=True)
    return cfg


def template(stages: list[tuple[int, int, int, int, int]]) -> PipelineTemplate:
    """stages: (start, end, node position, gpu offset, gpus)."""
    specs = tuple(StageSpec(*s) for s in stages)
    num_nodes = max(s.node for s in specs) + 1
    return PipelineTemplate(num_nodes, specs, tuple(1.0 for _ in specs), tuple(0.0 for _ in specs), 4 * len(specs), 1.0)


def hand_plan(pipelines: list[tuple[PipelineTemplate, tuple[int, ...], int]], *, batch: int, micro: int, layers: int, f: int, gpus: int) -> ExecutionPlan:
    """pipelines: (template, node ids, microbatches); offsets are contiguous in order."""
    instances, first = [], 0
    for index, (tmpl, nodes, mbs) in enumerate(pipelines):
        instances.append(PipelineInstance(index, tmpl, nodes, mbs, first, 1.0))
        first += mbs
    if first != batch // micro:
        raise ValueError(f"pipelines take {first} microbatches but the batch has {batch // micro}")
    return ExecutionPlan(tuple(instances), layers, batch, micro, f, gpus, 1.0)

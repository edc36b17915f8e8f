"""Small configs and hand-built plans for tests and benchmarks of the runtime.

``tiny_config`` is the command line's config (composed from conf/ by Hydra, so tests start from
the same defaults as ``python -m oobleck.run``) with gpt3_tiny, a short job, no failures, wandb
off and final parameters collected; ``config_section`` one section of those defaults;
``template``/``hand_plan`` build an ``ExecutionPlan`` directly (no planner), so a test can run any
layout: heterogeneous pipelines, sharded stages, a single deep pipeline, pure data parallelism.
``assert_matches_reference`` is the exactness check every real-run test ends with;
``tcp_states`` reads this host's TCP sockets on a port (listening, CLOSE-WAIT) from /proc.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from oobleck.config import compose_config
from oobleck.planning.outputs import ExecutionPlan, PipelineInstance, PipelineTemplate, StageSpec


@functools.lru_cache(maxsize=1)
def _default_config() -> Any:
    return compose_config()


def config_section(section: str, **values: Any) -> Any:
    """A section of the command line's default config (e.g. ``"job"``, ``"failures"``) with
    ``values`` merged in: the YAML's values, typed by the schema, without composing a whole run."""
    return OmegaConf.merge(_default_config()[section], values)


def tiny_config(*groups: str, **overrides: Any) -> Any:
    """gpt3_tiny with a 4-step job; ``groups`` are config-group choices (e.g. ``"strategy=varuna"``),
    ``overrides`` dotted keys (``**{"cluster.nodes": 6}``)."""
    cfg = compose_config("model=gpt3_tiny", "failures=none", *groups)
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


def hand_plan(
    pipelines: list[tuple[PipelineTemplate, tuple[int, ...], int]],
    *,
    batch: int,
    micro: int,
    layers: int,
    f: int,
    gpus: int,
) -> ExecutionPlan:
    """pipelines: (template, node ids, microbatches); offsets are contiguous in order."""
    instances, first = [], 0
    for index, (tmpl, nodes, mbs) in enumerate(pipelines):
        instances.append(PipelineInstance(index, tmpl, nodes, mbs, first, 1.0))
        first += mbs
    if first != batch // micro:
        raise ValueError(f"pipelines take {first} microbatches but the batch has {batch // micro}")
    return ExecutionPlan(tuple(instances), layers, batch, micro, f, gpus, 1.0)


def two_pipelines_of_two_nodes() -> ExecutionPlan:
    """gpt3_tiny's 6 layers as two 2-node pipelines (layers 0-2 on nodes 0 and 2, 3-5 on nodes 1
    and 3), 4 microbatches each of tiny_config's batch: losing nodes 0 and 2 loses layers 0-2."""
    two_stages = template([(0, 3, 0, 0, 1), (3, 6, 1, 0, 1)])
    return hand_plan([(two_stages, (0, 1), 4), (two_stages, (2, 3), 4)], batch=16, micro=2, layers=6, f=1, gpus=1)


def assert_matches_reference(
    cfg: Any, outcome: Any, run_dir: Path, reference: Any = None, *, loss_rtol: float = 1e-5, param_atol: float = 1e-5
) -> float:
    """A real run committed steps 0..steps-1 once each, and its losses and final parameters equal
    single-process training on the same batches (``train_reference``, computed unless given).
    The default tolerances are justified in tests/runtime/test_exactness.py. Returns the largest
    parameter difference."""
    import torch

    from oobleck.runtime.reference import train_reference

    reference = reference if reference is not None else train_reference(cfg)
    steps = [row["step"] for row in outcome.steps]
    assert steps == list(range(int(cfg.job.steps))), f"committed steps {steps}: some were skipped or repeated"
    for step, (row, expected) in enumerate(zip(outcome.steps, reference.losses)):
        assert math.isclose(row["loss"], expected, rel_tol=loss_rtol), f"step {step}: loss {row['loss']} vs {expected}"
    final = torch.load(Path(run_dir) / "final_params.pt", weights_only=True)
    worst = 0.0
    for layer, state in reference.layers.items():
        for name, value in state.items():
            worst = max(worst, float((final[str(layer)][name] - value).abs().max()))
    assert worst <= param_atol, f"largest parameter difference {worst} (tolerance {param_atol})"
    return worst


# /proc/net/tcp's state codes (include/net/tcp_states.h)
TCP_STATES = {"01": "ESTABLISHED", "06": "TIME_WAIT", "08": "CLOSE_WAIT", "0A": "LISTEN"}


def tcp_states(port: int) -> list[str]:
    """The states of this host's TCP sockets whose local port is ``port`` (IPv4 and IPv6)."""
    states = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                states.append(TCP_STATES.get(fields[3], fields[3]))
    return states

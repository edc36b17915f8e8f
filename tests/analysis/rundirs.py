"""Hand-written run dirs in the runtime's format (metrics.csv, events.csv, summary.json,
.hydra/config.yaml) for strategies the runtime cannot run here yet: a Varuna-style restart from
a checkpoint that rolls back three steps, under the same failure schedule as a real run."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from oobleck.config import to_container
from testing import tiny_config


def write_restart_run(
    path: Path, *, strategy: str = "varuna", nodes: int = 4, steps: int = 10, fail_step: int = 4
) -> Path:
    """A run that checkpoints every 3 steps, loses a node at ``fail_step``, restarts from the last
    checkpoint (redoing the steps since) on ``nodes - 1`` nodes and finishes ``steps`` steps."""
    cfg = tiny_config(
        **{
            "strategy.name": strategy,
            "cluster.nodes": nodes,
            "job.steps": steps,
            "failures.kind": "explicit",
            "failures.events": [{"action": "remove", "step": fail_step, "count": 1}],
        }
    )
    (path / ".hydra").mkdir(parents=True, exist_ok=True)
    (path / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(to_container(cfg))))
    batch, step_s, restart = (
        16,
        0.1,
        {
            "detect_s": 0.01,
            "plan_s": 0.02,
            "stop_s": 0.3,
            "spawn_s": 1.2,
            "groups_s": 0.1,
            "load_s": 0.2,
            "first_step_s": 0.15,
        },
    )
    checkpoint_every, resume = 3, (fail_step // 3) * 3
    rows, events, t = [], [], 5.0
    for step in range(fail_step):
        t += step_s
        rows.append(
            {
                "step": step,
                "time_s": t,
                "samples": batch,
                "samples_per_s": batch / step_s,
                "loss": 5.0 - 0.01 * step,
                "generation": 0,
                "pipelines": nodes,
                "attempts": 1,
                "strategy": strategy,
                "step_time_s": step_s,
                "nodes": nodes,
            }
        )
        if (step + 1) % checkpoint_every == 0:
            events.append(
                {
                    "time_s": t + 0.01,
                    "kind": "checkpoint",
                    "generation": 0,
                    "step": step,
                    "bytes": 1_000_000,
                    "snapshot_s": 0.02,
                    "write_s": 0.3,
                    "path": f"checkpoints/step{step}",
                }
            )
    events.append({"time_s": t + 0.05, "kind": "fault_injected", "step": fail_step, "nodes": "[1]"})
    total = sum(restart.values()) + 0.05
    failure_t = t + 0.05
    t = failure_t + total - restart["first_step_s"]
    for step in range(resume, steps):
        t += restart["first_step_s"] if step == resume else step_s
        seconds = restart["first_step_s"] if step == resume else step_s
        rows.append(
            {
                "step": step,
                "time_s": t,
                "samples": batch,
                "samples_per_s": batch / seconds,
                "loss": 5.0 - 0.01 * step,
                "generation": 1,
                "pipelines": nodes - 1,
                "attempts": 2 if step < fail_step else 1,
                "strategy": strategy,
                "step_time_s": seconds,
                "nodes": nodes - 1,
            }
        )
        if step == resume:
            events.append(
                {
                    "time_s": t,
                    "kind": "restart",
                    "generation": 1,
                    "removed": "[1]",
                    "joined": "[]",
                    "resume_step": resume,
                    "rolled_back_steps": fail_step - resume,
                    **restart,
                    "total_s": round(t - failure_t, 4),
                }
            )
    pd.DataFrame(rows).to_csv(path / "metrics.csv", index=False)
    pd.DataFrame(events).to_csv(path / "events.csv", index=False)
    (path / "summary.json").write_text(
        json.dumps({"steps": len(rows), "samples": batch * len(rows), "strategy": strategy})
    )
    return path

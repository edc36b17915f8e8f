"""When to checkpoint: every ``checkpoint.every_steps`` committed steps and/or ``every_s`` seconds.

Step-based checkpoints fall on multiples of ``every_steps`` of the committed-step count, so a
resumed run checkpoints at the same steps as an uninterrupted one. Time-based ones are due once
``every_s`` seconds have passed since the last checkpoint (or the start); the controller decides
and tells every worker the step, since only one clock may decide. Torch-free.
"""

from __future__ import annotations

from typing import Any


def checkpoints_enabled(checkpoint_cfg: Any) -> bool:
    return int(checkpoint_cfg.every_steps) > 0 or checkpoint_cfg.every_s is not None


def checkpoint_due(checkpoint_cfg: Any, committed_steps: int, seconds_since_last: float) -> bool:
    """Whether to checkpoint now, after ``committed_steps`` steps have been committed."""
    if committed_steps <= 0:
        return False
    every_steps = int(checkpoint_cfg.every_steps)
    if every_steps > 0 and committed_steps % every_steps == 0:
        return True
    every_s = checkpoint_cfg.every_s
    return every_s is not None and seconds_since_last >= float(every_s)

"""Where a checkpoint lives on disk: the names of its directory, shards and manifest.

    <checkpoint dir>/step-<NNNNNNNN>/layer-<LLLL>.shard   one per layer, any writer
                                    /manifest.json        written last, by the controller

``NNNNNNNN`` is the number of committed steps (the step to resume at), so lexical and numeric
order agree. ``<checkpoint dir>`` is ``checkpoint.dir``, or ``<run dir>/checkpoints`` when unset.
Torch-free.
"""

from __future__ import annotations

import re
from pathlib import Path

MANIFEST_NAME = "manifest.json"
STEP_PREFIX = "step-"
STEP_DIGITS = 8
SHARD_PREFIX = "layer-"
SHARD_SUFFIX = ".shard"
LAYER_DIGITS = 4
DEFAULT_SUBDIR = "checkpoints"  # under the run dir when checkpoint.dir is unset

_STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d{{{STEP_DIGITS}}})$")


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"a checkpoint step is a count of committed steps, >= 0; got {step}")
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def step_dir(checkpoint_dir: Path | str, step: int) -> Path:
    return Path(checkpoint_dir) / step_dir_name(step)


def step_of(path: Path | str) -> int | None:
    """The step a ``step-NNNNNNNN`` directory holds, or None for any other name."""
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def shard_name(layer: int) -> str:
    return f"{SHARD_PREFIX}{layer:0{LAYER_DIGITS}d}{SHARD_SUFFIX}"


def checkpoint_root(configured: Path | str | None, run_dir: Path | str) -> Path:
    """The checkpoint dir: ``configured`` (``checkpoint.dir``), or ``<run dir>/checkpoints`` when unset."""
    return Path(configured) if configured else Path(run_dir) / DEFAULT_SUBDIR

"""Which checkpoint a run resumes from: ``job.resume`` = null (none), ``auto``, or a path.

- ``null`` (the default): a fresh start.
- ``auto``: the newest valid checkpoint under ``checkpoint.dir`` (or ``<run dir>/checkpoints``);
  none there is a fresh start, so a requeued job and a first launch use the same command line.
- a path: a step directory (``.../step-NNNNNNNN``) or a checkpoint directory (its newest valid
  checkpoint). A path that does not exist or holds no valid checkpoint is a ``ConfigError``.

Corrupt or partial newer checkpoints are passed over and listed in ``Checkpoint.skipped`` (and
logged). With a fingerprint to check against, a checkpoint of a different setup is an error.
Torch-free.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from oobleck.checkpoint.catalog import Checkpoint, find_latest, verify
from oobleck.checkpoint.fingerprint import check_fingerprint, fingerprint
from oobleck.checkpoint.layout import MANIFEST_NAME, checkpoint_root, step_of
from oobleck.checkpoint.manifest import read_manifest
from oobleck.errors import ConfigError

log = logging.getLogger(__name__)
AUTO = "auto"


def _explicit(resume: str, threads: int) -> Checkpoint:
    path = Path(resume).expanduser()
    key = f"job.resume={resume!r}"
    if not path.exists():
        raise ConfigError(
            f"{key}: {path} does not exist; give a checkpoint step dir (.../step-NNNNNNNN) or checkpoint dir, {AUTO}, or null"
        )
    if step_of(path) is not None or (path / MANIFEST_NAME).exists():
        problems = verify(path, threads=threads)
        if problems:
            raise ConfigError(
                f"{key}: {path} is not a valid checkpoint: {'; '.join(problems)}. "
                "Give an older step dir, or the checkpoint dir to use its newest valid checkpoint"
            )
        return Checkpoint(step_dir=path, manifest=read_manifest(path))
    search = find_latest(path, threads=threads)
    if search.found is None:
        why = "; ".join(s.describe() for s in search.skipped) or "it holds no step-NNNNNNNN directories"
        raise ConfigError(f"{key}: {path} holds no valid checkpoint ({why}); give another path, {AUTO}, or null")
    return search.found


def resolve_resume(
    resume: str | None,
    run_dir: Path | str,
    checkpoint_dir: Path | str | None = None,
    *,
    expected_fingerprint: dict[str, Any] | None = None,
    threads: int = 1,
) -> Checkpoint | None:
    """The checkpoint to resume from (None: start fresh); see the module docstring. ``threads``
    check the shards' checksums in parallel."""
    if resume is None:
        return None
    if resume == AUTO:
        search = find_latest(checkpoint_root(checkpoint_dir, run_dir), threads=threads)
        found, skipped = search.found, search.skipped
    else:
        found = _explicit(resume, threads)
        skipped = found.skipped
    for entry in skipped:
        log.warning("%s", entry.describe())
    if found is not None and expected_fingerprint is not None:
        check_fingerprint(found.manifest.fingerprint, expected_fingerprint, source=found.step_dir)
    return found


def resume_checkpoint(cfg: Any, run_dir: Path | str) -> Checkpoint | None:
    """``resolve_resume`` for a whole config: ``job.resume``, ``checkpoint.dir`` and the fingerprint."""
    return resolve_resume(
        cfg.job.resume,
        run_dir,
        cfg.checkpoint.dir,
        expected_fingerprint=fingerprint(cfg),
        threads=int(cfg.checkpoint.io_threads),
    )

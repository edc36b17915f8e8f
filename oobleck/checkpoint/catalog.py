"""The checkpoints in a directory: which exist, which are valid, which to resume from, which to drop.

A checkpoint is valid when its manifest parses and every shard it names is present with the
recorded size and CRC32. ``latest_valid`` verifies the newest and falls back to older ones,
saying what it skipped and why; ``prune`` applies retention without ever touching the newest
complete checkpoint or a newer one that may still be being written. Torch-free.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from oobleck.checkpoint.durable import (
    file_crc32,
    make_dirs,
    remove_file_durably,
    remove_temporaries,
    remove_tree_durably,
)
from oobleck.checkpoint.layout import MANIFEST_NAME, step_dir, step_of
from oobleck.checkpoint.manifest import Manifest, ShardRecord, read_manifest
from oobleck.errors import CheckpointError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepDir:
    """A ``step-NNNNNNNN`` directory, complete or not."""

    step: int
    path: Path

    @property
    def has_manifest(self) -> bool:
        return (self.path / MANIFEST_NAME).is_file()


@dataclass(frozen=True)
class Skipped:
    """A newer checkpoint passed over, and why."""

    step_dir: Path
    problems: tuple[str, ...]

    def describe(self) -> str:
        return f"skipped {self.step_dir}: " + "; ".join(self.problems)


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint; ``skipped`` lists the newer ones that were not valid."""

    step_dir: Path
    manifest: Manifest
    skipped: tuple[Skipped, ...] = ()

    @property
    def step(self) -> int:
        return self.manifest.step


@dataclass(frozen=True)
class Search:
    """What ``find_latest`` saw: the newest valid checkpoint (if any) and everything newer it skipped."""

    found: Checkpoint | None
    skipped: tuple[Skipped, ...]


def list_checkpoints(checkpoint_dir: Path | str) -> list[StepDir]:
    """Every step directory under ``checkpoint_dir`` (complete or not), oldest first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = [
        StepDir(step, entry) for entry in root.iterdir() if entry.is_dir() and (step := step_of(entry)) is not None
    ]
    return sorted(found, key=lambda entry: entry.step)


def _shard_problem(step_dir: Path, record: ShardRecord, checksums: bool) -> str | None:
    path = step_dir / record.file
    if not path.is_file():
        return f"{record.file} (layer {record.layer}) is missing"
    size = path.stat().st_size
    if size != record.bytes:
        return f"{record.file} (layer {record.layer}) is {size} bytes, the manifest says {record.bytes}"
    if checksums:
        _, crc = file_crc32(path)
        if crc != record.crc32:
            return f"{record.file} (layer {record.layer}) fails its checksum: crc32 {crc:#010x}, the manifest says {record.crc32:#010x}"
    return None


def verify(step_dir: Path | str, *, checksums: bool = True, threads: int = 1) -> list[str]:
    """Problems that make ``step_dir`` an invalid checkpoint; ``[]`` when it is valid.

    Checks the manifest (present, parseable, consistent) and every shard it names (present, the
    recorded size, and with ``checksums`` the recorded CRC32, which reads every byte, on
    ``threads`` threads: zlib and file reads release the GIL).
    """
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        return [f"{step_dir} is not a directory"]
    try:
        manifest = read_manifest(step_dir)
    except CheckpointError as error:
        return [str(error)]
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        problems = pool.map(lambda record: _shard_problem(step_dir, record, checksums), manifest.shards)
        return [problem for problem in problems if problem is not None]


def find_latest(checkpoint_dir: Path | str, *, checksums: bool = True, threads: int = 1) -> Search:
    """The newest valid checkpoint under ``checkpoint_dir``, trying older ones when newer are invalid."""
    skipped: list[Skipped] = []
    for entry in reversed(list_checkpoints(checkpoint_dir)):
        problems = verify(entry.path, checksums=checksums, threads=threads)
        if not problems:
            found = Checkpoint(step_dir=entry.path, manifest=read_manifest(entry.path), skipped=tuple(skipped))
            return Search(found=found, skipped=tuple(skipped))
        skipped.append(Skipped(step_dir=entry.path, problems=tuple(problems)))
    return Search(found=None, skipped=tuple(skipped))


def latest_valid(checkpoint_dir: Path | str, *, checksums: bool = True, threads: int = 1) -> Checkpoint | None:
    """``find_latest(...).found``, logging a warning for every checkpoint it skipped."""
    search = find_latest(checkpoint_dir, checksums=checksums, threads=threads)
    for skipped in search.skipped:
        log.warning("%s", skipped.describe())
    return search.found


def prepare_step_dir(checkpoint_dir: Path | str, step: int) -> Path:
    """Create ``step``'s directory (durably) before any shard of it is written, and return it.

    If the step was checkpointed before (a run that resumed from an older checkpoint reaches it
    again), its manifest is removed first, so the directory is not a checkpoint until the new
    manifest is written; leftovers of interrupted writes are cleared. The controller calls this
    once per checkpoint, before asking workers to write (it would remove their in-flight files).
    """
    path = step_dir(checkpoint_dir, step)
    make_dirs(path)
    old = path / MANIFEST_NAME
    if old.exists():
        remove_file_durably(old)
    remove_temporaries(path)
    return path


def prune(checkpoint_dir: Path | str, keep: int, protect: Iterable[int] = ()) -> list[Path]:
    """Retention: keep the newest ``keep`` complete checkpoints; return the directories removed.

    Complete means: the manifest parses and every shard has its recorded size (checksums are not
    read here; ``latest_valid`` checks them on resume). Also removed: incomplete step dirs older
    than the newest complete one (abandoned writes). Never removed: the newest complete
    checkpoint, anything newer than it (a checkpoint whose write may be in progress), and the
    steps in ``protect`` (checkpoints a decision still refers to: workers may be loading them).
    """
    protected = set(protect)
    if keep < 1:
        raise CheckpointError(f"checkpoint.keep={keep} must be >= 1: the newest complete checkpoint is always kept")
    root = Path(checkpoint_dir)
    entries = list_checkpoints(root)
    complete = [entry for entry in entries if not verify(entry.path, checksums=False)]
    if not complete:
        return []
    kept = {entry.step for entry in complete[-keep:]}
    newest = complete[-1].step
    complete_steps = {entry.step for entry in complete}
    doomed = [
        entry.path
        for entry in entries
        if entry.step not in protected
        and (
            (entry.step in complete_steps and entry.step not in kept)
            or (entry.step not in complete_steps and entry.step < newest)
        )
    ]
    for path in doomed:
        remove_tree_durably(path)
    remove_temporaries(root)  # directories a killed prune had renamed but not yet deleted
    return doomed

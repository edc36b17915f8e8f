"""Read an offline wandb run back from its ``run-<id>.wandb`` file, without a server.

The installed wandb (0.31) no longer ships a Python reader for its transaction log (older releases
had ``wandb.sdk.internal.datastore``); the file keeps the same layout: a 7-byte header (``:W&B``,
magic 0xBEE1 little-endian, version 0) followed by the LevelDB log format (32 KiB blocks; each
chunk has a CRC-32 of its type byte and payload, a 2-byte length and a type: full, first, middle,
last), each record a ``wandb.proto.wandb_internal_pb2.Record``. ``read_offline_run`` folds those
records into what a dashboard would show: identity (name, group, job type, tags), config,
history rows, the final summary, metric definitions, tables and artifacts. Tests use it to check
what a run really holds rather than trusting the calls that wrote it; ``wandb sync`` uploads the
same file.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oobleck.errors import RunError

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
CHUNK_HEADER = 7  # crc32 (4 bytes), length (2), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
ARTIFACT_SCHEME = "wandb-client-artifact://"
POLL_S = 0.05  # how often a reader waiting for a run to finish looks at its file again


@dataclass(frozen=True)
class OfflineArtifact:
    name: str
    type: str
    files: dict[str, str]  # path inside the artifact -> where its bytes are staged locally
    client_id: str = ""  # what history rows refer to (``wandb-client-artifact://<client_id>/...``)


@dataclass(frozen=True)
class OfflineMetric:
    name: str  # or a glob such as ``train/*``
    step_metric: str


@dataclass
class OfflineRun:
    """What one offline run file holds (a resumed run continues in a new file with the same id)."""

    path: Path
    run_id: str = ""
    project: str = ""
    name: str = ""
    group: str = ""
    job_type: str = ""
    tags: tuple[str, ...] = ()
    resume: bool = False  # started with a resume mode (resume="allow"): continues its id if it exists
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    metrics: list[OfflineMetric] = field(default_factory=list)
    artifacts: list[OfflineArtifact] = field(default_factory=list)

    def artifact(self, type_: str) -> OfflineArtifact:
        found = [a for a in self.artifacts if a.type == type_]
        if not found:
            raise RunError(
                f"{self.path}: no artifact of type {type_!r} (has {sorted({a.type for a in self.artifacts})})"
            )
        return found[-1]

    def table(self, key: str) -> dict[str, Any]:
        """The wandb Table logged under ``key`` as wandb stored it (columns, data, column_types)."""
        for row in reversed(self.history):
            value = row.get(key)
            if isinstance(value, dict) and value.get("_type") == "table-file":
                # The staged artifact copy carries the column types; files/media/ has the data only.
                client, _, name = str(value.get("artifact_path", "")).removeprefix(ARTIFACT_SCHEME).partition("/")
                for artifact in self.artifacts:
                    if artifact.client_id == client and name in artifact.files:
                        return json.loads(Path(artifact.files[name]).read_text())
                raise RunError(f"{self.path}: table {key!r} has no staged artifact ({value.get('artifact_path')})")
        raise RunError(f"{self.path}: no table logged under {key!r}")

    def column(self, key: str) -> list[Any]:
        """Every history value of ``key``, in logging order (rows without it are skipped)."""
        return [row[key] for row in self.history if key in row]


def _records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    if not data.startswith(HEADER):
        raise RunError(f"{path}: not a wandb run file (header {data[:7]!r})")
    pos, pending = len(HEADER), b""
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # the tail of a block too short for a header is zero padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        if crc == 0 and length == 0 and kind == 0:
            break  # preallocated, never written
        payload = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        if zlib.crc32(bytes([kind]) + payload) & 0xFFFFFFFF != crc:
            raise RunError(f"{path}: corrupt record at byte {pos} (checksum mismatch)")
        pos += CHUNK_HEADER + length
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            yield pending + payload
            pending = b""
        else:
            raise RunError(f"{path}: unknown chunk type {kind} at byte {pos}")


def _set(target: dict[str, Any], item: Any) -> None:
    keys = list(item.nested_key) or [item.key]
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = json.loads(item.value_json)


def _config(updates: Any, into: dict[str, Any]) -> None:
    for item in updates:
        _set(into, item)
    into.pop("_wandb", None)


def read_offline_run(path: str | Path, *, complete_within_s: float = 0.0) -> OfflineRun:
    """Read ``offline-run-*/`` (or the ``.wandb`` file in it).

    wandb's service writes the file asynchronously: ``run.finish()`` can return before the last
    records (or even the first) are on disk. ``complete_within_s`` > 0 waits, at most that long,
    until the file holds the run's exit record, and raises ``RunError`` if it never does.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.wandb"))
        if len(files) != 1:
            raise RunError(f"{path}: expected one .wandb file, found {len(files)}")
        path = files[0]
    deadline = time.monotonic() + complete_within_s
    while True:
        try:
            run, finished = _read(path)
        except RunError:
            if time.monotonic() >= deadline:
                raise
            finished = False
        if finished or time.monotonic() >= deadline:
            if complete_within_s > 0 and not finished:
                raise RunError(f"{path}: no exit record after {complete_within_s:g} s (the run did not finish)")
            return run
        time.sleep(POLL_S)


def _read(path: Path) -> tuple[OfflineRun, bool]:
    from wandb.proto import wandb_internal_pb2 as pb

    finished = False
    run = OfflineRun(path=path)
    for payload in _records(path):
        # protobuf builds the message classes when the module loads; wandb ships no stub for them.
        record = pb.Record()  # type: ignore[attr-defined]
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.run_id, run.project, run.name = r.run_id, r.project, r.display_name
            run.group, run.job_type, run.tags = r.run_group, r.job_type, tuple(r.tags)
            run.resume = bool(r.resume)
            _config(r.config.update, run.config)
        elif kind == "config":
            _config(record.config.update, run.config)
        elif kind == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                _set(row, item)
            run.history.append(row)
        elif kind == "summary":
            for item in record.summary.update:
                _set(run.summary, item)
        elif kind == "metric":
            m = record.metric
            run.metrics.append(OfflineMetric(m.name or m.glob_name, m.step_metric))
        elif kind == "artifact":
            a = record.artifact
            files = {entry.path: entry.local_path for entry in a.manifest.contents}
            run.artifacts.append(OfflineArtifact(a.name, a.type, files, a.client_id))
        elif kind == "exit":
            finished = True
    return run, finished


def find_offline_runs(root: str | Path, *, complete_within_s: float = 0.0) -> list[OfflineRun]:
    """Every offline run under ``root`` (a run dir's ``wandb/`` folder or anything above it)."""
    folders = sorted(p for p in Path(root).rglob("offline-run-*") if p.is_dir() and not p.is_symlink())
    return [read_offline_run(p, complete_within_s=complete_within_s) for p in folders]


def private_wandb_dirs(root: str | Path) -> dict[str, str]:
    """Environment that keeps wandb's own folders (artifact staging, cache, settings) under
    ``root`` instead of the home directory: for tests and throwaway runs."""
    root = Path(root)
    return {
        name: str(root / folder)
        for name, folder in (("WANDB_DATA_DIR", "data"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"))
    }

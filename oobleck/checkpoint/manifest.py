"""The manifest: the one file that makes a step directory a checkpoint.

It names every shard with its size and CRC32 (computed while the shard was written), the step to
resume at, the fingerprint of what must match on resume, and a free-form ``extra`` dict (RNG
state, strategy, plan summary: anything JSON-serialisable). The controller writes it durably and
LAST, once every shard has been reported, so a step directory without a complete manifest is not
a checkpoint. Torch-free.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oobleck.checkpoint.durable import durable_write
from oobleck.checkpoint.layout import MANIFEST_NAME, step_of
from oobleck.errors import CheckpointError

FORMAT_VERSION = 1


@dataclass(frozen=True)
class ShardRecord:
    """One written shard: ``file`` (relative to the step dir) holds layer ``layer``."""

    layer: int
    file: str
    bytes: int
    crc32: int

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "file": self.file, "bytes": self.bytes, "crc32": self.crc32}

    @classmethod
    def from_dict(cls, entry: Any, where: str = "a shard record") -> ShardRecord:
        """Parse, with one ``CheckpointError`` naming what is wrong (a record read from the store or
        from a manifest: integers, and a plain file name inside the step dir)."""
        try:
            record = cls(layer=entry["layer"], file=entry["file"], bytes=entry["bytes"], crc32=entry["crc32"])
        except (TypeError, KeyError) as error:
            raise CheckpointError(f"{where} = {entry!r} lacks {error}") from None
        numbers = (record.layer, record.bytes, record.crc32)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
            raise CheckpointError(f"{where} = {entry!r} has a layer, bytes or crc32 that is not an integer >= 0")
        if not isinstance(record.file, str) or not record.file or Path(record.file).name != record.file:
            raise CheckpointError(f"{where}.file={record.file!r} is not a plain file name")
        return record


@dataclass(frozen=True)
class Manifest:
    """A complete checkpoint: ``step`` committed steps, one shard per layer ``0..num_layers-1``."""

    step: int
    num_layers: int
    fingerprint: dict[str, Any]
    shards: tuple[ShardRecord, ...]  # sorted by layer, exactly one per layer
    created: float = field(default_factory=time.time)  # seconds since the epoch
    extra: dict[str, Any] = field(default_factory=dict)
    format: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        layers = [record.layer for record in self.shards]
        if layers != list(range(self.num_layers)):
            missing = sorted(set(range(self.num_layers)) - set(layers))
            repeated = sorted({layer for layer in layers if layers.count(layer) > 1})
            raise CheckpointError(
                f"a manifest of {self.num_layers} layers needs one shard per layer in order; "
                f"missing layers {missing}, repeated layers {repeated}, got {layers}"
            )

    @classmethod
    def build(
        cls,
        step: int,
        fingerprint: Mapping[str, Any],
        records: Iterable[ShardRecord],
        num_layers: int,
        extra: Mapping[str, Any] | None = None,
    ) -> Manifest:
        """From shard records reported in any order (e.g. by several workers)."""
        return cls(
            step=step,
            num_layers=num_layers,
            fingerprint=dict(fingerprint),
            shards=tuple(sorted(records, key=lambda record: record.layer)),
            extra=dict(extra or {}),
        )

    @property
    def total_bytes(self) -> int:
        return sum(record.bytes for record in self.shards)

    def record(self, layer: int) -> ShardRecord:
        if not 0 <= layer < self.num_layers:
            raise CheckpointError(f"layer {layer} is outside 0..{self.num_layers - 1} of this checkpoint")
        return self.shards[layer]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "step": self.step,
            "num_layers": self.num_layers,
            "created": self.created,
            "fingerprint": self.fingerprint,
            "shards": [record.to_dict() for record in self.shards],
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        """Parse, with one ``CheckpointError`` naming the first malformed key."""
        if not isinstance(data, dict):
            raise CheckpointError(f"the manifest is a {type(data).__name__}, not a JSON object")
        if data.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"manifest format {data.get('format')!r} is not the supported {FORMAT_VERSION}")
        expected: dict[str, type | tuple[type, ...]] = {
            "step": int,
            "num_layers": int,
            "created": (int, float),
            "fingerprint": dict,
            "shards": list,
            "extra": dict,
        }
        for key, kind in expected.items():
            if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool):
                raise CheckpointError(
                    f"manifest key {key!r} is {data.get(key)!r}, not a {getattr(kind, '__name__', 'number')}"
                )
        shards = [
            ShardRecord.from_dict(entry, f"manifest shards[{index}]") for index, entry in enumerate(data["shards"])
        ]
        return cls(
            step=data["step"],
            num_layers=data["num_layers"],
            fingerprint=data["fingerprint"],
            shards=tuple(shards),
            created=float(data["created"]),
            extra=data["extra"],
        )


def write_manifest(step_dir: Path | str, manifest: Manifest, *, check_files: bool = True) -> Path:
    """Write ``manifest.json`` durably: the commit point of the checkpoint.

    With ``check_files`` it first checks that every shard file is there with its recorded size
    (turn it off on a shared file system whose other clients' files may show up late).
    """
    step_dir = Path(step_dir)
    if step_of(step_dir) != manifest.step:
        raise CheckpointError(f"manifest of step {manifest.step} does not belong in {step_dir}")
    if check_files:
        for record in manifest.shards:
            path = step_dir / record.file
            size = path.stat().st_size if path.is_file() else None
            if size != record.bytes:
                raise CheckpointError(
                    f"cannot commit {step_dir}: shard {record.file} of layer {record.layer} is "
                    f"{'missing' if size is None else f'{size} bytes'}, its record says {record.bytes}"
                )
    try:
        payload = json.dumps(manifest.to_dict(), indent=1, sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as error:
        raise CheckpointError(
            f"manifest of step {manifest.step} is not JSON-serialisable ({error}); keep extra={{...}} to JSON values"
        ) from None
    path = step_dir / MANIFEST_NAME
    durable_write(path, [payload])
    return path


def read_manifest(step_dir: Path | str) -> Manifest:
    """The manifest of a step directory; ``CheckpointError`` when it is missing or malformed."""
    path = Path(step_dir) / MANIFEST_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing: the checkpoint is incomplete (its write was interrupted or is in progress)"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path} is not valid JSON ({error})") from None
    try:
        manifest = Manifest.from_dict(data)
    except CheckpointError as error:
        raise CheckpointError(f"{path}: {error}") from None
    if step_of(path.parent) is not None and step_of(path.parent) != manifest.step:
        raise CheckpointError(f"{path} says step {manifest.step}, its directory says step {step_of(path.parent)}")
    return manifest

"""One layer's shard: its flat training state plus the metadata to check it against the model.

A shard is a layer's ``flat_state`` (``[3, numel]``: parameters, exp_avg, exp_avg_sq; see
``oobleck.layer_state``) in a self-describing file, readable without pickle:

    bytes 0..7    magic ``OOBSHRD1`` (format version 1)
    bytes 8..15   header length H, little-endian unsigned 64-bit
    bytes 16..    H bytes of JSON: ``ShardMeta`` (layer, numel, dtype, rows, parameter names and
                  shapes), padded with spaces so the data starts at a multiple of ``DATA_ALIGN``
    then          the tensor's bytes, row-major, in this machine's byte order (``byteorder``)

The AdamW step count is not stored per shard: it equals the checkpoint's step (the manifest's).
The CRC32 in the manifest covers the whole file, header included.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from oobleck.checkpoint.durable import IO_CHUNK_BYTES, durable_write, make_dirs
from oobleck.checkpoint.layout import shard_name
from oobleck.checkpoint.manifest import ShardRecord
from oobleck.errors import CheckpointError
from oobleck.layer_state import STATE_KINDS, LayerState, install_flat_state

MAGIC = b"OOBSHRD1"
_LENGTH = struct.Struct("<Q")
DATA_ALIGN = 64  # bytes; keeps the tensor data aligned for any dtype (and a cache line)


@dataclass(frozen=True)
class ShardMeta:
    """What a shard must agree with to be installed into a layer."""

    layer: int
    numel: int
    dtype: str  # torch dtype name without the ``torch.`` prefix, e.g. ``float32``
    params: tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape) in module.parameters() order
    rows: int = STATE_KINDS

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.numel)

    @property
    def nbytes(self) -> int:
        return self.rows * self.numel * torch.empty((), dtype=torch_dtype(self.dtype)).element_size()

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "numel": self.numel,
            "dtype": self.dtype,
            "rows": self.rows,
            "params": [[name, list(shape)] for name, shape in self.params],
            "byteorder": sys.byteorder,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardMeta:
        if data.get("byteorder") != sys.byteorder:
            raise CheckpointError(
                f"shard written on a {data.get('byteorder')}-endian machine; this one is {sys.byteorder}-endian"
            )
        return cls(
            layer=int(data["layer"]),
            numel=int(data["numel"]),
            dtype=str(data["dtype"]),
            rows=int(data["rows"]),
            params=tuple((str(name), tuple(int(d) for d in shape)) for name, shape in data["params"]),
        )

    def mismatch(self, other: ShardMeta) -> str | None:
        """Why a shard with this metadata cannot go into a layer described by ``other`` (None: it can)."""
        for key in ("layer", "rows", "dtype"):
            if getattr(self, key) != getattr(other, key):
                return f"{key} {getattr(self, key)} in the checkpoint, {getattr(other, key)} in the model"
        if self.params != other.params:
            saved, model = dict(self.params), dict(other.params)
            for name in sorted(set(saved) | set(model)):
                if saved.get(name) != model.get(name):
                    return f"parameter {name!r} has shape {saved.get(name)} in the checkpoint, {model.get(name)} in the model"
            return "the parameters are in a different order in the checkpoint and in the model"
        return None


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"shard dtype {name!r} is not a torch dtype")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shard_meta(layer: LayerState, dtype: torch.dtype = torch.float32) -> ShardMeta:
    """The metadata of ``layer``'s shard (``flat_state`` is float32)."""
    params = tuple((name, tuple(p.shape)) for name, p in layer.module.named_parameters())
    return ShardMeta(
        layer=layer.index, numel=sum(math.prod(shape) for _, shape in params), dtype=dtype_name(dtype), params=params
    )


@dataclass(frozen=True)
class Shard:
    """A layer's flat state in host memory, ready to write (see ``oobleck.checkpoint.writer.snapshot``)."""

    meta: ShardMeta
    tensor: torch.Tensor  # [rows, numel], on the CPU, contiguous

    def __post_init__(self) -> None:
        t, meta = self.tensor, self.meta
        if t.device.type != "cpu" or not t.is_contiguous():
            raise CheckpointError(
                f"layer {meta.layer}: a shard's tensor must be contiguous on the CPU (got {t.device}, contiguous={t.is_contiguous()})"
            )
        if tuple(t.shape) != meta.shape or dtype_name(t.dtype) != meta.dtype:
            raise CheckpointError(
                f"layer {meta.layer}: tensor {tuple(t.shape)} {dtype_name(t.dtype)} does not match its metadata {meta.shape} {meta.dtype}"
            )

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def _header(meta: ShardMeta) -> bytes:
    body = json.dumps(meta.to_dict(), sort_keys=True).encode()
    pad = -(len(MAGIC) + _LENGTH.size + len(body)) % DATA_ALIGN
    body += b" " * pad
    return MAGIC + _LENGTH.pack(len(body)) + body


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (any dtype, numpy included or not)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _chunks(view: memoryview) -> Iterator[memoryview]:
    for start in range(0, len(view), IO_CHUNK_BYTES):
        yield view[start : start + IO_CHUNK_BYTES]


def write_shard(step_dir: Path | str, shard: Shard) -> ShardRecord:
    """Write one layer's shard into ``step_dir`` (created if missing) durably; return its record."""
    name = shard_name(shard.meta.layer)
    make_dirs(Path(step_dir))
    data = _byte_view(shard.tensor)
    size, crc = durable_write(Path(step_dir) / name, [_header(shard.meta), *_chunks(data)])
    return ShardRecord(layer=shard.meta.layer, file=name, bytes=size, crc32=crc)


def _read_exact(f: Any, view: memoryview, crc: int) -> int:
    for chunk in _chunks(view):
        got = f.readinto(chunk)
        if got != len(chunk):
            raise EOFError
        crc = zlib.crc32(chunk, crc)
    return crc


def read_shard(
    step_dir: Path | str, record: ShardRecord, *, expect: ShardMeta | None = None, verify: bool = True
) -> torch.Tensor:
    """The ``[rows, numel]`` CPU tensor of ``record``'s shard.

    ``CheckpointError`` names the file when it is missing, truncated, fails its CRC32 (with
    ``verify``), holds another layer, or does not match ``expect`` (the model's ``shard_meta``).
    """
    path = Path(step_dir) / record.file
    where = f"{path} (layer {record.layer})"
    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError:
        raise CheckpointError(f"{where} is missing; the checkpoint is partial") from None
    with f:
        size = f.seek(0, 2)
        f.seek(0)
        if verify and size != record.bytes:
            raise CheckpointError(
                f"{where} is {size} bytes, the manifest says {record.bytes}: the shard is truncated or was replaced"
            )
        prefix = f.read(len(MAGIC) + _LENGTH.size)
        if len(prefix) != len(MAGIC) + _LENGTH.size or prefix[: len(MAGIC)] != MAGIC:
            raise CheckpointError(f"{where} is not a shard file (bad magic bytes)")
        (length,) = _LENGTH.unpack(prefix[len(MAGIC) :])
        if length > size:
            raise CheckpointError(f"{where} has a header length {length} beyond its size {size}: the shard is corrupt")
        body = f.read(length)
        crc = zlib.crc32(body, zlib.crc32(prefix))
        try:
            meta = ShardMeta.from_dict(json.loads(body))
        except (ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"{where} has a malformed header ({error}): the shard is corrupt") from None
        if meta.layer != record.layer:
            raise CheckpointError(f"{where} holds layer {meta.layer}, not layer {record.layer}")
        if expect is not None and (why := meta.mismatch(expect)):
            raise CheckpointError(
                f"{where} does not fit the model: {why}; resume with the model settings the checkpoint was written with, or start fresh (job.resume=null)"
            )
        tensor = torch.empty(meta.shape, dtype=torch_dtype(meta.dtype))
        try:
            crc = _read_exact(f, _byte_view(tensor), crc)
        except EOFError:
            raise CheckpointError(f"{where} ends before its {meta.nbytes} data bytes: the shard is truncated") from None
        if f.read(1):
            raise CheckpointError(f"{where} has bytes after its data: the shard is corrupt")
    if verify and crc != record.crc32:
        raise CheckpointError(
            f"{where} fails its checksum: crc32 {crc:#010x}, the manifest says {record.crc32:#010x}; the shard is corrupt"
        )
    return tensor


def restore_layer(
    step_dir: Path | str, record: ShardRecord, layer: LayerState, committed_steps: int, *, verify: bool = True
) -> None:
    """Read ``record``'s shard, check it against ``layer``'s module, and install it (AdamW step = ``committed_steps``)."""
    flat = read_shard(step_dir, record, expect=shard_meta(layer), verify=verify)
    device = next(iter(layer.params)).device
    install_flat_state(layer, flat.to(device), committed_steps)

"""Before a run starts: can the checkpoint directory take its checkpoints? (Torch-free.)

``probe_checkpoint_dir`` creates the directory, writes a file there the way a shard is written
(``durable_write``: temporary name, fsync, rename) and removes it, and compares the file system's
free space with the size of one checkpoint of the model (``checkpoint_bytes``: every layer's
parameters and its two AdamW moments in fp32, the runtime's shard format). A directory that
cannot be written, or has no room for one checkpoint, is refused with one message naming
``checkpoint.dir``; room for fewer than the ``checkpoint.keep`` checkpoints retention keeps (plus
the one being written) is a warning. A disk that fills up or turns read-only later is a storage
fault the run reports and survives (``oobleck.elastic.checkpoints``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from oobleck.checkpoint.durable import describe_cause, durable_write, remove_file_durably
from oobleck.errors import ConfigError

# Rows of a layer's flat state in a shard: parameters, exp_avg, exp_avg_sq, each fp32 (the
# runtime's ``oobleck.layer_state.STATE_KINDS``; tests/checkpoint/test_storage.py ties the two).
STATE_ROWS = 3
BYTES_PER_VALUE = 4
PROBE_NAME = ".oobleck-write-probe"


@dataclass(frozen=True)
class Room:
    """What the probe found: free bytes, and bytes one checkpoint takes."""

    free_bytes: int
    checkpoint_bytes: int

    def checkpoints(self) -> int:
        return self.free_bytes // self.checkpoint_bytes if self.checkpoint_bytes else 0


def checkpoint_bytes(layer_params: list[int]) -> int:
    """Bytes of one checkpoint of a model whose layers hold ``layer_params`` parameters each."""
    return sum(layer_params) * STATE_ROWS * BYTES_PER_VALUE


def probe_checkpoint_dir(root: Path, needed_bytes: int, keep: int, key: str = "checkpoint.dir") -> Room:
    """Refuse a checkpoint directory that cannot be written or has no room for one checkpoint of
    ``needed_bytes`` (``ConfigError`` naming ``key``); returns what it found."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / PROBE_NAME
        durable_write(probe, [b"oobleck checkpoint probe\n"])
        remove_file_durably(probe)
        stats = os.statvfs(root)
    except OSError as error:
        raise ConfigError(
            f"{key}: checkpoints cannot be written to {root} ({describe_cause(error)}); "
            f"set {key}=<a writable directory> (checkpoint=none turns checkpoints off)"
        ) from None
    room = Room(stats.f_bavail * stats.f_frsize, needed_bytes)
    if room.free_bytes < needed_bytes:
        raise ConfigError(
            f"{key}: {root} has {_mb(room.free_bytes)} free, and one checkpoint of this model takes "
            f"{_mb(needed_bytes)}; free space there or set {key}=<a directory with room> "
            "(checkpoint=none turns checkpoints off)"
        )
    if room.checkpoints() < keep + 1:
        print(
            f"oobleck: warning: {key}={root} has room for {room.checkpoints()} checkpoint(s) of "
            f"{_mb(needed_bytes)}, and checkpoint.keep={keep} keeps {keep} plus the one being written; "
            "later checkpoints will fail (the run reports each and goes on)",
            flush=True,
        )
    return room


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB"

"""Durable file writes: a file appears under its final name complete, or not at all.

``durable_write`` writes to a temporary name in the same directory, fsyncs the file, renames it
over the final name and fsyncs the directory, so a crash (or SIGKILL) at any point leaves either
the old file or the new one, never a torn mix; the rename is atomic on POSIX file systems within
one directory. The CRC32 is computed over the bytes as they are written, so a later reader can
check the file against it without a second pass at write time. Torch-free.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
import zlib
from collections.abc import Iterable
from pathlib import Path

# Temporary names start with this; anything named so is an interrupted write, never a checkpoint.
TEMP_PREFIX = ".tmp-"
# Bytes per write/read call and CRC update: large enough for sequential disk bandwidth (checked
# against one-buffer writes by benchmarks/bench_checkpoint.py), small next to a layer's state.
IO_CHUNK_BYTES = 16 << 20


def temporary_name(final: str) -> str:
    """A name no other writer uses (pid + random token), recognisably temporary."""
    return f"{TEMP_PREFIX}{final}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def is_temporary(name: str) -> bool:
    return name.startswith(TEMP_PREFIX)


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a rename, a new file or subdirectory) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """``mkdir -p`` that also makes every directory it creates durable in its parent."""
    path = Path(path)
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:  # another writer (worker of another node) made it first
            pass
        fsync_dir(directory.parent)


def _write_all(fd: int, chunk: memoryview) -> None:
    while chunk:
        written = os.write(fd, chunk)
        chunk = chunk[written:]


def durable_write(path: Path, chunks: Iterable[bytes | memoryview]) -> tuple[int, int]:
    """Write ``chunks`` to ``path`` durably; return ``(bytes written, crc32 of those bytes)``.

    On any exception the temporary file is removed and ``path`` is untouched. A process killed
    mid-write leaves only a temporary file (``is_temporary``), which readers ignore.
    """
    path = Path(path)
    temp = path.with_name(temporary_name(path.name))
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    size, crc = 0, 0
    try:
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                _write_all(fd, view)
                crc = zlib.crc32(view, crc)
                size += len(view)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return size, crc


def file_crc32(path: Path) -> tuple[int, int]:
    """``(size, crc32)`` of a file, read in chunks of ``IO_CHUNK_BYTES``."""
    size, crc = 0, 0
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(IO_CHUNK_BYTES)
        view = memoryview(buffer)
        while True:
            n = f.readinto(buffer)
            if not n:
                return size, crc
            crc = zlib.crc32(view[:n], crc)
            size += n


def remove_file_durably(path: Path) -> None:
    path = Path(path)
    path.unlink()
    fsync_dir(path.parent)


def remove_tree_durably(path: Path) -> None:
    """Remove a directory so that readers never see it half-removed.

    It is first renamed to a temporary name (atomic: the directory vanishes from listings at
    once), the rename made durable, and only then deleted; a crash in between leaves a temporary
    directory that ``remove_temporaries`` clears later.
    """
    path = Path(path)
    trash = path.with_name(temporary_name(path.name))
    os.rename(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def remove_temporaries(directory: Path) -> list[str]:
    """Delete leftovers of interrupted writes (files and directories) directly in ``directory``."""
    removed = []
    for entry in sorted(Path(directory).iterdir()):
        if is_temporary(entry.name):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry.name)
    if removed:
        fsync_dir(Path(directory))
    return removed


def describe_cause(error: BaseException) -> str:
    """One line for why a write failed, naming the errno for an ``OSError`` (``ENOSPC``: the file
    system is full, ``EROFS``: it is read-only, ...), e.g.
    "OSError ENOSPC: No space left on device: '/ckpt/step-00000020/.tmp-layer-00001.bin...'"."""
    if isinstance(error, OSError) and error.errno is not None:
        name = errno.errorcode.get(error.errno, str(error.errno))
        where = f": {error.filename!r}" if error.filename else ""
        return f"{type(error).__name__} {name}: {error.strerror or error}{where}"
    return f"{type(error).__name__}: {error}"

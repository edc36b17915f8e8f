"""Real file-system faults for the checkpoint tests: a small tmpfs that fills up, or turns read-only.

Mounting needs root (this project's machines run tests as root); elsewhere the tests that need it
skip, saying why. Every mount is removed when its test ends.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _mount(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *arguments], capture_output=True, text=True, check=False)


@contextlib.contextmanager
def small_filesystem(path: Path, size_kb: int) -> Iterator[Path]:
    """A tmpfs of ``size_kb`` KiB mounted at ``path`` (made if missing) for the block."""
    if os.geteuid() != 0:
        pytest.skip("a real full or read-only file system needs a tmpfs mount, which needs root")
    path.mkdir(parents=True, exist_ok=True)
    done = _mount("-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path))
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def fill(path: Path) -> Path:
    """Take every free byte of ``path``'s file system (a filler file); returns the filler."""
    filler = path / "filler"
    with open(filler, "ab", buffering=0) as handle:
        chunk = b"\0" * (64 << 10)
        while True:
            try:
                handle.write(chunk)
            except OSError:
                if len(chunk) == 1:
                    return filler
                chunk = chunk[: len(chunk) // 2]


def read_only(path: Path, on: bool) -> None:
    """Remount ``path``'s tmpfs read-only (``on``) or read-write again."""
    done = _mount("-o", f"remount,{'ro' if on else 'rw'}", str(path))
    assert done.returncode == 0, done.stderr

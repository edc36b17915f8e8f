"""What every Hydra entry point shares once its config is composed: the run dir, its log file,
one-line errors and a clean Ctrl-C.

``entry(program)`` wraps an entry point's body (``oobleck.run``, ``oobleck.plan``,
``oobleck.profile``, ``oobleck.simulate``):

- everything the program prints (stdout and stderr, progress bars at their final state) is also
  written to ``<run dir>/<job name>.log`` (``run.log``, ``plan.log``, ...), next to the records
  Hydra's job logging writes there;
- an ``OobleckError`` prints ``<program>: error: <message>`` and exits with status 2;
- Ctrl-C (``KeyboardInterrupt``) prints one line saying what the run dir keeps and exits with
  status 130 (128 + SIGINT, the shell's convention). A body that saved partial results raises
  ``Interrupted`` with a sentence saying what it saved.

Errors Hydra raises before the body runs are ``oobleck.errors.run_app``'s.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, TextIO

from oobleck.errors import EXIT_INTERRUPTED, exit_with, report_errors


class Interrupted(KeyboardInterrupt):
    """Ctrl-C after the body saved what it had; ``str()`` says what (printed in the one line)."""


class _LogFile:
    """The run's log: text as the terminal finally shows it. A carriage return starts the line
    over (progress bars redraw that way), so only a line's last state is written."""

    def __init__(self, path: Path) -> None:
        self.handle: IO[str] = path.open("a", encoding="utf-8")
        self.pending: dict[int, str] = {}  # per stream: the line not yet ended
        self.lock = threading.Lock()  # the controller's threads print too

    @staticmethod
    def _shown(line: str) -> str:
        """What a terminal shows of ``line``: its part after the last carriage return (a CRLF's
        return does not count)."""
        return line.rstrip("\r").rsplit("\r", 1)[-1]

    def write(self, stream: int, text: str) -> None:
        with self.lock:
            if self.handle.closed:  # a stream kept past the block (a bar, a thread): terminal only
                return
            *done, rest = (self.pending.get(stream, "") + text).split("\n")
            for line in done:
                self.handle.write(self._shown(line) + "\n")
            # Keep only what can still show: a trailing return may be half of a CRLF.
            self.pending[stream] = self._shown(rest) + ("\r" if rest.endswith("\r") else "")
            if done:
                self.handle.flush()

    def close(self) -> None:
        with self.lock:
            if self.handle.closed:
                return
            for rest in self.pending.values():
                if self._shown(rest).strip():
                    self.handle.write(self._shown(rest) + "\n")
            self.handle.close()


class _Tee:
    """A text stream that writes to ``stream`` and to the run's log."""

    def __init__(self, stream: TextIO, log: _LogFile, key: int) -> None:
        self._stream = stream
        self._log = log
        self._key = key

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        self._log.write(self._key, text)
        return written

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, buffer, ...
        return getattr(self._stream, name)


@contextlib.contextmanager
def console_log(path: Path) -> Iterator[Path]:
    """Copy what this process prints to ``path`` (appended) until the block ends."""
    path.parent.mkdir(parents=True, exist_ok=True)
    log = _LogFile(path)
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(saved[0], log, 1), _Tee(saved[1], log, 2)  # type: ignore[assignment]
    try:
        yield path
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved
        log.close()


def hydra_run_dir() -> tuple[Path, str]:
    """The Hydra run dir of the job in progress and the job's name (``run``, ``plan``, ...)."""
    from hydra.core.hydra_config import HydraConfig

    hydra = HydraConfig.get()
    return Path(hydra.runtime.output_dir), str(hydra.job.name)


@contextlib.contextmanager
def entry(program: str) -> Iterator[Path]:
    """The body of ``program``'s Hydra task: yields its run dir (see the module docstring)."""
    run_dir, job = hydra_run_dir()
    with console_log(run_dir / f"{job}.log") as log:
        try:
            with report_errors(program):
                yield run_dir
        except KeyboardInterrupt as stop:
            kept = str(stop) if isinstance(stop, Interrupted) and str(stop) else f"what was printed is in {log}"
            exit_with(f"\n{program}: interrupted (Ctrl-C); {kept}", EXIT_INTERRUPTED, at_once=True)

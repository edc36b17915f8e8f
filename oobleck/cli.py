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

Every entry point starts through ``run_app(main, program)``, which does the same for the errors
Hydra itself raises before the body runs (an override of the wrong type, an unknown key, a missing
group option, bad syntax): one line naming the key, its type in the schema and the closest known
key, exit status 2.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TextIO

from oobleck.errors import (
    EXIT_INTERRUPTED,
    EXIT_USER_ERROR,
    OobleckError,
    body_started,
    exit_with,
    report_errors,
    reset_body,
    unknown_key_message,
    unwritable_message,
)


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


# Hydra prints its own errors over several lines and exits with 1, unless this variable is "1":
# then it raises them, and ``run_app`` can print them in the one-line format.
HYDRA_FULL_ERROR = "HYDRA_FULL_ERROR"


def run_app(main: Callable[[], Any], program: str) -> None:
    """Start a ``@hydra.main`` app so that Hydra's errors too are one line with exit status 2.

    A user who sets ``HYDRA_FULL_ERROR=1`` gets Hydra's full traces, as Hydra documents.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from oobleck.extras import check_launcher_overrides

    try:
        check_launcher_overrides(sys.argv[1:])
    except OobleckError as error:
        exit_with(f"{program}: error: {error}", EXIT_USER_ERROR)
    if os.environ.get(HYDRA_FULL_ERROR) == "1":
        main()
        return
    os.environ[HYDRA_FULL_ERROR] = "1"
    reset_body()
    try:
        main()
    except (HydraException, OmegaConfBaseException) as error:
        exit_with(f"{program}: error: {hydra_error_message(error, program)}", EXIT_USER_ERROR)
    except KeyboardInterrupt:  # before the task's own handling (oobleck.cli.entry) took over
        exit_with(f"\n{program}: interrupted (Ctrl-C)", EXIT_INTERRUPTED, at_once=True)
    except (OSError, ValueError) as error:
        # Before the body runs, Hydra creates the run dir and opens its log file there; a run dir
        # that cannot be written fails right there (an OSError, or logging's ValueError around it).
        cause = _os_error(error)
        if body_started() or cause is None:
            raise
        exit_with(f"{program}: error: {unwritable_message(cause)}", EXIT_USER_ERROR)
    finally:
        os.environ.pop(HYDRA_FULL_ERROR, None)


def _os_error(error: BaseException) -> OSError | None:
    """The OSError behind ``error`` (itself, or along its causes)."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None or isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def hydra_error_message(error: BaseException, program: str) -> str:
    """One line for a Hydra or OmegaConf error: the key, the value and the fix where it names them
    (for an unknown key, the closest known one)."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    from oobleck.config import schema_keys, schema_type

    cause = error if isinstance(error, OmegaConfBaseException) else error.__cause__
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        key = str(cause.full_key)
        hint = f"(python -m {program} --cfg job shows every key)"
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
            parent, _, leaf = key.rpartition(".")
            if key.startswith("strategy."):
                return _strategy_key_message(cause, key, hint)
            if leaf.split("[")[0] not in schema_keys(parent):
                return unknown_key_message(key, schema_keys(parent), hint)
        detail = str(getattr(cause, "msg", "") or cause).strip().splitlines()[0]
        expected = schema_type(key)
        value = getattr(cause, "value", None)
        shown = f"{key}={value}" if value is not None else key
        if expected:
            return f"{shown}: {detail}; set {key}=<{expected}> {hint}"
        return f"{shown}: {detail} {hint}"
    return _one_line(str(error))


def _strategy_key_message(cause: Any, key: str, hint: str) -> str:
    """A ``strategy.<key>=...`` override of a key the strategy's YAML does not list: either a setting
    of the chosen strategy the YAML leaves at its default (it takes ``+``), or a typo."""
    from oobleck.strategy import setting_keys, strategy_class

    parent, _, leaf = key.removeprefix("strategy.").rpartition(".")
    try:
        root = cause.parent_node._get_root()
        cls = strategy_class(root.strategy)
    except Exception:  # no composed config to look at: fall back on the plain message
        return unknown_key_message(key, [], hint)
    known = setting_keys(cls, parent)
    if leaf in known:
        return f"{key} is a setting of strategy={root.strategy.get('name')} that its YAML does not list; add it with +{key}=<value>"
    return unknown_key_message(key, known, hint)


def _one_line(text: str) -> str:
    """Hydra's message lines joined by "; " (the list under a line ending in ":" as "...: a, b"),
    without its config search path."""
    parts: list[str] = []
    listing = False
    for line in (raw.strip() for raw in text.splitlines()):
        if line.startswith("Config search path"):
            break
        if not line:
            listing = False
        elif listing:
            parts[-1] += (" " if parts[-1].endswith(":") else ", ") + line
        else:
            parts.append(line)
            listing = line.endswith(":")
    return "; ".join(parts)

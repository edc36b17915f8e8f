"""The project's exception types and how a program's last line prints them.

Every error a user can cause (bad config, profile, trace, CLI input) is an ``OobleckError`` with a
single message that names what is wrong and how to fix it. Programs wrap their body in
``report_errors`` so such errors print as one line, without a traceback, and exit with status 2.
The errors Hydra raises before an entry point's body runs are turned into the same one line by
``oobleck.cli.run_app``, which needs the config schema; this module imports nothing of the project,
so every module can raise these errors.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import NoReturn


class OobleckError(Exception):
    """Base class of errors with a user-facing message."""


class ConfigError(OobleckError):
    """An invalid configuration value: the message names the key, the value and the fix."""


class ProfileError(OobleckError):
    """A malformed or inconsistent model profile."""


class PlanningError(OobleckError):
    """The planner cannot satisfy the job (e.g. too many failures for the cluster)."""


class TraceError(OobleckError):
    """A malformed failure schedule or node trace: the message names the file and line."""


class CheckpointError(OobleckError):
    """A checkpoint that cannot be written or read: missing, corrupt, or of a different model."""


class RunError(OobleckError):
    """A distributed run could not start or had to stop (the message says why)."""


def closest(word: str, known: Iterable[str]) -> str | None:
    """The known spelling nearest to a mistyped ``word`` (None when nothing is close)."""
    import difflib

    matches = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_key_message(key: str, known: Iterable[str], hint: str = "(--cfg job shows every key)") -> str:
    """One line for a dotted key its section does not have (``known``: the section's key names):
    the closest of them, else all of them."""
    parent, _, leaf = key.rpartition(".")
    known = list(known)
    close = closest(leaf.split("[")[0], known)
    if close:
        return f"{key} is not a config key; did you mean {parent + '.' if parent else ''}{close}? {hint}"
    return f"{key} is not a config key; {parent or 'the config'} has: {', '.join(known) or 'no keys'} {hint}"


class Stopped(RunError):
    """A run stopped on request (a signal) after saving what it did; ``exit_code`` follows the
    conventions: 130 for SIGINT, 143 for SIGTERM, 75 (EX_TEMPFAIL) for "checkpointed, requeue me"."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention
EXIT_REQUEUE = 75  # sysexits.h EX_TEMPFAIL: slurm/run.sbatch requeues the job on it


_body = {"started": False}  # set once a program's body runs (``report_errors``)


def body_started() -> bool:
    """Whether a program's body has started (entered ``report_errors``) since ``reset_body``."""
    return _body["started"]


def reset_body() -> None:
    """Mark the body as not started (``oobleck.cli.run_app``, before Hydra composes the config)."""
    _body["started"] = False


def exit_with(message: str, exit_code: int, *, at_once: bool = False) -> NoReturn:
    """Print ``message``, an entry point's last line (an error, a stop, a Ctrl-C), and exit.

    From here on SIGINT is ignored: the line is the last word, and the exit that follows is bounded
    (with torch loaded, tearing the interpreter down takes most of a second). A Ctrl-C in that
    window (a user pressing twice) would otherwise kill the process by SIGINT, or print a
    traceback, after the line was printed, and the exit status would no longer say what happened.
    ``at_once`` (a Ctrl-C: the user wants out, and every file worth keeping was closed by the
    body's own cleanup) skips that teardown: streams and log handlers are flushed and the process
    exits with ``exit_code`` right away: a teardown that runs no Python code cannot be interrupted
    between the line and the exit.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(message, file=sys.stderr, flush=True)
    if at_once:
        import logging

        sys.stdout.flush()
        logging.shutdown()
        os._exit(exit_code)
    sys.exit(exit_code)


@contextlib.contextmanager
def report_errors(program: str) -> Iterator[None]:
    """Print an ``OobleckError`` as ``<program>: error: <message>`` and exit with status 2 (or the
    error's own ``exit_code``: a run stopped by a signal)."""
    _body["started"] = True
    try:
        yield
    except Stopped as error:
        exit_with(f"{program}: stopped: {error}", error.exit_code)
    except OobleckError as error:
        exit_with(f"{program}: error: {error}", EXIT_USER_ERROR)


def unwritable_message(error: OSError, where: str | None = None) -> str:
    """One line for a run dir that cannot be written, naming the key that chooses it."""
    where = where or (str(error.filename) if error.filename else "the run dir")
    return f"cannot write {where} ({error.strerror or error}); set hydra.run.dir=<a writable directory>"

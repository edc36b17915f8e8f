"""The project's exception types and the one place that turns them into CLI messages.

Every error a user can cause (bad config, profile, trace, CLI input) is an ``OobleckError`` with a
single message that names what is wrong and how to fix it. Entry points wrap their body in
``report_errors`` so such errors print as one line, without a traceback, and exit with status 2;
and they start through ``run_app``, which does the same for the errors Hydra itself raises before
the body runs (an override of the wrong type, an unknown key, a missing group option, bad syntax).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import typing
from collections.abc import Callable, Iterator
from typing import Any


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


class Stopped(RunError):
    """A run stopped on request (a signal) after saving what it did; ``exit_code`` follows the
    conventions: 130 for SIGINT, 143 for SIGTERM, 75 (EX_TEMPFAIL) for "checkpointed, requeue me"."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


EXIT_USER_ERROR = 2
EXIT_REQUEUE = 75  # sysexits.h EX_TEMPFAIL: slurm/run.sbatch requeues the job on it


_body = {"started": False}  # set once an entry point's body runs (``report_errors``)


@contextlib.contextmanager
def report_errors(program: str) -> Iterator[None]:
    """Print an ``OobleckError`` as ``<program>: error: <message>`` and exit with status 2 (or the
    error's own ``exit_code``: a run stopped by a signal)."""
    _body["started"] = True
    try:
        yield
    except Stopped as error:
        print(f"{program}: stopped: {error}", file=sys.stderr, flush=True)
        sys.exit(error.exit_code)
    except OobleckError as error:
        print(f"{program}: error: {error}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)


# Hydra prints its own errors over several lines and exits with 1, unless this variable is "1":
# then it raises them, and ``run_app`` can print them in the one-line format.
HYDRA_FULL_ERROR = "HYDRA_FULL_ERROR"


def run_app(main: Callable[[], Any], program: str) -> None:
    """Start a ``@hydra.main`` app so that Hydra's errors too are one line with exit status 2.

    A user who sets ``HYDRA_FULL_ERROR=1`` gets Hydra's full traces, as Hydra documents.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if os.environ.get(HYDRA_FULL_ERROR) == "1":
        main()
        return
    os.environ[HYDRA_FULL_ERROR] = "1"
    _body["started"] = False
    try:
        main()
    except (HydraException, OmegaConfBaseException) as error:
        print(f"{program}: error: {hydra_error_message(error, program)}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    except (OSError, ValueError) as error:
        # Before the body runs, Hydra creates the run dir and opens its log file there; a run dir
        # that cannot be written fails right there (an OSError, or logging's ValueError around it).
        cause = _os_error(error)
        if _body["started"] or cause is None:
            raise
        print(f"{program}: error: {unwritable_message(cause)}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    finally:
        del os.environ[HYDRA_FULL_ERROR]


def unwritable_message(error: OSError, where: str | None = None) -> str:
    """One line for a run dir that cannot be written, naming the key that chooses it."""
    where = where or (str(error.filename) if error.filename else "the run dir")
    return f"cannot write {where} ({error.strerror or error}); set hydra.run.dir=<a writable directory>"


def _os_error(error: BaseException) -> OSError | None:
    """The OSError behind ``error`` (itself, or along its causes)."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None or isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def hydra_error_message(error: BaseException, program: str) -> str:
    """One line for a Hydra or OmegaConf error: the key, the value and the fix where it names them."""
    from omegaconf.errors import OmegaConfBaseException

    cause = error if isinstance(error, OmegaConfBaseException) else error.__cause__
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        key, detail = cause.full_key, str(getattr(cause, "msg", "") or cause).strip().splitlines()[0]
        expected = _schema_type(key)
        value = getattr(cause, "value", None)
        shown = f"{key}={value}" if value is not None else key
        if expected:
            return f"{shown}: {detail}; set {key}=<{expected}> (python -m {program} --cfg job shows every key)"
        return f"{shown}: {detail} (python -m {program} --cfg job shows every key)"
    return _one_line(str(error))


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


def _schema_type(key: str) -> str | None:
    """The type the config schema (``oobleck.config.Config``) declares for a dotted key, if any."""
    from oobleck.config import Config  # here: oobleck.config imports this module

    node: Any = Config
    hint: Any = None
    for part in key.split("."):
        part = part.split("[")[0]
        if not dataclasses.is_dataclass(node):
            return None
        hints = typing.get_type_hints(node)
        if part not in hints:
            return None
        hint = hints[part]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        node = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
    if node in (int, float, str, bool):
        optional = typing.get_origin(hint) is typing.Union
        return node.__name__ + (" or null" if optional else "")
    return None

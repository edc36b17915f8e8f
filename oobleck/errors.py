"""The project's exception types and the one place that turns them into CLI messages.

Every error a user can cause (bad config, profile, trace, CLI input) is an ``OobleckError`` with a
single message that names what is wrong and how to fix it. Entry points wrap their body in
``report_errors`` so such errors print as one line, without a traceback, and exit with status 2;
and they start through ``run_app``, which does the same for the errors Hydra itself raises before
the body runs (an override of the wrong type, an unknown key, a missing group option, bad syntax).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn


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


_body = {"started": False}  # set once an entry point's body runs (``report_errors``)


def exit_with(message: str, exit_code: int, *, at_once: bool = False) -> NoReturn:
    """Print ``message``, an entry point's last line (an error, a stop, a Ctrl-C), and exit.

    From here on SIGINT is ignored: the line is the last word, and the exit that follows is bounded
    (with torch loaded, tearing the interpreter down takes most of a second). A Ctrl-C in that
    window (a user pressing twice) would otherwise kill the process by SIGINT, or print a
    traceback, after the line was printed, and the exit status would no longer say what happened.
    ``at_once`` (a Ctrl-C: the user wants out, and every file worth keeping was closed by the
    body's own cleanup) skips that teardown: streams and log handlers are flushed and the process
    exits with ``exit_code`` right away. (CI twice saw a Ctrl-C'd profile print its line and still
    end by SIGINT during the teardown, which no local repeat reproduced; exiting at once leaves no
    window for that.)
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
        exit_with(f"{program}: error: {hydra_error_message(error, program)}", EXIT_USER_ERROR)
    except KeyboardInterrupt:  # before the task's own handling (oobleck.cli.entry) took over
        exit_with(f"\n{program}: interrupted (Ctrl-C)", EXIT_INTERRUPTED, at_once=True)
    except (OSError, ValueError) as error:
        # Before the body runs, Hydra creates the run dir and opens its log file there; a run dir
        # that cannot be written fails right there (an OSError, or logging's ValueError around it).
        cause = _os_error(error)
        if _body["started"] or cause is None:
            raise
        exit_with(f"{program}: error: {unwritable_message(cause)}", EXIT_USER_ERROR)
    finally:
        os.environ.pop(HYDRA_FULL_ERROR, None)


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
    """One line for a Hydra or OmegaConf error: the key, the value and the fix where it names them
    (for an unknown key, the closest known one)."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    from oobleck.config import schema_keys, schema_type  # here: oobleck.config imports this module

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

"""The project's exception types and the one place that turns them into CLI messages.

Every error a user can cause (bad config, profile, trace, CLI input) is an ``OobleckError`` with a
single message that names what is wrong and how to fix it. Entry points wrap their body in
``report_errors`` so such errors print as one line, without a traceback, and exit with status 2.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


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


EXIT_USER_ERROR = 2


@contextlib.contextmanager
def report_errors(program: str) -> Iterator[None]:
    """Print an ``OobleckError`` as ``<program>: error: <message>`` and exit with status 2."""
    try:
        yield
    except OobleckError as error:
        print(f"{program}: error: {error}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)

"""The failure vocabulary: what a scheduled event does (``FaultKind``) and where in a step it
strikes (``Phase``). The config (``failures.events[].action`` / ``.phase``), the schedule, the
injector, the controller's firing, the worker and the node traces the simulator replays
(``oobleck.faults.trace``: the file's add/remove are JOIN/REMOVE) all speak these, so a new kind
of fault is added here and carried out where its ``signal`` (or its ``in_worker`` branch) says.
"""

from __future__ import annotations

import enum
import signal


class FaultKind(str, enum.Enum):
    """What an event does to its nodes (``failures.events[].action``)."""

    REMOVE = "remove"  # the node crashes: SIGKILL to its whole process group (agent and workers)
    FREEZE = "freeze"  # the node hangs: SIGSTOP; the heartbeat timeout detects it
    RAISE = "raise"  # the node's first worker raises InjectedFault (the error path)
    JOIN = "join"  # new nodes start and join

    def __str__(self) -> str:  # the config spelling, in messages and f-strings
        return self.value

    @property
    def signal(self) -> signal.Signals | None:
        """The signal that carries out a node fault (None: a raise or a join)."""
        return {FaultKind.REMOVE: signal.SIGKILL, FaultKind.FREEZE: signal.SIGSTOP}.get(self)

    @property
    def in_worker(self) -> bool:
        """Only a worker can do it (it is raised inside the training step), so it is always armed."""
        return self is FaultKind.RAISE

    @property
    def takes_nodes(self) -> bool:
        """It strikes live nodes (every kind but a join)."""
        return self is not FaultKind.JOIN


class Phase(str, enum.Enum):
    """Where in a step a node fault strikes (``failures.events[].phase``); the worker's executor
    names the same points as the step reaches them."""

    ANY = "any"  # as soon as the step starts (the controller fires it)
    FORWARD = "forward"
    BACKWARD = "backward"
    ALLREDUCE = "allreduce"
    OPTIMIZER = "optimizer"
    RECONFIGURE = "reconfigure"  # during the reconfiguration that follows the step

    def __str__(self) -> str:
        return self.value


def names(kind: type[enum.Enum]) -> tuple[str, ...]:
    """The config spellings of an enum's members, in order (for messages and validation)."""
    return tuple(member.value for member in kind)

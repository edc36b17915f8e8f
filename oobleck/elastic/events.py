"""What the controller reports: the kinds of events.csv rows, and the hooks its observers get.

``EventKind`` names every event a real run records (the ``kind`` column of events.csv, the wandb
markers); the values are public (``analysis/`` reads them), the members are how the code names
them. The controller and its parts (membership, fault firing, checkpoints) emit only these.

``RunObserver`` is how code outside the controller's core follows a run without changing it:
the recovery accounting and the fault-tolerance report (``oobleck.elastic.accounting``) are
observers, and ``Controller.observers`` takes more. The core calls the hooks in this order around
a membership change: ``changes_taken`` (nodes lost and joined, with when each was caused and how
long detecting it took), then either ``continued`` (the strategy carries on without a new
generation) or ``executing`` (a decision is being carried out: its generation is published
next), ``published`` (every generation, the first one too), and ``absorbed`` once the first step
after the change committed. Two decisions differ: a restart that checkpoints first is executed
once its checkpoint is complete (``executing`` comes later, after other steps), and a
``continue`` decided after the step in flight was aborted publishes the same plan again
(``published`` alone). ``finished`` follows the last step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from oobleck.strategy import Decision, Kind, Layout, RunState

if TYPE_CHECKING:
    from oobleck.elastic.membership import Changes
    from oobleck.runtime.plan_document import PlanDocument


class EventKind(str, enum.Enum):
    """The ``kind`` of an events.csv row."""

    # membership and faults
    FAILURE = "failure"
    JOIN = "join"
    JOIN_STARTED = "join_started"
    FAULT_ARMED = "fault_armed"
    FAULT_INJECTED = "fault_injected"
    NOTICE = "notice"  # a preemption notice reached the strategy (its decision beside it)
    DEPARTED = "departed"  # a node under notice was killed after a layout had let it go
    # recoveries (one row each, with its breakdown) and what else a decision does
    RECONFIGURATION = "reconfiguration"
    FAILOVER = "failover"
    REROUTE = "reroute"
    RESTART = "restart"
    CONTINUE = "continue"
    RECONFIGURATION_SUPERSEDED = "reconfiguration_superseded"
    FAILOVER_SUPERSEDED = "failover_superseded"
    REROUTE_SUPERSEDED = "reroute_superseded"
    RESTART_SUPERSEDED = "restart_superseded"
    CONTINUE_SUPERSEDED = "continue_superseded"
    RESTART_PLANNED = "restart_planned"
    STANDBY = "standby"
    FAULT_TOLERANCE_REDUCED = "fault_tolerance_reduced"
    REDONE = "redone"  # a step that could not be decided is redone on a new generation of the same plan
    # checkpoints
    CHECKPOINT = "checkpoint"
    CHECKPOINT_ABANDONED = "checkpoint_abandoned"
    CHECKPOINT_FAILED = "checkpoint_failed"  # a storage fault: the cause says which
    CHECKPOINT_REQUESTED = "checkpoint_requested"
    RESUME = "resume"
    # the end of a run
    STOP = "stop"
    JOIN_NOT_ABSORBED = "join_not_absorbed"
    STANDBY_AT_END = "standby_at_end"
    SCHEDULE_NOT_FINISHED = "schedule_not_finished"

    def superseded(self) -> EventKind:
        """The event of a recovery of this kind overtaken by a newer change before it finished."""
        return EventKind(f"{self.value}_superseded")


# The recovery event of each decision kind that starts one.
RECOVERY_EVENTS = {
    Kind.RECONFIGURE: EventKind.RECONFIGURATION,
    Kind.FAILOVER: EventKind.FAILOVER,
    Kind.REROUTE: EventKind.REROUTE,
    Kind.RESTART: EventKind.RESTART,
    Kind.CONTINUE: EventKind.CONTINUE,
}


@dataclass(frozen=True)
class Execution:
    """A decision the controller is carrying out after a membership change."""

    decision: Decision  # as executed (a reconfiguration before the first commit copies nothing)
    state: RunState  # what the strategy decided on
    generation: int  # the generation it publishes
    resume_step: int  # the step that generation starts at
    started: float  # wall clock when the controller began acting on the change
    plan_s: float  # seconds the decision took
    rolled_back_steps: int = 0  # restart: committed steps lost to the rollback
    restart_nodes: tuple[int, ...] = ()  # restart: the nodes whose workers were replaced
    note: str = ""  # what else a user should know (a restart from an older checkpoint: why)

    @property
    def kind(self) -> Kind:
        return self.decision.kind


@dataclass(frozen=True)
class Continuation:
    """A ``continue`` decision: no new generation; the strategy's workers carry on as they are."""

    decision: Decision
    lost: tuple[int, ...]  # working nodes lost (not standing by): the workers heal by themselves
    generation: int
    resume_step: int  # the step in flight
    started: float


class RunObserver:
    """Hooks into a run's controller (see the module docstring); each does nothing unless overridden."""

    def changes_taken(self, changes: Changes, started: float) -> None:
        """Nodes were lost or joined; the controller is about to decide."""

    def executing(self, execution: Execution) -> None:
        """A decision is being carried out; its generation is published next."""

    def continued(self, continuation: Continuation) -> None:
        """The strategy decided to continue without a new generation."""

    def published(self, document: PlanDocument, layout: Layout) -> None:
        """A generation was published (the first one too)."""

    def absorbed(self, generation: int) -> None:
        """The last change's first step committed (in ``generation``): the change is absorbed."""

    def finished(self) -> None:
        """The run's loop ended after its last step."""

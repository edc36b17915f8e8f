"""The controller's generations: each published as one plan document, followed until absorbed.

Every generation is published as one ``PlanDocument`` (``publish``). A change is *absorbed* once
the first step after it commits; until then ``busy`` holds (scheduled faults wait for it), as it
does while a restart waits for its checkpoint. A restart's checkpoint is kept from retention
(``CheckpointCoordinator.pin``) until the restart's workers hold the state. ``redo`` handles what
is not a membership change: a step whose decision cannot be read, or workers that left a
generation the controller never ended; the generation is ended and the same plan published again.

``GenerationPublisher`` also holds the rest of the state the controller's decisions read and
change (the nodes under a preemption notice); ``oobleck.elastic.execution.DecisionExecutor``
builds on it to carry decisions out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from oobleck.elastic.checkpoints import CheckpointCoordinator
from oobleck.elastic.events import EventKind
from oobleck.elastic.ledger import StepLedger
from oobleck.elastic.membership import Membership
from oobleck.planning.outputs import ReconfigurationPlan
from oobleck.runtime import keys
from oobleck.runtime.plan_document import PlanDocument
from oobleck.strategy import Decision, Kind, Layout, Strategy


class GenerationPublisher:
    """Generations published, and followed until absorbed (see the module docstring)."""

    def __init__(
        self,
        strategy: Strategy,
        store: Any,
        ledger: StepLedger,
        membership: Membership,
        checkpoints: CheckpointCoordinator,
        *,
        emit: Callable[..., None],
        notify: Callable[..., None],
    ) -> None:
        self.strategy = strategy
        self.store = store
        self.ledger = ledger
        self.membership = membership
        self.checkpoints = checkpoints
        self.emit = emit  # (EventKind, **fields): the run's event log
        self.notify = notify  # (hook name, *arguments): the run's observers
        self.documents: dict[int, PlanDocument] = {}  # every generation published
        self.absorbing: tuple[int, int] | None = None  # (generation, first step) of a change not yet absorbed
        self.restarting: int | None = None  # the rollback step of a restart whose workers hold nothing yet
        self.planned: tuple[Decision, int] | None = None  # a restart waiting for its checkpoint
        self.leaving: dict[int, float] = {}  # node under a preemption notice -> the notice's seconds

    @property
    def busy(self) -> bool:
        """A change is being absorbed, or a restart waits for its checkpoint."""
        return self.absorbing is not None or self.planned is not None

    # ------------------------------------------------------------------ generations
    def publish(
        self,
        generation: int,
        layout: Layout,
        resume: int,
        *,
        reconfiguration: ReconfigurationPlan | None = None,
        checkpoint: str | None = None,
        decision: Kind = Kind.START,
    ) -> None:
        document = PlanDocument(
            generation=generation,
            plan=layout.plan,
            resume_step=resume,
            checkpoint=self.checkpoints.document(layout.plan, self.strategy.context.layer_param_bytes),
            reconfiguration=reconfiguration,
            load_checkpoint=checkpoint,
            incarnations={n: s.incarnation for n, s in self.membership.nodes.items()},
            decision=Kind(decision).value,
        )
        self._publish(document, layout)

    def _publish(self, document: PlanDocument, layout: Layout) -> None:
        self.documents[document.generation] = document
        self.ledger.publish(document.generation, layout, document.resume_step)
        self.store.set(keys.plan(document.generation), document.to_json())
        self.store.set(keys.GEN, str(document.generation))
        self.notify("published", document, layout)

    def established(self, generation: int) -> None:
        """``generation`` was established: the workers of a restart hold their state now."""
        if self.restarting is not None and generation == self.ledger.generation:
            self._restarted()

    def _restarted(self) -> None:
        """The workers of a restart (or a resume) hold their state: its checkpoint may be retired."""
        self.checkpoints.unpin(self.restarting)
        self.restarting = None

    def restarting_from(self, step: int) -> None:
        """Generation ``ledger.generation`` loads the checkpoint of ``step`` (a restart or a resume):
        until its workers hold the state, a change restarts from it again, and retention keeps it."""
        self.restarting = step
        self.checkpoints.pin(step)

    def boundary_committed(self, generation: int, boundary: int) -> None:
        """A step committed with a checkpoint after it (``boundary`` steps committed)."""
        self.checkpoints.noticed(generation, boundary, self.documents[generation].checkpoint.writers)
        if self.planned is not None and boundary >= self.planned[1] and generation == self.ledger.generation:
            # A planned restart: stop training at this boundary, so nothing after it is lost,
            # while the checkpoint completes in the background.
            self.planned = (self.planned[0], boundary)
            self.ledger.take_in_flight()
            self.ledger.abandon(generation)

    def check_absorbed(self) -> None:
        if self.absorbing is None:
            return
        generation, first_step = self.absorbing
        if self.ledger.generation == generation and self.ledger.next_step > first_step:
            self.absorbing = None
            # Its workers hold the state now: a later change is decided afresh (from the newest
            # checkpoint), never by restarting from this one, which retention may remove now.
            if self.restarting is not None:
                self._restarted()
            self.notify("absorbed", generation)

    def redo(self, steps: int, reason: str) -> None:
        """End the newest generation and publish it again as the next one, the step in flight to
        be redone: its decision cannot be read, or workers left a generation the controller never
        ended. Established, the plan stays and nothing moves; not yet established, the same
        document (its copies, its checkpoint to load) is published again."""
        ledger = self.ledger
        generation = ledger.generation
        step = ledger.take_in_flight()
        if step >= steps:
            return
        ledger.count_attempt(step)
        ledger.abandon(generation)
        document = self.documents[generation]
        layout = ledger.generations[generation].layout
        if ledger.base == generation:
            plan = document.plan
            again = dataclasses.replace(
                document,
                generation=generation + 1,
                resume_step=step,
                reconfiguration=ReconfigurationPlan(plan, plan, (), (), ()),
                load_checkpoint=None,
            )
        else:
            again = dataclasses.replace(document, generation=generation + 1)
        self.emit(EventKind.REDONE, step=step, reason=reason, redone_in=generation + 1)
        print(f"oobleck: warning: redoing step {step} in generation {generation + 1}: {reason}", flush=True)
        self._publish(again, layout)
        if self.absorbing is not None and self.absorbing[0] == generation:
            self.absorbing = (generation + 1, self.absorbing[1])

"""The fault injector: decides when each scheduled event is due and which nodes it hits.

The controller carries out what is due (``oobleck.elastic.firing``); this module keeps the
schedule's state. An event at step s whose phase is ``any`` is due as soon as step s starts (when
step s-1 commits). An *armed* event (at a phase of step s, or a ``raise``) is due one step earlier:
it is handed to the node's first worker through the store (``strike/<node>``), which strikes at
that exact point of step s, so forward / backward / all-reduce / optimizer / during-reconfiguration
failures land where the schedule asks. Time events are due when the run has been training for
``time_s`` seconds, or ``notice_s`` earlier when they come with a preemption notice: a noticed
removal is due when its notice is (the controller gives the notice then and kills its nodes
``notice_s`` later). Count-based victims are drawn from the live nodes with a generator seeded by
``failures.seed``. A resumed run passes over the events that were due before its
checkpoint (``skip_before``): one run, one schedule, across attempts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from oobleck.faults.kinds import FaultKind
from oobleck.faults.schedule import FaultEvent


@dataclass
class Action:
    """A due event and the nodes it hits now: struck at once by the controller, or ``armed`` for
    the nodes' workers to strike at the event's phase. A join without ids starts ``count`` nodes."""

    event: FaultEvent
    nodes: tuple[int, ...]
    count: int = 0

    @property
    def kind(self) -> FaultKind:
        return self.event.kind

    @property
    def armed(self) -> bool:
        return self.event.armed

    @property
    def notice_s(self) -> float:
        """Seconds between the notice (now) and the kill; 0: strike now."""
        return self.event.notice_s


@dataclass
class Injector:
    events: Sequence[FaultEvent]
    seed: int = 0
    _fired: set[int] = field(default_factory=set)
    _skipped: set[int] = field(default_factory=set)
    _rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng([int(self.seed), 11])

    @property
    def remaining(self) -> int:
        return len(self.events) - len(self._fired)

    @property
    def skipped(self) -> int:
        """Events passed over because the run resumed after them (``skip_before``)."""
        return len(self._skipped)

    def _victims(self, event: FaultEvent, live: Sequence[int]) -> tuple[int, ...]:
        if event.nodes is not None:
            return tuple(n for n in event.nodes if n in live)
        pool = sorted(live)
        count = min(int(event.count or 0), len(pool))
        picked: list[int] = list(self._rng.choice(len(pool), size=count, replace=False)) if count else []
        return tuple(sorted(pool[int(i)] for i in picked))

    def skip_before(self, step: int, time_s: float) -> int:
        """A resumed run: the events of steps before ``step``, or of times before ``time_s`` seconds of
        training, happened before its checkpoint; they never fire again. Returns how many."""
        passed = {
            index
            for index, event in enumerate(self.events)
            if (event.step is not None and event.step < step) or (event.time_s is not None and event.time_s < time_s)
        }
        self._skipped |= passed - self._fired
        self._fired |= passed
        return len(passed)

    def due(self, next_step: int, elapsed_s: float, live: Sequence[int]) -> list[Action]:
        """Actions to take now, given the step in flight and the training time so far."""
        actions: list[Action] = []
        for index, event in enumerate(self.events):
            if index in self._fired:
                continue
            if actions and not actions[-1].armed:
                break  # one membership change at a time: the caller holds the rest until absorbed
            if event.step is not None:
                ready = next_step >= event.step - 1 if event.armed else next_step >= event.step
                if event.step == 0 and event.armed:
                    ready = True
            else:
                ready = elapsed_s >= float(event.notice_at_s or 0.0)
            if not ready:
                continue
            self._fired.add(index)
            if event.kind is FaultKind.JOIN:
                actions.append(Action(event, event.nodes or (), count=0 if event.nodes else int(event.count or 0)))
                continue
            victims = self._victims(event, live)
            if victims:
                actions.append(Action(event, victims))
        return actions

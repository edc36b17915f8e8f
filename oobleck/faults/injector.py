"""The fault injector: decides when each scheduled event is due and which nodes it hits.

The controller owns the physical actions (``killpg`` of a node's process group, starting a new
agent); this module keeps the schedule's state. A removal "at step s" with phase ``any`` fires
as soon as step s starts (when step s-1 commits). A removal or ``raise`` at a phase of step s is
*armed* one step earlier through the store (``strike/<node>``): the node's first worker fires it at
that exact point of step s (killing its own node's process group), so forward / backward /
all-reduce / optimizer / during-reconfiguration failures land where the test asks. Time events
fire when the run has been training for ``time_s`` seconds. Count-based victims are drawn from
the live nodes with a generator seeded by ``failures.seed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from oobleck.faults.schedule import FaultEvent


@dataclass
class Action:
    """A due action: ``kind`` is kill | freeze | arm | join."""

    kind: str
    nodes: tuple[int, ...]
    event: FaultEvent
    count: int = 0  # joins without explicit ids: how many new nodes


@dataclass
class Injector:
    events: Sequence[FaultEvent]
    seed: int = 0
    _fired: set[int] = field(default_factory=set)
    _rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng([int(self.seed), 11])

    @property
    def remaining(self) -> int:
        return len(self.events) - len(self._fired)

    def _victims(self, event: FaultEvent, live: Sequence[int]) -> tuple[int, ...]:
        if event.nodes is not None:
            return tuple(n for n in event.nodes if n in live)
        pool = sorted(live)
        count = min(int(event.count or 0), len(pool))
        picked = self._rng.choice(len(pool), size=count, replace=False) if count else []
        return tuple(sorted(pool[int(i)] for i in picked))

    def due(self, next_step: int, elapsed_s: float, live: Sequence[int]) -> list[Action]:
        """Actions to take now, given the step in flight and the training time so far."""
        actions: list[Action] = []
        for index, event in enumerate(self.events):
            if index in self._fired:
                continue
            if actions and actions[-1].kind != "arm":
                break  # one membership change at a time: the caller holds the rest until absorbed
            strike = event.phase != "any" or event.action == "raise"
            if event.step is not None:
                ready = next_step >= event.step - 1 if strike else next_step >= event.step
                if event.step == 0 and strike:
                    ready = True
            else:
                ready = elapsed_s >= float(event.time_s or 0.0)
            if not ready:
                continue
            self._fired.add(index)
            if event.action == "join":
                actions.append(Action("join", event.nodes or (), event, count=0 if event.nodes else int(event.count or 0)))
                continue
            victims = self._victims(event, live)
            if not victims:
                continue
            if strike:
                actions.append(Action("arm", victims, event))
            else:
                actions.append(Action("freeze" if event.freeze else "kill", victims, event))
        return actions

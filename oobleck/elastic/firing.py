"""Fault firing: carrying out the injector's due actions on the real cluster.

The injector (``oobleck.faults.injector``) decides *when* each scheduled event is due and which
nodes it hits; this module does it: a kill or freeze signals the node's whole process group
(through the launcher, or the agent where the launcher cannot reach it), a strike at a phase of a
step is armed through the store (``strike/<node>``: the node's first worker fires it at that
point), a join starts new agents. Events apply in order, each once the previous change has been
absorbed, so a schedule means the same sequence of generations however long start-up or recovery
takes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from oobleck.elastic.events import EventKind
from oobleck.faults.injector import Action, Injector
from oobleck.faults.kinds import FaultKind, Phase
from oobleck.runtime import keys


class FaultFiring:
    def __init__(self, injector: Injector, store: Any, membership: Any, event: Callable[..., None]) -> None:
        self.injector = injector
        self.store = store  # the run's key space: a foreign strike/<node> cannot take a node down
        self.membership = membership
        self.event = event
        self.next_node_id = 0
        self.armed: list[tuple[Any, tuple[int, ...]]] = []  # (event, nodes) armed through the store

    @property
    def remaining(self) -> int:
        return self.injector.remaining

    def unfired(self) -> list[Any]:
        """Armed events that never struck (a ``phase: reconfigure`` strike with no reconfiguration
        after it, a step the run never reached): some node's worker never set its strike time."""
        return [event for event, nodes in self.armed if not all(self.store.check([keys.strike_time(n)]) for n in nodes)]

    def fire_due(self, next_step: int, elapsed_s: float, generation: int) -> None:
        for action in self.injector.due(next_step, elapsed_s, self.membership.alive()):
            self._apply(action, next_step, generation)

    def _apply(self, action: Action, next_step: int, generation: int) -> None:
        event = action.event
        if action.kind is FaultKind.JOIN:
            ids = list(action.nodes) or list(range(self.next_node_id, self.next_node_id + action.count))
            for node in ids:
                self.next_node_id = max(self.next_node_id, node + 1)
                self.membership.start_node(node)
            self.event(EventKind.JOIN_STARTED, nodes=ids, origin=event.origin)
            return
        if action.armed:
            for node in action.nodes:
                strike: dict[str, Any] = {"step": event.step, "phase": event.phase.value, "kind": event.kind.value}
                if event.phase is Phase.RECONFIGURE:
                    strike["generation"] = generation + 1
                self.store.set(keys.strike(node), json.dumps(strike))
            self.armed.append((event, tuple(action.nodes)))
            self.event(
                EventKind.FAULT_ARMED,
                nodes=list(action.nodes),
                phase=event.phase.value,
                action=event.kind.value,
                armed_for_step=event.step,
            )
            return
        assert action.kind.signal is not None, f"{action.kind} is struck by workers, never by the controller"
        for node in action.nodes:
            self.membership.kill(node, action.kind.signal)
        self.event(EventKind.FAULT_INJECTED, nodes=list(action.nodes), fault=action.kind.value, origin=event.origin)

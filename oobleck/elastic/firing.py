"""Fault firing: carrying out the injector's due actions on the real cluster.

The injector (``oobleck.faults.injector``) decides *when* each scheduled event is due and which
nodes it hits; this module does it: a kill or freeze signals the node's whole process group
(through the launcher, or the agent where the launcher cannot reach it), a strike at a phase of a
step is armed through the store (``strike/<node>``: the node's first worker fires it at that
point), a join starts new agents. Events apply in order, each once the previous change has been
absorbed, so a schedule means the same sequence of generations however long start-up or recovery
takes.

A removal with a preemption notice (``FaultEvent.notice_s``) is given to the controller as a
notice when it is due (``notice``: the strategy decides on it) and its nodes are SIGKILLed
``notice_s`` seconds later, whatever the run is doing then (a provider does not wait for a
checkpoint); until that kill the next events wait.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from oobleck.elastic.events import EventKind
from oobleck.faults.injector import Action, Injector
from oobleck.faults.kinds import FaultKind, Phase
from oobleck.runtime import keys


@dataclass(frozen=True)
class NoticedKill:
    """Nodes under a preemption notice and when they are killed (wall clock)."""

    nodes: tuple[int, ...]
    at: float
    notice_s: float
    origin: str


class FaultFiring:
    def __init__(
        self,
        injector: Injector,
        store: Any,
        membership: Any,
        event: Callable[..., None],
        *,
        notice: Callable[[tuple[int, ...], float], None] | None = None,
    ) -> None:
        self.injector = injector
        self.notice = notice  # (nodes, notice_s): a preemption notice, for the strategy to decide on
        self.store = store  # the run's key space: a foreign strike/<node> cannot take a node down
        self.membership = membership
        self.event = event
        self.next_node_id = 0
        self.armed: list[tuple[Any, tuple[int, ...]]] = []  # (event, nodes) armed through the store
        self.noticed: list[NoticedKill] = []  # kills announced by a notice, not yet struck

    @property
    def remaining(self) -> int:
        """Events not yet due, and noticed kills not yet struck."""
        return self.injector.remaining + len(self.noticed)

    def kill_noticed(self, now: float) -> None:
        """SIGKILL the nodes whose notice has run out (those still alive)."""
        due = [k for k in self.noticed if k.at <= now]
        for kill in due:
            self.noticed.remove(kill)
            # Alive or restarting its workers: a node is killed whatever it is doing.
            nodes = [n for n in kill.nodes if not self.membership.nodes[n].failed]
            for node in nodes:
                self.membership.kill(node, FaultKind.REMOVE.signal)
            if nodes:
                self.event(
                    EventKind.FAULT_INJECTED, nodes=nodes, fault="remove", notice_s=kill.notice_s, origin=kill.origin
                )

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
        if action.notice_s > 0:
            # A preemption notice now, the kill when it runs out (kill_noticed).
            self.noticed.append(
                NoticedKill(tuple(action.nodes), time.time() + action.notice_s, action.notice_s, event.origin)
            )
            if self.notice is not None:
                self.notice(tuple(action.nodes), action.notice_s)
            return
        for node in action.nodes:
            self.membership.kill(node, action.kind.signal)
        self.event(EventKind.FAULT_INJECTED, nodes=list(action.nodes), fault=action.kind.value, origin=event.origin)

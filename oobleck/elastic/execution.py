"""The controller's core: carrying out the strategy's decisions by their kind, one generation each.

``DecisionExecutor`` has no strategy-specific code. On a membership change it asks the strategy
(``oobleck.strategy``) and carries the answer out by its ``Kind`` through ``executors``, the one
table a new kind of decision is added to:

- ``reconfigure`` / ``failover``: take the commit decision of the step in flight (abort it
  unless the workers already committed it), abandon the generation, publish generation g+1 with
  the new plan, the layer copies and the step to redo;
- ``reroute``: the same abort and publication, with no layer copies: the new plan's re-routes send
  a lost stage's microbatches through peer pipelines that already hold its layers (ReCycle);
- ``restart``: the same abort, then every alive node's agent kills its workers and starts fresh
  ones; generation g+1 tells them to load the checkpoint of the step rolled back to (or build the
  seeded initial state at step 0). With ``checkpoint_first`` a checkpoint of the next step
  boundary is written first, while training goes on, so nothing is lost;
- ``continue``: decided before any abort, nothing to do but note the nodes standing by (when a
  node that was not standing by was lost, the strategy's workers carry on by themselves:
  torchft's replicas); decided after the abort, the same plan is published again and the step
  redone;
- ``stop``: end the run with the reason.

How each generation is published and followed until its change is absorbed (and ``redo``, for
what is not a membership change) is ``GenerationPublisher``'s (``oobleck.elastic.publishing``),
which ``DecisionExecutor`` builds on. A restart that checkpoints first whose checkpoint fails (a
storage fault) restarts from the newest checkpoint that completed, and says so. Observers
(``oobleck.elastic.events``) hear of each change, execution and publication.

A preemption notice (``on_notice``) is decided by ``Strategy.on_notice`` and carried out the same
way, before anything is lost: the nodes under notice (``leaving``) are still alive, never part of
a new layout and never restarted. When one of them is killed while the newest published plan does
not use it, nothing is decided: its departure is recorded (``departed``) and the run goes on.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

from oobleck.elastic.events import Continuation, EventKind, Execution
from oobleck.elastic.membership import Changes
from oobleck.elastic.publishing import GenerationPublisher
from oobleck.errors import RunError
from oobleck.planning.outputs import ReconfigurationPlan
from oobleck.strategy import Decision, Kind, RunState

# (decision, the state it was decided on, the step in flight, when acting began, seconds deciding)
Executor = Callable[[Decision, RunState, int, float, float], None]


class DecisionExecutor(GenerationPublisher):
    """Decisions carried out, generations published (see the module docstring)."""

    @functools.cached_property
    def executors(self) -> dict[Kind, Executor]:
        """How each kind of decision is carried out once the step in flight is aborted."""
        return {
            Kind.RECONFIGURE: self._reconfigure,
            Kind.FAILOVER: self._reconfigure,
            Kind.REROUTE: self._reroute,
            Kind.RESTART: self._restart,
            Kind.CONTINUE: self._republish,
            Kind.STOP: self._stop,
        }

    # ------------------------------------------------------------------ decisions
    def state(self, step: int) -> RunState:
        base = self.ledger.layout
        alive = tuple(self.membership.available())
        known = set(base.nodes) | set(base.standby)
        leaving = tuple(sorted(n for n in self.leaving if n in alive))
        return RunState(
            layout=base,
            alive=alive,
            removed=tuple(sorted(n for n in known if n not in alive)),
            # A node under notice that a layout let go is no arrival.
            joined=tuple(sorted(n for n in alive if n not in known and n not in leaving)),
            step=step,
            checkpoint_step=self.checkpoints.latest_step(),
            leaving=leaving,
            notice_s=max((self.leaving[n] for n in leaving), default=0.0),
        )

    def decide(self, state: RunState) -> Decision:
        if self.restarting is not None:
            # The fresh workers of a restart in progress hold nothing yet: only another restart
            # from the same checkpoint can follow.
            fresh = self.strategy.start(state.staying)
            if fresh.kind is Kind.STOP:
                return fresh
            return Decision(
                Kind.RESTART,
                fresh.layout,
                rollback_to_step=self.restarting,
                reason="a change during a restart: restart again",
            )
        return self.strategy.on_change(state)

    def on_change(self, steps: int) -> None:
        """Decide on the nodes lost and joined, and carry the decision out (``_carry_out``)."""
        started = time.time()
        changes = self._without_departed(self.membership.take_changes())
        if not changes:
            return
        for node in changes.removed:
            self.checkpoints.writer_lost(node)
            self.leaving.pop(node, None)
        self.notify("changes_taken", changes, started)
        self._carry_out(self.decide, steps, started, tuple(changes.removed))

    def on_notice(self, nodes: tuple[int, ...], notice_s: float, steps: int) -> None:
        """A preemption notice: ``nodes`` will be killed in ``notice_s`` seconds. The strategy's
        ``on_notice`` decides; the decision is carried out like any other (``_carry_out``)."""
        started = time.time()
        for node in nodes:
            self.leaving[node] = notice_s
        if self.ledger.generation < 0:
            # Before the first plan (a notice due at once): the run starts on the layout decided at
            # launch, and the kill is recovered like a crash.
            self.emit(
                EventKind.NOTICE,
                nodes=list(nodes),
                notice_s=notice_s,
                decision="continue",
                reason="before the first plan",
            )
            return
        state = self.state(self.ledger.next_step)
        decision = self._notice_answer(state)
        self.emit(
            EventKind.NOTICE, nodes=list(nodes), notice_s=notice_s, decision=decision.kind.value, reason=decision.reason
        )
        self._carry_out(self._notice_answer, steps, started, (), guessed=(state, decision))

    def _notice_answer(self, state: RunState) -> Decision:
        decision = self.strategy.on_notice(state)
        layout = decision.layout
        if layout is not None and decision.kind is not Kind.CONTINUE:
            used = sorted(set(layout.nodes) & set(state.leaving))
            if used:
                raise RunError(
                    f"strategy {self.strategy.name} answered a preemption notice with a layout on nodes {used}, "
                    "which are under notice: a new layout must leave them out"
                )
        return decision

    def _without_departed(self, changes: Changes) -> Changes:
        """The changes less the nodes under notice that the newest published plan does not use: their
        kill changes nothing (a layout already let them go), so it is only recorded."""
        newest = self.ledger.generations[self.ledger.generation].layout
        departed = sorted(n for n in changes.removed if n in self.leaving and n not in newest.nodes)
        if not departed:
            return changes
        for node in departed:
            self.leaving.pop(node)
            self.checkpoints.writer_lost(node)
        self.emit(
            EventKind.DEPARTED, nodes=departed, reason="killed after its notice; the running plan does not use it"
        )
        removed = {n: v for n, v in changes.removed.items() if n not in departed}
        return dataclasses.replace(changes, removed=removed)

    def _carry_out(
        self,
        decide: Callable[[RunState], Decision],
        steps: int,
        started: float,
        removed: tuple[int, ...],
        *,
        guessed: tuple[RunState, Decision] | None = None,
    ) -> None:
        """Decisions that leave the step in flight alone (continue; a restart that checkpoints
        first) are carried out at once; any other aborts that step first and is decided again if
        the abort changed the state. ``guessed``: a state and its decision already made."""
        ledger = self.ledger
        if guessed is None:
            before = self.state(ledger.next_step)
            guessed = (before, decide(before))
        before, guess = guessed
        if guess.kind is Kind.CONTINUE:
            self._continue(guess, removed, started)
            return
        if guess.kind is Kind.RESTART and guess.checkpoint_first and self.restarting is None:
            self._plan_restart(guess)
            return
        self.planned = None  # a planned restart is overtaken by this change
        step = ledger.take_in_flight()
        if step >= steps:
            return
        ledger.count_attempt(step)
        ledger.abandon(ledger.generation)
        state = self.state(step)
        # Commits may have landed (or a generation been established) while the guess was made.
        decision = guess if state == before else decide(state)
        self.executors[decision.kind](decision, state, step, started, time.time() - started)

    def _continue(self, decision: Decision, removed: tuple[int, ...], started: float) -> None:
        ledger = self.ledger
        generation = ledger.generations[ledger.base if ledger.base >= 0 else ledger.generation]
        lost = tuple(sorted(n for n in removed if n not in generation.layout.standby))
        if decision.layout is not None:
            if decision.layout.plan != generation.layout.plan:
                raise RunError(f"strategy {self.strategy.name} answered 'continue' with a different plan")
            generation.layout = decision.layout
        if lost and self.absorbing is None:
            self.absorbing = (ledger.generation, ledger.next_step)
        elif not lost and decision.reason:
            standby = list(decision.layout.standby) if decision.layout else []
            self.emit(EventKind.STANDBY, nodes=standby, reason=decision.reason)
        self.notify("continued", Continuation(decision, lost, ledger.generation, ledger.next_step, started))

    def _republish(self, decision: Decision, state: RunState, step: int, started: float, plan_s: float) -> None:
        """A ``continue`` decided after the abort: the step in flight is redone on the same plan."""
        plan = state.layout.plan
        reconfiguration = ReconfigurationPlan(plan, plan, (), (), ())
        self.publish(
            self.ledger.generation + 1, state.layout, step, reconfiguration=reconfiguration, decision=Kind.CONTINUE
        )

    def _stop(self, decision: Decision, state: RunState, step: int, started: float, plan_s: float) -> None:
        raise RunError(f"cannot continue training (lost nodes {list(state.removed)}): {decision.reason}")

    def _execute(self, execution: Execution, **publish: Any) -> None:
        """Tell the observers, then publish the execution's generation; the change is absorbed
        once its first step commits."""
        assert execution.decision.layout is not None
        self.notify("executing", execution)
        self.publish(
            execution.generation,
            execution.decision.layout,
            execution.resume_step,
            decision=execution.kind,
            **publish,
        )
        self.absorbing = (execution.generation, execution.resume_step)

    def _reconfigure(self, decision: Decision, state: RunState, step: int, started: float, plan_s: float) -> None:
        layout = decision.layout
        assert layout is not None
        if step == 0:
            # Nothing has committed: every layer is still its seeded initial state, which each
            # worker builds itself. Copying it would need its holders in the first plan to have
            # built it, and a worker slow to start may never have seen that plan.
            decision = dataclasses.replace(decision, transfers=())
        reconfiguration = ReconfigurationPlan(
            state.layout.plan, layout.plan, state.removed, state.joined, tuple(decision.transfers)
        )
        execution = Execution(
            decision, state, generation=self.ledger.generation + 1, resume_step=step, started=started, plan_s=plan_s
        )
        self._execute(execution, reconfiguration=reconfiguration)

    def _reroute(self, decision: Decision, state: RunState, step: int, started: float, plan_s: float) -> None:
        """A re-route moves no state: a reconfiguration whose layer copies are none (every worker of
        the new plan holds exactly the layers it held)."""
        layout = decision.layout
        assert layout is not None and not decision.transfers
        old_layers = {a.worker: a.held_layers for a in state.layout.plan.assignments()}
        for assignment in layout.plan.assignments():
            if old_layers.get(assignment.worker) != assignment.held_layers:
                raise RunError(
                    f"strategy {self.strategy.name}: a reroute must leave every worker its layers, but "
                    f"{assignment.worker} would hold {list(assignment.held_layers)} instead of "
                    f"{list(old_layers.get(assignment.worker, ()))}"
                )
        self._reconfigure(decision, state, step, started, plan_s)

    def _plan_restart(self, decision: Decision) -> None:
        """A restart that loses nothing: checkpoint the next step boundary first, then restart."""
        boundary = self.ledger.next_step + 1
        self.checkpoints.request(boundary)
        self.planned = (decision, boundary)
        self.emit(EventKind.RESTART_PLANNED, checkpoint_step=boundary, reason=decision.reason)

    def restart_if_checkpointed(self) -> None:
        """Carry out a planned restart once its checkpoint is complete (training stopped at it); if
        that checkpoint failed, from the newest one that completed, saying so."""
        if self.planned is None:
            return
        decision, rollback = self.planned
        note = ""
        if rollback in self.checkpoints.failed:
            failed, rollback = rollback, self.checkpoints.latest_step() or 0
            note = (
                f"the checkpoint of step {failed} it was to restart from failed ({self.checkpoints.failed[failed]}); "
                f"restarting from step {rollback}, the newest that completed"
            )
        elif rollback not in self.checkpoints.completed:
            return
        self.planned = None
        started = time.time()
        step = self.ledger.take_in_flight()
        self.ledger.abandon(self.ledger.generation)
        decision = dataclasses.replace(decision, checkpoint_first=False, rollback_to_step=rollback)
        self._restart(decision, self.state(step), step, started, 0.0, note=note)

    def _restart(
        self, decision: Decision, state: RunState, step: int, started: float, plan_s: float, *, note: str = ""
    ) -> None:
        ledger, membership, checkpoints = self.ledger, self.membership, self.checkpoints
        rollback = decision.rollback_to_step if decision.rollback_to_step is not None else step
        if rollback > 0 and rollback not in checkpoints.completed:
            raise RunError(f"cannot restart from the checkpoint of step {rollback}: it is not complete")
        failed = sorted(b for b in checkpoints.failed if rollback < b <= step)
        if failed and not note:
            note = (
                f"restarting from step {rollback}, the newest checkpoint that completed; the checkpoint of step "
                f"{failed[-1]} failed ({checkpoints.failed[failed[-1]]})"
            )
        if note:
            print(f"oobleck: warning: {note}", flush=True)
        checkpoints.discard_after(rollback)
        lost = ledger.roll_back(rollback)
        # Nodes under notice keep their workers: no layout uses them, and they are about to go.
        alive = tuple(n for n in membership.available() if n not in self.leaving)
        membership.restart_workers(list(alive))
        execution = Execution(
            decision,
            state,
            generation=ledger.generation + 1,
            resume_step=rollback,
            started=started,
            plan_s=plan_s,
            rolled_back_steps=lost,
            restart_nodes=alive,
            note=note,
        )
        checkpoint = str(checkpoints.path(rollback)) if rollback > 0 else None
        self._execute(execution, checkpoint=checkpoint)
        self.restarting_from(rollback)

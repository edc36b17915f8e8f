"""The controller: one run's store, its loop, and the execution of the strategy's decisions.

It hosts torch's TCPStore (C++, bound to ``cluster.master_addr``) that every worker talks to and
ties together what each part owns:

- ``Membership`` (agents, workers, failures, heartbeats) reports nodes lost and joined;
- the ``StepLedger`` records each step the workers commit, and the generations (its
  ``DecisionWatch`` wakes the loop as each step is decided, so the loop does not poll for it);
- ``FaultFiring`` carries out the scheduled faults;
- ``CheckpointCoordinator`` completes the checkpoints the workers write;
- the strategy (``oobleck.strategy``) decides what a membership change means, and this module
  *executes* the decision by its kind, with no strategy-specific code:

  - ``reconfigure`` / ``failover``: take the commit decision of the step in flight (abort it
    unless the workers already committed it), abandon the generation, publish generation g+1
    with the new plan, the layer copies and the step to redo;
  - ``restart``: the same abort, then every alive node's agent kills its workers and starts
    fresh ones; generation g+1 tells them to load the checkpoint of the step rolled back to
    (or build the seeded initial state at step 0). With ``checkpoint_first`` a checkpoint of the
    next step boundary is written first, while training goes on, so nothing is lost;
  - ``continue``: nothing to do but note the nodes standing by; when a node that was not
    standing by was lost, the strategy's workers carry on by themselves (torchft's replicas):
    a ``continue`` recovery measures the time from the loss to the next committed step;
    ``stop``: end the run with the reason.

The strategy's run-long services (``Strategy.services``) are started before any node and stopped
after the workers; what they yield is published under ``keys.SERVICES``.

Only the controller writes outputs (plan.json, metrics.csv, events.csv, summary.json, wandb).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from oobleck.elastic.checkpoints import CheckpointCoordinator
from oobleck.elastic.firing import FaultFiring
from oobleck.elastic.ledger import DecisionWatch, Outcome, StepLedger
from oobleck.elastic.membership import Membership
from oobleck.elastic.protocol import new_run_id, new_secret
from oobleck.errors import EXIT_REQUEUE, OobleckError, RunError, Stopped
from oobleck.faults.injector import Injector
from oobleck.faults.schedule import FaultEvent
from oobleck.planning.outputs import ExecutionPlan, ReconfigurationPlan, tolerated_failures
from oobleck.runtime import keys
from oobleck.strategy import Decision, Kind, Layout, RunInfo, RunState, Strategy, checkpoint_every_steps

# How long the loop sleeps between looks: briefly while it polls the store for something only
# polling shows (a generation being established, checkpoint shards being reported, a recovery in
# progress), longer in steady training, where the agents' messages and the decision watch wake it
# (each tick costs the controller ~0.2 ms of CPU, taken from the workers on a small machine).
LOOP_TICK_S = 0.002
STEADY_TICK_S = 0.02
# The decision watch wakes the loop as a step is decided; this poll only bounds the wait for a
# commit should a wake ever be missed.
COMMIT_POLL_S = 0.25
STOP_GRACE_S = 5.0

__all__ = ["Controller", "Outcome", "summarize"]


@dataclass
class Recovery:
    """One decision carried out after a membership change, filled in as its phases complete."""

    kind: str  # reconfiguration | failover | restart | continue
    generation: int
    reason: str  # what caused it: failure | join
    decision: str  # the strategy's reason for what it decided
    removed: tuple[int, ...]
    joined: tuple[int, ...]
    failure_time: float  # wall clock of the earliest cause (kill, or join ready)
    detect_s: float
    plan_s: float
    started: float  # wall clock when the controller began acting
    resume_step: int
    bytes_moved: int
    rolled_back_steps: int = 0
    restart_nodes: tuple[int, ...] = ()
    spawned_at: float | None = None  # restart: every fresh worker registered


class Controller:
    """Runs one training job on a set of node agents (see the module docstring)."""

    def __init__(
        self,
        cfg: Any,
        config_dict: dict[str, Any],
        *,
        strategy: Strategy,
        initial: Decision,
        run_dir: str | Path,
        recorder: Any = None,
        schedule: tuple[FaultEvent, ...] = (),
        resume: Any = None,
        run_id: str | None = None,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        fork_server: Any = None,
    ) -> None:
        self.cfg = cfg
        self.config_dict = config_dict
        self.strategy = strategy
        self.initial = initial
        self.run_dir = Path(run_dir)
        self.recorder = recorder
        self.schedule = schedule
        self.resume = resume  # the checkpoint to resume from (oobleck.checkpoint.Checkpoint)
        self.run_id = run_id or new_run_id()
        self.fork_server = fork_server  # forks the local workers (launch starts it, see forks_workers); None: exec them
        self.secret = new_secret()
        self.on_event = on_event
        # Called with each committed step's row, in the controller's loop (tools and benchmarks
        # watch the run with it; keep it cheap).
        self.on_step: Callable[[dict[str, Any]], None] | None = None
        self.steps = int(cfg.job.steps)
        self.layer_bytes = strategy.context.layer_param_bytes
        self.store: Any = None
        self.membership: Membership | None = None
        self.ledger: StepLedger | None = None
        self.decisions: DecisionWatch | None = None
        self._next_commit_poll = 0.0
        self.checkpoints: CheckpointCoordinator | None = None
        self.firing: FaultFiring | None = None
        self.train_started: float | None = None
        self.recovery: Recovery | None = None
        self.causes: list[float] = []  # cause times of the changes the next recovery absorbs
        self.detects: list[float] = []
        self.restart_pending: int | None = None  # rollback step of a restart not yet established
        self.planned: tuple[Decision, int] | None = None  # a restart waiting for its checkpoint
        self.tolerance: int | None = None
        self.finished = False
        self.stop_requested: tuple[str, int] | None = None  # (why, exit code)
        self.checkpoint_stop: str | None = None  # why: checkpoint the next boundary, then stop
        self.checkpoint_stop_at: int | None = None
        self._outcome = Outcome()
        self._services = contextlib.ExitStack()  # the strategy's run-long services

    # ------------------------------------------------------------------ outputs
    @property
    def outcome(self) -> Outcome:
        return self.ledger.outcome if self.ledger is not None else self._outcome

    def _event(self, kind: str, **fields: Any) -> None:
        if self.ledger is not None:
            fields.setdefault("step", self.ledger.next_step)
            fields.setdefault("generation", self.ledger.generation)
        if self.recorder is not None:
            self.recorder.event(kind, **fields)
        if self.on_event is not None:
            self.on_event(kind, fields)

    def _on_step(self, row: dict[str, Any]) -> None:
        if self.recorder is not None:
            self.recorder.step(**row)
        if self.on_step is not None:
            self.on_step(row)

    # ------------------------------------------------------------------ start-up
    def _start_store(self) -> None:
        cluster = self.cfg.cluster
        # The store listens where the config says (loopback for local runs), not on every
        # interface: bind the socket here and hand it to the C++ server.
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((cluster.master_addr, int(cluster.master_port)))
            listener.listen(256)
            self.store = dist.TCPStore(
                cluster.master_addr,
                listener.getsockname()[1],
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=float(cluster.startup_timeout_s)),
                master_listen_fd=listener.fileno(),
                use_libuv=True,  # the classic server does not wake waiters on compare_set
            )
        except Exception as error:
            listener.close()
            raise RunError(
                f"cannot host the store on {cluster.master_addr}:{cluster.master_port} ({error}); "
                "the port is probably in use: set cluster.master_port=<free port> or 0 to pick one"
            ) from None
        listener.detach()  # the server owns the descriptor now (and closes it when the store goes)
        self.store.set(keys.CONFIG, json.dumps(self.config_dict))

    def _store_client(self) -> dist.TCPStore:
        """A connection of the controller's own to its store, for a thread that blocks on it."""
        timeout = timedelta(seconds=float(self.cfg.cluster.startup_timeout_s))
        return dist.TCPStore(
            self.cfg.cluster.master_addr, self.store.port, is_master=False, wait_for_workers=False, timeout=timeout
        )

    @property
    def store_address(self) -> str:
        return f"{self.cfg.cluster.master_addr}:{self.store.port}"

    def run(self) -> Outcome:
        try:
            self._start_store()
            self.ledger = StepLedger(self.store, self.steps, int(self.cfg.job.global_batch_size), on_step=self._on_step)
            self.membership = Membership(
                self.cfg,
                self.store,
                self.store_address,
                secret=self.secret,
                run_id=self.run_id,
                worker_module=self.strategy.worker_module,
                event=self._event,
                run_finished=self._run_finished,
            )
            self.membership.listen()
            self.decisions = DecisionWatch(self._store_client(), self.membership.wake, dist.DistStoreError)
            self.checkpoints = CheckpointCoordinator(
                self.cfg,
                self.run_dir,
                self.store,
                checkpoint_every_steps(self.cfg, self.strategy.config),
                event=self._event,
                extra={"strategy": self.strategy.name, "run_id": self.run_id, "rng": _RNG_NOTE},
            )
            self.checkpoints.completed_rows = self.ledger.outcome.checkpoints
            self.firing = FaultFiring(
                Injector(list(self.schedule), seed=int(self.cfg.failures.seed)),
                self.store,
                self.membership,
                self._event,
                secret=self.secret,
            )
            self.firing.next_node_id = int(self.cfg.cluster.nodes)
            run = RunInfo(
                str(self.cfg.cluster.master_addr), self.store_address, self.run_id, self.run_dir, self.config_dict
            )
            self.store.set(keys.SERVICES, json.dumps(self._services.enter_context(self.strategy.services(run))))
            self.membership.launcher = self._launcher()
            for node in range(int(self.cfg.cluster.nodes)):
                self.membership.start_node(node)
            self._wait_up()
            self._publish_initial()
            self._loop()
            return self.outcome
        except OobleckError as error:
            self.outcome.stopped = str(error)
            self._event("stop", reason=str(error).splitlines()[0][:300])
            raise
        finally:
            self._shutdown()
            self._services.close()  # after the workers, which may use the services until they exit

    def _launcher(self) -> Any:
        assert self.membership is not None
        if self.cfg.cluster.kind == "local":
            from oobleck.elastic.local import LocalLauncher

            return LocalLauncher(self.membership.agent_address, self.run_id, self.secret, fork_server=self.fork_server)
        if self.cfg.cluster.kind == "slurm":
            from oobleck.elastic.slurm import SlurmLauncher  # one agent job step per node

            return SlurmLauncher(self.membership.agent_address, self.run_id, self.secret)
        return None

    def _wait_up(self) -> None:
        membership = self.membership
        assert membership is not None
        deadline = time.monotonic() + float(self.cfg.cluster.startup_timeout_s)
        wanted = set(range(int(self.cfg.cluster.nodes)))
        while not all(membership.nodes[n].up for n in wanted):
            if time.monotonic() > deadline:
                missing = sorted(n for n in wanted if not membership.nodes[n].up)
                raise RunError(
                    f"nodes {missing} did not start within cluster.startup_timeout_s={self.cfg.cluster.startup_timeout_s}; "
                    "check that agents can reach the controller"
                )
            membership.drain(LOOP_TICK_S * 5)
            for n in wanted:
                if membership.nodes[n].failed:
                    raise RunError(f"node {n} failed while starting (its agent or a worker exited)")
        membership.take_changes()  # nodes that came up before the first plan are not joins
        membership.accepting_joins = True

    def _publish_initial(self) -> None:
        assert self.membership is not None and self.checkpoints is not None
        decision = self.initial
        alive = self.membership.alive()
        if decision.layout is None or not set(decision.layout.nodes) <= set(alive):
            decision = self.strategy.start(alive)  # the nodes that came up differ from the plan's
        if decision.kind is Kind.STOP:
            raise RunError(f"strategy {self.strategy.name} cannot start on nodes {alive}: {decision.reason}")
        layout = decision.layout
        assert layout is not None
        if self.recorder is not None:
            templates = self.strategy.context.generated_templates()
            self.recorder.write_plan(
                {
                    "templates": templates.to_dict() if templates is not None else None,
                    "plan": layout.plan.to_dict(),
                    "layout": layout.description,
                    "strategy": self.strategy.name,
                }
            )
        resume_step, checkpoint = 0, None
        if self.resume is not None:
            resume_step, checkpoint = self.resume.step, str(self.resume.step_dir)
            self.checkpoints.adopt(resume_step, self.resume.step_dir)
            assert self.ledger is not None
            self.ledger.next_step = resume_step
            skipped = [entry.describe() for entry in self.resume.skipped]
            self._event("resume", checkpoint=checkpoint, resume_step=resume_step, skipped="; ".join(skipped))
            for line in skipped:
                print(f"oobleck: warning: {line}", flush=True)
        self._fire_faults()
        self._publish(0, layout, resume_step, checkpoint=checkpoint)
        self.train_started = time.time()
        assert self.ledger is not None
        self.ledger.last_commit_time = self.train_started

    def _publish(
        self,
        generation: int,
        layout: Layout,
        resume: int,
        *,
        reconfiguration: ReconfigurationPlan | None = None,
        checkpoint: str | None = None,
    ) -> None:
        assert self.ledger is not None and self.checkpoints is not None and self.membership is not None
        document = {
            "generation": generation,
            "plan": layout.plan.to_dict(),
            "reconfiguration": reconfiguration.to_dict() if reconfiguration is not None else None,
            "resume_step": resume,
            "load_checkpoint": checkpoint,
            "incarnations": {str(n): s.incarnation for n, s in self.membership.nodes.items()},
            "checkpoint": self.checkpoints.document(layout.plan, self.layer_bytes),
        }
        self.ledger.publish(generation, layout, resume)
        self.store.set(keys.plan(generation), json.dumps(document))
        self.store.set(keys.GEN, str(generation))
        self._report_tolerance(layout.plan)

    def _report_tolerance(self, plan: ExecutionPlan) -> None:
        if not self.strategy.tolerates_in_place:
            return
        tolerated, wanted = tolerated_failures(plan), int(self.cfg.job.fault_tolerance)
        if tolerated < wanted and tolerated != self.tolerance:
            self._event("fault_tolerance_reduced", tolerated=tolerated, wanted=wanted, pipelines=len(plan.pipelines))
            self.outcome.fault_tolerance.append(
                {"step": self.ledger.next_step if self.ledger else 0, "tolerated": tolerated, "wanted": wanted}
            )
            print(
                f"oobleck: warning: the plan now survives only {tolerated} simultaneous node failure(s), not job.fault_tolerance={wanted}",
                flush=True,
            )
        self.tolerance = tolerated

    # ------------------------------------------------------------------ the loop
    def _run_finished(self) -> bool:
        assert self.ledger is not None
        if self.finished:
            return True
        self.ledger.check_commits()
        return self.ledger.next_step >= self.steps

    def _loop(self) -> None:
        ledger, membership, checkpoints = self.ledger, self.membership, self.checkpoints
        assert ledger is not None and membership is not None and checkpoints is not None
        while ledger.next_step < self.steps:
            membership.drain(self._tick())
            membership.check_heartbeats()
            self._check_workers()
            self._check_established()
            self._check_commits()
            self._after_commits()
            if ledger.next_step >= self.steps:
                break
            self._check_stop_requests()
            self._fire_faults()
            if membership.pending() and (membership.lost_pending() or not membership.booting()):
                self._on_change()
            elif self.planned is not None and self.planned[1] in checkpoints.completed:
                self._restart(self.planned[0], self.planned[1])
        self.finished = True
        self._report_unfinished_schedule()

    def _tick(self) -> float:
        ledger, membership, checkpoints = self.ledger, self.membership, self.checkpoints
        assert ledger is not None and membership is not None and checkpoints is not None
        polling = ledger.establishing() or checkpoints.pending or self.recovery is not None or membership.pending()
        return LOOP_TICK_S if polling else STEADY_TICK_S

    def _check_commits(self) -> None:
        """Record the steps decided since the last look: when the decision watch saw one, or
        every ``COMMIT_POLL_S`` (not every tick: each look is a store round trip)."""
        ledger, decisions = self.ledger, self.decisions
        assert ledger is not None and decisions is not None
        now = time.monotonic()
        if decisions.take() or now >= self._next_commit_poll:
            ledger.check_commits()
            self._next_commit_poll = now + COMMIT_POLL_S
        decisions.follow(ledger.awaited())

    def _after_commits(self) -> None:
        ledger, checkpoints = self.ledger, self.checkpoints
        assert ledger is not None and checkpoints is not None
        while ledger.checkpoint_boundaries:
            generation, boundary = ledger.checkpoint_boundaries.pop(0)
            document = json.loads(self.store.get(keys.plan(generation)))
            checkpoints.noticed(generation, boundary, document["checkpoint"]["writers"])
            if self.planned is not None and boundary >= self.planned[1] and generation == ledger.generation:
                # A planned restart: stop training at this boundary, so nothing after it is lost,
                # while the checkpoint completes in the background.
                self.planned = (self.planned[0], boundary)
                ledger.take_in_flight()
                ledger.abandon(generation)
        checkpoints.poll()
        checkpoints.maybe_request_by_time(ledger.next_step)
        recovery = self.recovery
        if (
            recovery is not None
            and ledger.generation == recovery.generation
            and ledger.next_step > recovery.resume_step
        ):
            self._finish_recovery()

    def _check_workers(self) -> None:
        """Frozen workers fail their nodes; so do the ranks a timed-out collective waited on."""
        ledger, membership = self.ledger, self.membership
        assert ledger is not None and membership is not None
        plan = ledger.generations[ledger.generation].layout.plan
        verdict = membership.check_workers(ledger.generation, {a.worker: a.rank for a in plan.assignments()})
        if verdict is None or membership.lost_pending():
            return
        timeout = self.cfg.cluster.collective_timeout_s
        workers = {a.rank: a.worker for a in plan.assignments()}
        if not verdict.culprits:
            raise RunError(
                f"generation {ledger.generation}: rank {verdict.waiter} waited {verdict.waited_s:.1f} s for {verdict.what}, "
                f"past cluster.collective_timeout_s={timeout}, and every rank it waits on waits on another: no rank to blame"
            )
        now = time.time()
        for rank in verdict.culprits:
            node, local_rank = workers[rank]
            membership.node_failed(
                node,
                f"worker {local_rank} (rank {rank}) did not answer: rank {verdict.waiter} waited {verdict.waited_s:.1f} s "
                f"for {verdict.what} (cluster.collective_timeout_s={timeout})",
                now,
                cause=now - verdict.waited_s,
            )

    def _check_established(self) -> None:
        assert self.ledger is not None
        generation = self.ledger.check_established()
        if generation is not None and self.restart_pending is not None and generation.number == self.ledger.generation:
            self.restart_pending = None

    def _report_unfinished_schedule(self) -> None:
        """Say so when the run ended before joining nodes were up or scheduled events were due."""
        assert self.membership is not None and self.firing is not None and self.ledger is not None
        layout = self.ledger.layout
        waiting = sorted(n for n, s in self.membership.nodes.items() if not s.failed and not s.up)
        if waiting:
            self.outcome.joins_not_absorbed = waiting
            self._event(
                "join_not_absorbed",
                nodes=waiting,
                reason="the run ended before these nodes were up (a worker takes seconds to start); join earlier or run more steps",
            )
        if layout.standby:
            self._event("standby_at_end", nodes=list(layout.standby))
        unfired = self.firing.unfired()
        if self.firing.remaining or unfired:
            self.outcome.events_not_applied = self.firing.remaining + len(unfired)
            self._event(
                "schedule_not_finished",
                remaining_events=self.firing.remaining,
                armed_not_fired="; ".join(f"{e.origin} (phase {e.phase})" for e in unfired),
            )

    def _fire_faults(self) -> None:
        membership, firing, ledger = self.membership, self.firing, self.ledger
        assert membership is not None and firing is not None and ledger is not None
        if not firing.remaining:
            return
        # Events apply in order, each after the previous change is absorbed (joining nodes up and
        # in the plan, the recovery's first step committed).
        busy = (
            membership.booting()
            or membership.striking()
            or membership.pending()
            or self.recovery is not None
            or self.planned is not None
        )
        if busy:
            return
        elapsed = time.time() - self.train_started if self.train_started else 0.0
        firing.fire_due(ledger.next_step, elapsed, ledger.generation)

    # ------------------------------------------------------------------ decisions
    def _state(self, step: int) -> RunState:
        assert self.ledger is not None and self.membership is not None and self.checkpoints is not None
        base = self.ledger.layout
        alive = tuple(self.membership.available())
        known = set(base.nodes) | set(base.standby)
        return RunState(
            layout=base,
            alive=alive,
            removed=tuple(sorted(n for n in known if n not in alive)),
            joined=tuple(sorted(n for n in alive if n not in known)),
            step=step,
            checkpoint_step=self.checkpoints.latest_step(),
        )

    def _decide(self, state: RunState) -> Decision:
        if self.restart_pending is not None:
            # The fresh workers of a restart in progress hold nothing yet: only another restart
            # from the same checkpoint can follow.
            fresh = self.strategy.start(state.alive)
            if fresh.kind is Kind.STOP:
                return fresh
            return Decision(
                Kind.RESTART,
                fresh.layout,
                rollback_to_step=self.restart_pending,
                reason="a change during a restart: restart again",
            )
        return self.strategy.on_change(state)

    def _on_change(self) -> None:
        ledger, membership, checkpoints = self.ledger, self.membership, self.checkpoints
        assert ledger is not None and membership is not None and checkpoints is not None
        started = time.time()
        changes = membership.take_changes()
        for node in changes.removed:
            checkpoints.writer_lost(node)
        self.causes += [cause for cause, _ in changes.removed.values()] + list(changes.joined.values())
        self.detects += [detect for _, detect in changes.removed.values()]
        guessed = self._state(ledger.next_step)
        guess = self._decide(guessed)
        if guess.kind is Kind.CONTINUE:
            self._continue(guess, tuple(changes.removed), started)
            return
        if guess.kind is Kind.RESTART and guess.checkpoint_first and self.restart_pending is None:
            self._plan_restart(guess)
            return
        self.planned = None  # a planned restart is overtaken by this change
        step = ledger.take_in_flight()
        if step >= self.steps:
            return
        ledger.count_attempt(step)
        ledger.abandon(ledger.generation)
        state = self._state(step)
        # Commits may have landed (or a generation been established) while the guess was made.
        decision = guess if state == guessed else self._decide(state)
        plan_s = time.time() - started
        if decision.kind is Kind.STOP:
            raise RunError(f"cannot continue training (lost nodes {list(state.removed)}): {decision.reason}")
        if decision.kind is Kind.CONTINUE:
            # The abort was for nothing (the step in flight is redone on the same plan).
            self._republish(state, step)
            return
        if decision.kind is Kind.RESTART:
            self._restart(
                decision,
                decision.rollback_to_step if decision.rollback_to_step is not None else step,
                state=state,
                plan_s=plan_s,
            )
            return
        self._reconfigure(decision, state, step, plan_s)

    def _continue(self, decision: Decision, removed: tuple[int, ...] = (), started: float = 0.0) -> None:
        assert self.ledger is not None
        generation = self.ledger.generations[self.ledger.base if self.ledger.base >= 0 else self.ledger.generation]
        lost = tuple(sorted(n for n in removed if n not in generation.layout.standby))
        if decision.layout is not None:
            if decision.layout.plan != generation.layout.plan:
                raise RunError(f"strategy {self.strategy.name} answered 'continue' with a different plan")
            generation.layout = decision.layout
        if lost and self.recovery is not None:  # lost before the workers recovered from the last loss
            self.recovery.removed = tuple(sorted({*self.recovery.removed, *lost}))
        elif lost:
            # A node doing work was lost and the strategy's own workers carry on (they heal in
            # place, e.g. torchft): the recovery lasts until the next committed step.
            self.recovery = Recovery(
                kind="continue",
                generation=self.ledger.generation,
                reason="failure",
                decision=decision.reason,
                removed=lost,
                joined=(),
                failure_time=min(self.causes, default=started),
                detect_s=max(self.detects, default=0.0),
                plan_s=time.time() - started,
                started=started,
                resume_step=self.ledger.next_step,
                bytes_moved=0,
            )
        elif decision.reason:
            self._event(
                "standby", nodes=list(decision.layout.standby) if decision.layout else [], reason=decision.reason
            )
        self.causes.clear()
        self.detects.clear()

    def _republish(self, state: RunState, step: int) -> None:
        assert self.ledger is not None
        layout = state.layout
        self._publish(
            self.ledger.generation + 1,
            layout,
            step,
            reconfiguration=ReconfigurationPlan(layout.plan, layout.plan, (), (), ()),
        )

    def _recovery(
        self, kind: str, decision: Decision, state: RunState, resume: int, plan_s: float, started: float
    ) -> Recovery:
        assert self.ledger is not None
        carried = 0
        removed, joined = set(state.removed), set(state.joined)
        if self.recovery is not None:
            self._event(
                f"{self.recovery.kind}_superseded",
                superseded_generation=self.recovery.generation,
                by=self.ledger.generation + 1,
            )
            self.causes.append(self.recovery.failure_time)
            carried = self.recovery.rolled_back_steps  # steps the superseded restart already rolled back
            # This recovery absorbs the superseded one's changes too (its generation may have been
            # established, so they are no longer in the state's difference from the base layout).
            removed |= set(self.recovery.removed)
            joined |= set(self.recovery.joined) - removed
        recovery = Recovery(
            kind=kind,
            generation=self.ledger.generation + 1,
            reason="failure" if removed else "join",
            decision=decision.reason,
            removed=tuple(sorted(removed)),
            joined=tuple(sorted(joined)),
            failure_time=min(self.causes) if self.causes else started,
            detect_s=max(self.detects) if self.detects else 0.0,
            plan_s=plan_s,
            started=started,
            resume_step=resume,
            bytes_moved=decision.bytes_moved,
            rolled_back_steps=carried,
        )
        self.causes.clear()
        self.detects.clear()
        return recovery

    def _reconfigure(self, decision: Decision, state: RunState, step: int, plan_s: float) -> None:
        assert self.ledger is not None and decision.layout is not None
        started = time.time() - plan_s
        transfers = decision.transfers
        if step == 0:
            # Nothing has committed: every layer is still its seeded initial state, which each
            # worker builds itself. Copying it would need its holders in the first plan to have
            # built it, and a worker slow to start may never have seen that plan.
            transfers = ()
        reconfiguration = ReconfigurationPlan(
            state.layout.plan, decision.layout.plan, state.removed, state.joined, tuple(transfers)
        )
        kind = "failover" if decision.kind is Kind.FAILOVER else "reconfiguration"
        recovery = self._recovery(
            kind, dataclasses.replace(decision, transfers=tuple(transfers)), state, step, plan_s, started
        )
        self._publish(self.ledger.generation + 1, decision.layout, step, reconfiguration=reconfiguration)
        self.recovery = recovery

    def _plan_restart(self, decision: Decision) -> None:
        """A restart that loses nothing: checkpoint the next step boundary first, then restart."""
        assert self.ledger is not None and self.checkpoints is not None
        boundary = self.ledger.next_step + 1
        self.checkpoints.request(boundary)
        self.planned = (decision, boundary)
        self._event("restart_planned", checkpoint_step=boundary, reason=decision.reason)

    def _restart(
        self, decision: Decision, rollback: int, *, state: RunState | None = None, plan_s: float = 0.0
    ) -> None:
        ledger, membership, checkpoints = self.ledger, self.membership, self.checkpoints
        assert ledger is not None and membership is not None and checkpoints is not None and decision.layout is not None
        started = time.time() - plan_s
        if state is None:  # a planned restart: its checkpoint is complete (training stopped at it)
            self.planned = None
            step = ledger.take_in_flight()
            ledger.abandon(ledger.generation)
            state = self._state(step)
            decision = dataclasses.replace(decision, checkpoint_first=False, rollback_to_step=rollback)
        if rollback > 0 and rollback not in checkpoints.completed:
            raise RunError(f"cannot restart from the checkpoint of step {rollback}: it is not complete")
        checkpoints.discard_after(rollback)
        lost = ledger.roll_back(rollback)
        alive = list(membership.available())
        membership.restart_workers(alive)
        recovery = self._recovery("restart", decision, state, rollback, plan_s, started)
        recovery.rolled_back_steps += lost
        recovery.restart_nodes = tuple(alive)
        checkpoint = str(checkpoints.path(rollback)) if rollback > 0 else None
        self._publish(ledger.generation + 1, decision.layout, rollback, checkpoint=checkpoint)
        self.recovery = recovery
        self.restart_pending = rollback

    def _finish_recovery(self) -> None:
        assert self.ledger is not None and self.membership is not None
        r = self.recovery
        assert r is not None
        now = time.time()
        generation = self.ledger.generations[r.generation]
        established = generation.established_at or now
        timings = generation.timings
        if r.kind == "continue":  # no new generation was established: nothing was rebuilt
            established, timings = r.started, []
        row: dict[str, Any] = {
            "generation": r.generation,
            "reason": r.reason,
            "decision": r.decision,
            "removed": list(r.removed),
            "joined": list(r.joined),
            "resume_step": r.resume_step,
            "detect_s": round(r.detect_s, 4),
            "plan_s": round(r.plan_s, 4),
            "groups_s": round(max((t["groups_s"] for t in timings), default=0.0), 4),
            "state_copy_s": round(max((t["state_copy_s"] for t in timings), default=0.0), 4),
            "bytes_moved": r.bytes_moved,
            "first_step_s": round(now - established, 4),
            "total_s": round(now - r.failure_time, 4),
            "replicas_identical": generation.replicas_identical,
        }
        # How fast the busiest receiver took its layers in, and (runtime.link_probe_mb > 0) the
        # raw gloo send/recv rate of the same channels just before, into the same memory again and
        # into fresh memory like the copy's (oobleck.runtime.transfer.probe_links).
        rates = [t["bytes_in"] / t["state_copy_s"] for t in timings if t.get("bytes_in") and t["state_copy_s"] > 0]
        if rates:
            row["copy_bytes_per_s"] = round(max(rates))
            # The receivers' own copy time: a source's clock starts when its own link probes end,
            # so state_copy_s (the max over every rank) also counts a source waiting for its
            # receiver to finish probing other channels.
            row["receiver_copy_s"] = round(max(t["state_copy_s"] for t in timings if t.get("bytes_in")), 4)
            # runtime.prefault_copies: the receivers' background allocation of their incoming
            # state (seconds on that thread), and the part of it the copy still waited for.
            row["prefault_s"] = round(max(t.get("prefault_s", 0.0) for t in timings if t.get("bytes_in")), 4)
            row["prefault_wait_s"] = round(max(t.get("prefault_wait_s", 0.0) for t in timings if t.get("bytes_in")), 4)
        for key in ("link_probe_bytes_per_s", "link_probe_cold_bytes_per_s"):
            probes = [rate for t in timings for rate in (t.get(key) or {}).values()]
            if probes:
                row[key] = round(statistics.median(probes))
        if r.kind == "restart":
            nodes = [self.membership.nodes[n] for n in r.restart_nodes]
            row["rolled_back_steps"] = r.rolled_back_steps
            row["stop_s"] = round(max((s.old_exited_at - r.started for s in nodes if s.old_exited_at), default=0.0), 4)
            row["spawn_s"] = round(max((s.registered_at - r.started for s in nodes if s.registered_at), default=0.0), 4)
            row["load_s"] = round(max((t.get("load_s", 0.0) for t in timings), default=0.0), 4)
            row["restarted_nodes"] = list(r.restart_nodes)
        self.outcome.recoveries.append({"kind": r.kind, **row})
        self._event(r.kind, **row)
        self.recovery = None
        if r.kind == "restart":
            # Its generation committed a step: its workers hold the state now, so a later change
            # is decided afresh (from the newest checkpoint), never by restarting from this one
            # again, which retention may already have removed.
            self.restart_pending = None

    # ------------------------------------------------------------------ stopping
    def request_stop(self, reason: str, exit_code: int) -> None:
        """Stop at the next loop tick (a signal handler calls this): workers stop, outputs are written."""
        self.stop_requested = (reason, exit_code)

    def request_checkpoint_stop(self, reason: str) -> None:
        """Checkpoint the next step boundary, then stop so the job can be requeued and resumed
        (Slurm's warning signal before a time limit or a preemption)."""
        self.checkpoint_stop = reason

    def _check_stop_requests(self) -> None:
        if self.stop_requested is not None:
            raise Stopped(*self.stop_requested)
        if self.checkpoint_stop is None or self.ledger is None or self.checkpoints is None:
            return
        if self.checkpoint_stop_at is None:
            self.checkpoint_stop_at = self.ledger.next_step + 1
            self.checkpoints.request(self.checkpoint_stop_at)
            self._event("checkpoint_requested", checkpoint_step=self.checkpoint_stop_at, reason=self.checkpoint_stop)
        latest = self.checkpoints.latest_step()
        if latest is not None and latest >= self.checkpoint_stop_at:
            raise Stopped(
                f"{self.checkpoint_stop}: checkpointed after step {latest - 1} in {self.checkpoints.path(latest)}; "
                "requeue the job and resume it with job.resume=auto (slurm/run.sbatch does both)",
                EXIT_REQUEUE,
            )

    def stop_message(self, message: str) -> None:
        if self.store is None:
            return
        try:
            self.store.set(keys.STOP, keys.sign(self.secret, message))
            if self.ledger is not None and self.ledger.generation >= 0:
                self.store.compare_set(keys.decision(self.ledger.generation, self.ledger.next_step), "", keys.ABORT)
                self.store.compare_set(keys.established(self.ledger.generation), "", keys.NO)
                self.store.set(keys.abort(self.ledger.generation), "1")
        except Exception:
            pass

    def _shutdown(self) -> None:
        membership = self.membership
        if membership is None:
            return
        membership.closing = True
        self.stop_message("finished" if self.finished else (self.outcome.stopped or "stopped"))
        if self.decisions is not None:
            self.decisions.close()  # the stop message set the key it waits on
        deadline = time.monotonic() + STOP_GRACE_S
        gpus = int(self.cfg.cluster.gpus_per_node)
        if self.finished:
            # Give finished workers a moment to exit on their own (and checkpoints to complete).
            plan = self.ledger.layout.plan if self.ledger is not None else None
            expected = {a.worker for a in plan.assignments()} if plan is not None else set()
            expected = {w for w in expected if not membership.nodes[w[0]].failed}
            while time.monotonic() < deadline and not expected <= membership.exited:
                try:
                    membership.drain(0.02)
                except OobleckError:
                    break
            if self.checkpoints is not None and self.checkpoints.pending:
                self.checkpoints.finish(
                    time.monotonic() + float(self.cfg.checkpoint.write_timeout_s),
                    lambda: membership.drain(0.02),
                    lambda worker: worker in membership.exited or membership.nodes[worker[0]].failed,
                )
            for node, state in membership.nodes.items():
                for local_rank in range(gpus):
                    key = keys.phase_times(node, local_rank)
                    if not state.failed and self.store.check([key]):
                        self.outcome.phase_seconds[f"{node}:{local_rank}"] = json.loads(self.store.get(key))
        membership.shutdown(max(1.0, deadline - time.monotonic()))


_RNG_NOTE = "training draws no random numbers: the sampler and the initial weights are keyed by job.seed (model.dropout must be 0 for exact resumes)"


def summarize(outcome: Outcome, cfg: Any) -> dict[str, Any]:
    """Totals for summary.json: steps, samples, throughput, recoveries and their breakdown."""
    steps = outcome.steps
    rates = [s["samples_per_s"] for s in steps[1:]] or [s["samples_per_s"] for s in steps]
    recoveries = outcome.recoveries
    first = steps[0]["step"] if steps else None
    summary: dict[str, Any] = {
        "steps": len(steps),
        "first_step": first,
        "last_step": steps[-1]["step"] if steps else None,
        "consecutive_steps": [s["step"] for s in steps] == list(range(first or 0, (first or 0) + len(steps))),
        "samples": sum(s["samples"] for s in steps),
        "median_samples_per_s": round(statistics.median(rates), 3) if rates else 0.0,
        "final_loss": round(steps[-1]["loss"], 5) if steps else None,
        "generations": outcome.generations,
        "recoveries": len(recoveries),
        "retried_steps": sum(1 for s in steps if s["attempts"] > 1),
    }
    for kind in ("reconfiguration", "failover", "restart", "continue"):
        chosen = [r for r in recoveries if r["kind"] == kind]
        if chosen:
            summary[f"{kind}s"] = len(chosen)
            for key in ("detect_s", "plan_s", "groups_s", "state_copy_s", "first_step_s", "total_s"):
                summary[f"{kind}_median_{key}"] = round(statistics.median(r[key] for r in chosen), 4)
    if recoveries:
        summary["recovery_median_total_s"] = round(statistics.median(r["total_s"] for r in recoveries), 4)
        summary["recovery_bytes_moved"] = sum(r["bytes_moved"] for r in recoveries)
        summary["resumed_at_steps"] = [r["resume_step"] for r in recoveries]
    if outcome.rolled_back_steps:
        summary["rolled_back_steps"] = outcome.rolled_back_steps
        summary["samples_rolled_back"] = outcome.rolled_back_steps * int(cfg.job.global_batch_size)
    if outcome.checkpoints:
        summary["checkpoints"] = len(outcome.checkpoints)
        summary["checkpoint_bytes"] = outcome.checkpoints[-1]["bytes"]
        summary["checkpoint_median_snapshot_s"] = round(
            statistics.median(c["snapshot_s"] for c in outcome.checkpoints), 4
        )
        summary["checkpoint_median_write_s"] = round(statistics.median(c["write_s"] for c in outcome.checkpoints), 4)
    if outcome.fault_tolerance:
        summary["fault_tolerance_min"] = min(f["tolerated"] for f in outcome.fault_tolerance)
        summary["fault_tolerance_wanted"] = outcome.fault_tolerance[0]["wanted"]
    if outcome.joins_not_absorbed:
        summary["joins_not_absorbed"] = outcome.joins_not_absorbed
    if outcome.events_not_applied:
        summary["events_not_applied"] = outcome.events_not_applied
    if outcome.stopped:
        summary["stopped"] = outcome.stopped.splitlines()[0]
    if outcome.phase_seconds:
        # Where each surviving worker's step time went ("node:rank" -> phase -> seconds, summed
        # over the steps its last incarnation ran): the simulator's validation reads it.
        summary["phase_seconds"] = outcome.phase_seconds
    return summary

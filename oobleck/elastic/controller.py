"""The controller: one run's store, its parts, and its loop.

It ties together the parts that each own one thing, and has no strategy-specific code:

- ``StoreHost`` hosts the TCPStore every worker talks to (``oobleck.elastic.store_host``);
- ``Membership`` (agents, workers, failures, heartbeats) reports nodes lost and joined; the
  cluster's launcher (``oobleck.launcher``, chosen by ``cluster._target_``) starts and signals them;
- the ``StepLedger`` records each step the workers commit, and the generations (its
  ``DecisionWatch`` wakes the loop as each step is decided, so the loop does not poll for it);
- ``DecisionExecutor`` (``oobleck.elastic.execution``), the core: it asks the strategy about
  each membership change, carries the decision out by its kind and publishes each generation's
  ``PlanDocument``;
- ``act_on_findings`` (``oobleck.elastic.worker_verdicts``) fails the nodes of the ranks a
  timed-out collective waited on (or whose data plane does not answer) and redoes a generation
  ranks were stranded out of;
- ``oobleck.elastic.startup`` waits for every node, writes the first plan and continues a
  resumed run from its checkpoint;
- ``FaultFiring`` carries out the scheduled faults; ``CheckpointCoordinator`` completes the
  checkpoints the workers write; ``StopRequests`` and ``wind_down`` end the run
  (``oobleck.elastic.stopping``);
- observers (``oobleck.elastic.events.RunObserver``) follow the run: the recovery accounting and
  the fault-tolerance and schedule reports (``oobleck.elastic.accounting``) are three of them,
  and ``Controller.observers`` takes more.

The strategy's run-long services (``Strategy.services``) are started before any node and stopped
after the workers; what they yield is published under ``keys.SERVICES``. Only the controller
writes outputs (plan.json, metrics.csv, events.csv, summary.json, wandb).

Every store value goes through the run's key space (``keys.KeySpace``: names only the run can
form, values only the run can seal). A resumed run continues the run it resumes (``earlier``:
what the run dir's earlier attempts did): the steps it committed before the checkpoint, its
recoveries and checkpoints, and its clocks: the fault schedule's events of steps before the
checkpoint, or of times before the checkpoint's training time, never fire again. Whatever ends
the loop (an error, an ``OSError`` of a full or read-only disk, a bug) is recorded: the ``stop``
event and the outcome's ``stopped`` always say why.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from oobleck.checkpoint.durable import describe_cause
from oobleck.elastic.accounting import RecoveryAccounting, ScheduleReport, ToleranceReport
from oobleck.elastic.checkpoints import CheckpointCoordinator
from oobleck.elastic.events import EventKind, RunObserver
from oobleck.elastic.execution import DecisionExecutor
from oobleck.elastic.firing import FaultFiring
from oobleck.elastic.ledger import DecisionWatch, Outcome, StepLedger
from oobleck.elastic.membership import Membership
from oobleck.elastic.protocol import new_run_id, new_secret
from oobleck.elastic.startup import first_decision, resume_from, wait_for_nodes, write_plan_file
from oobleck.elastic.stopping import StopRequests, send_stop, wind_down
from oobleck.elastic.store_host import RunPorts, StoreHost
from oobleck.elastic.worker_verdicts import act_on_findings
from oobleck.errors import OobleckError, RunError
from oobleck.faults.injector import Injector
from oobleck.faults.schedule import FaultEvent
from oobleck.launcher import launcher_class
from oobleck.runtime import keys
from oobleck.runtime.sealed_store import SealedStore
from oobleck.strategy import Decision, RunInfo, Strategy, checkpoint_every_steps

# How long the loop sleeps between looks: briefly while it polls the store for something only
# polling shows (a generation being established, checkpoint shards being reported, a change
# being absorbed), longer in steady training, where the agents' messages and the decision watch
# wake it (each tick costs the controller ~0.2 ms of CPU, taken from the workers on a small machine).
LOOP_TICK_S = 0.002
STEADY_TICK_S = 0.02
# The decision watch wakes the loop as a step is decided; this poll only bounds the wait for a
# commit should a wake ever be missed.
COMMIT_POLL_S = 0.25
# What each checkpoint's manifest says about randomness (resumes are exact without saved RNG state).
RNG_NOTE = (
    "training draws no random numbers: the sampler and the initial weights are keyed by job.seed "
    "(model.dropout must be 0 for exact resumes)"
)

__all__ = ["Controller"]


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
        earlier: Outcome | None = None,
        ports: RunPorts | None = None,
    ) -> None:
        """``resume``: the checkpoint to resume from (``oobleck.checkpoint.Checkpoint``); ``earlier``:
        what the run's earlier attempts did (``oobleck.elastic.accounting.earlier_attempts``);
        ``ports``: the store's and the agent port's sockets, bound before the run started anything
        (``store_host.bind_run_ports``), or None to bind them when the run starts."""
        self.cfg = cfg
        self.failure_settle_s = float(cfg.cluster.failure_settle_s)
        self.config_dict = config_dict
        self.strategy = strategy
        self.initial = initial
        self.run_dir = Path(run_dir)
        self.recorder = recorder
        self.schedule = schedule
        self.resume = resume  # the checkpoint to resume from (oobleck.checkpoint.Checkpoint)
        self.run_id = run_id or new_run_id()
        self.ports = ports
        self.fork_server = fork_server  # forks the local workers (Launcher.forks_workers); None: exec them
        self.secret = new_secret()
        self.space = keys.KeySpace(self.secret)
        self.on_event = on_event
        # Called with each committed step's row, in the controller's loop (tools and benchmarks
        # watch the run with it; keep it cheap).
        self.on_step: Callable[[dict[str, Any]], None] | None = None
        # Observers beyond the built-in ones (added when the run starts): see RunObserver.
        self.observers: list[RunObserver] = []
        self.steps = int(cfg.job.steps)
        self.store: SealedStore | None = None
        self.store_host: StoreHost | None = None
        self.membership: Membership | None = None
        self.ledger: StepLedger | None = None
        self.decisions: DecisionWatch | None = None
        self.checkpoints: CheckpointCoordinator | None = None
        self.firing: FaultFiring | None = None
        self.stops = StopRequests()
        # When training began, on the monotonic clock: failure schedules fire on training time,
        # which a step of the wall clock must not advance.
        self.train_started: float | None = None
        self.executor: DecisionExecutor | None = None
        self.finished = False
        self._next_commit_poll = 0.0
        self._outcome = earlier if earlier is not None else Outcome()
        # Training seconds of the run before this attempt's (the resumed checkpoint's): the fault
        # schedule's clock and each checkpoint's training time continue from there.
        self.train_time_offset = float(resume.manifest.extra.get("train_time_s", 0.0)) if resume is not None else 0.0
        self._services = contextlib.ExitStack()  # the strategy's run-long services

    # ------------------------------------------------------------------ outputs
    @property
    def outcome(self) -> Outcome:
        return self.ledger.outcome if self.ledger is not None else self._outcome

    def _event(self, kind: EventKind | str, **fields: Any) -> None:
        kind = EventKind(kind)
        if self.ledger is not None:
            fields.setdefault("step", self.ledger.next_step)
            fields.setdefault("generation", self.ledger.generation)
        fields.setdefault("attempt", self.outcome.attempt)
        if self.recorder is not None:
            self.recorder.event(kind.value, **fields)
        if self.on_event is not None:
            self.on_event(kind.value, fields)

    @property
    def absorbing(self) -> bool:
        """Whether the last membership change is not absorbed yet (its first step has not committed)."""
        return self.executor is not None and self.executor.absorbing is not None

    @property
    def store_address(self) -> str:
        """HOST:PORT of the run's store (once the run started)."""
        assert self.store_host is not None
        return self.store_host.address

    def _on_step(self, row: dict[str, Any]) -> None:
        if self.recorder is not None:
            self.recorder.step(**row)
        if self.on_step is not None:
            self.on_step(row)

    def _notify(self, hook: str, *args: Any) -> None:
        for observer in self.observers:
            getattr(observer, hook)(*args)

    # ------------------------------------------------------------------ start-up
    def run(self) -> Outcome:
        try:
            self._start()
            self._wait_up()
            self._publish_initial()
            self._loop()
            return self.outcome
        except OobleckError as error:
            self._stopped(str(error))
            raise
        except OSError as error:
            # Typically a file the controller writes (metrics, events, the run dir) on a full or
            # read-only file system: said in one line with its errno, not a traceback.
            failure = RunError(f"the controller stopped on an operating-system error: {describe_cause(error)}")
            self._stopped(str(failure))
            raise failure from error
        except Exception as error:  # a bug: still recorded, then raised with its traceback
            self._stopped(f"{type(error).__name__}: {error}")
            raise
        finally:
            self._shutdown()
            self._services.close()  # after the workers, which may use the services until they exit

    def _stopped(self, reason: str) -> None:
        self.outcome.stopped = reason
        try:
            self._event(EventKind.STOP, reason=reason.splitlines()[0][:300])
        except Exception as error:  # the events file itself may be what cannot be written
            print(f"oobleck: could not record the stop ({type(error).__name__}: {error})", flush=True)

    def train_time(self) -> float:
        """Seconds of training in the run so far, earlier attempts' included."""
        started = self.train_started
        return self.train_time_offset + (time.monotonic() - started if started is not None else 0.0)

    def _start(self) -> None:
        """Host the store, build the parts and the observers, start the services and every node."""
        cfg = self.cfg
        self.store_host = host = StoreHost(cfg.cluster, self.ports.store if self.ports is not None else None)
        self.store = store = SealedStore(host.store, self.space)
        store.set(keys.CONFIG, json.dumps(self.config_dict))
        self.ledger = ledger = StepLedger(
            store, self.steps, int(cfg.job.global_batch_size), on_step=self._on_step, outcome=self._outcome
        )
        self.membership = membership = Membership(
            cfg,
            store,
            host.address,
            secret=self.secret,
            run_id=self.run_id,
            worker_module=self.strategy.worker_module,
            event=self._event,
            run_finished=self._run_finished,
        )
        membership.listen(self.ports.agent if self.ports is not None else None)
        self.decisions = DecisionWatch(SealedStore(host.client(), self.space), membership.wake, dist.DistStoreError)
        self.checkpoints = CheckpointCoordinator(
            cfg,
            self.run_dir,
            store,
            checkpoint_every_steps(cfg, self.strategy.config),
            event=self._event,
            extra={"strategy": self.strategy.name, "run_id": self.run_id, "rng": RNG_NOTE},
            clock=self.train_time,
        )
        self.checkpoints.completed_rows = ledger.outcome.checkpoints
        self.checkpoints.failure_rows = ledger.outcome.checkpoint_failures
        self.executor = executor = DecisionExecutor(
            self.strategy, store, ledger, membership, self.checkpoints, emit=self._event, notify=self._notify
        )
        self.firing = FaultFiring(
            Injector(list(self.schedule), seed=int(cfg.failures.seed)),
            store,
            membership,
            self._event,
            notice=lambda nodes, notice_s: executor.on_notice(nodes, notice_s, self.steps),
        )
        self.firing.next_node_id = int(cfg.cluster.nodes)
        builtin: list[RunObserver] = [RecoveryAccounting(ledger.outcome, ledger, membership, self._event)]
        if self.strategy.tolerates_in_place:
            builtin.append(ToleranceReport(ledger.outcome, int(cfg.job.fault_tolerance), self._event))
        builtin.append(ScheduleReport(ledger.outcome, ledger, membership, self.firing, self._event))
        self.observers[:0] = builtin
        run = RunInfo(
            str(cfg.cluster.master_addr), host.address, self.run_id, self.run_dir, self.config_dict, self.secret
        )
        store.set(keys.SERVICES, json.dumps(self._services.enter_context(self.strategy.services(run))))
        membership.launcher = launcher_class(cfg.cluster)(
            cfg.cluster,
            membership.agent_address,
            self.run_id,
            environment={keys.SECRET_ENV: self.secret},
            fork_server=self.fork_server,
        )
        for node in range(int(cfg.cluster.nodes)):
            membership.start_node(node)

    def _wait_up(self) -> None:
        assert self.membership is not None
        nodes = range(int(self.cfg.cluster.nodes))
        wait_for_nodes(self.membership, nodes, float(self.cfg.cluster.startup_timeout_s), LOOP_TICK_S * 5)

    def _publish_initial(self) -> None:
        membership, checkpoints, ledger, firing = self.membership, self.checkpoints, self.ledger, self.firing
        assert membership is not None and checkpoints is not None and ledger is not None and firing is not None
        assert self.executor is not None
        layout = first_decision(self.strategy, self.initial, membership.alive())
        if self.recorder is not None:
            write_plan_file(self.recorder, self.strategy, layout)
        resume_step, checkpoint = 0, None
        if self.resume is not None:
            resume_step, checkpoint = resume_from(
                self.resume, checkpoints, ledger, firing, self.train_time_offset, self._event
            )
        self._fire_faults()
        self.executor.publish(0, layout, resume_step, checkpoint=checkpoint)
        if checkpoint is not None:
            self.executor.restarting_from(resume_step)  # its workers load it: a change first restarts from it
        self.train_started = time.monotonic()
        ledger.last_commit_time = time.time()

    # ------------------------------------------------------------------ the loop
    def _run_finished(self) -> bool:
        assert self.ledger is not None
        if self.finished:
            return True
        self.ledger.check_commits()
        return self.ledger.next_step >= self.steps

    def _loop(self) -> None:
        ledger, membership, checkpoints, executor = self.ledger, self.membership, self.checkpoints, self.executor
        assert ledger is not None and membership is not None and checkpoints is not None and executor is not None
        while ledger.next_step < self.steps:
            membership.drain(self._tick())
            membership.check_heartbeats()
            self._check_workers()
            self._check_established()
            self._check_commits()
            self._after_commits()
            if ledger.next_step >= self.steps:
                break
            self.stops.check(ledger, checkpoints, self._event)
            self._fire_faults()
            if membership.pending() and (membership.lost_pending() or not membership.booting()):
                if membership.failures_settled(self.failure_settle_s):
                    executor.on_change(self.steps)
            else:
                executor.restart_if_checkpointed()
        self.finished = True
        self._notify("finished")

    def _tick(self) -> float:
        ledger, membership, checkpoints, executor = self.ledger, self.membership, self.checkpoints, self.executor
        assert ledger is not None and membership is not None and checkpoints is not None and executor is not None
        absorbing = executor.absorbing is not None
        polling = ledger.establishing() or checkpoints.pending or absorbing or membership.pending()
        return LOOP_TICK_S if polling else STEADY_TICK_S

    def _check_commits(self) -> None:
        """Record the steps decided since the last look: when the decision watch saw one, or
        every ``COMMIT_POLL_S`` (not every tick: each look is a store round trip)."""
        ledger, decisions, membership = self.ledger, self.decisions, self.membership
        assert ledger is not None and decisions is not None and membership is not None
        now = time.monotonic()
        if decisions.take() or now >= self._next_commit_poll:
            ledger.check_commits()
            self._next_commit_poll = now + COMMIT_POLL_S
        if ledger.undecidable is not None and not membership.pending():
            executor = self.executor
            assert executor is not None
            executor.redo(self.steps, f"the commit decision of step {ledger.undecidable} cannot be read")
        decisions.follow(ledger.awaited())

    def _after_commits(self) -> None:
        ledger, checkpoints, executor = self.ledger, self.checkpoints, self.executor
        assert ledger is not None and checkpoints is not None and executor is not None
        while ledger.checkpoint_boundaries:
            executor.boundary_committed(*ledger.checkpoint_boundaries.pop(0))
        checkpoints.poll()
        checkpoints.maybe_request_by_time(ledger.next_step)
        executor.check_absorbed()

    def _check_workers(self) -> None:
        """Frozen workers, collectives nobody answered, ranks stranded out of a generation
        (``oobleck.elastic.worker_verdicts``)."""
        ledger, membership, executor = self.ledger, self.membership, self.executor
        assert ledger is not None and membership is not None and executor is not None
        plan = ledger.generations[ledger.generation].layout.plan
        findings = membership.check_workers(ledger.generation, {a.worker: a.rank for a in plan.assignments()})
        act_on_findings(
            findings, ledger.generation, plan, membership, lambda why: executor.redo(self.steps, why), self.cfg.cluster
        )

    def _check_established(self) -> None:
        assert self.ledger is not None and self.executor is not None
        generation = self.ledger.check_established()
        if generation is not None:
            self.executor.established(generation.number)

    def _fire_faults(self) -> None:
        membership, firing, ledger, executor = self.membership, self.firing, self.ledger, self.executor
        assert membership is not None and firing is not None and ledger is not None and executor is not None
        firing.kill_noticed(time.time())  # a notice's kill comes on time, whatever the run is doing
        if not firing.remaining:
            return
        # Events apply in order, each after the previous change is absorbed (joining nodes up and
        # in the plan, the first step after it committed; a notice's nodes killed).
        if membership.booting() or membership.striking() or membership.pending() or executor.busy or firing.noticed:
            return
        firing.fire_due(ledger.next_step, self.train_time(), ledger.generation)

    # ------------------------------------------------------------------ stopping
    def request_stop(self, reason: str, exit_code: int) -> None:
        """Stop at the next loop tick (a signal handler calls this): workers stop, outputs are written."""
        self.stops.now = (reason, exit_code)

    def request_checkpoint_stop(self, reason: str) -> None:
        """Checkpoint the next step boundary, then stop so the job can be requeued and resumed
        (Slurm's warning signal before a time limit or a preemption)."""
        self.stops.after_checkpoint = reason

    def stop_message(self, message: str) -> None:
        if self.store is not None:
            send_stop(self.store, message, self.ledger)

    def _shutdown(self) -> None:
        membership = self.membership
        if membership is None:
            return
        membership.closing = True
        self.stop_message("finished" if self.finished else (self.outcome.stopped or "stopped"))
        if self.decisions is not None:
            self.decisions.close()  # the stop message set the key it waits on
        wind_down(
            membership,
            ledger=self.ledger,
            checkpoints=self.checkpoints,
            outcome=self.outcome,
            store=self.store,
            finished=self.finished,
            cfg=self.cfg,
        )

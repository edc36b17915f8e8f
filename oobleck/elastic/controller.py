"""The controller: the run's store, membership, plans per generation, fault injection and outputs.

It hosts torch's TCPStore (C++) that every worker talks to, accepts agent connections on a small
line-JSON port (agents do not import torch), and runs one loop that:

- registers nodes (an agent's ``hello``, then all of its workers' registrations in the store);
- watches liveness: a worker exit or a closed agent connection is a node failure noticed at
  once; a node whose heartbeats stop for ``cluster.heartbeat_timeout_s`` (frozen) is killed and
  declared failed;
- records every committed step (its loss, time and attempts) as workers decide it;
- on a membership change, reconfigures in place: takes the commit decision of the in-flight step
  (``compare_set`` "abort" unless the workers already committed it), marks the generation's
  establishment ("no" unless it was complete), aborts the generation, asks the planner for the
  reconfiguration from the last established plan, and publishes generation g+1 with the step to
  redo. A change during a reconfiguration simply supersedes it the same way;
- on more than f failures, a lost layer or a worker error: stops the run within seconds, with a
  message saying what was lost (or the worker's traceback), leaving no process behind.

Only the controller writes outputs (plan.json, metrics.csv, events.csv, summary.json, wandb).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import socket
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

from oobleck.errors import OobleckError, PlanningError, RunError
from oobleck.elastic.local import LocalLauncher
from oobleck.elastic.protocol import Channel
from oobleck.faults.injector import Action, Injector
from oobleck.faults.schedule import FaultEvent
from oobleck.planning.plan import ExecutionPlan, ReconfigurationPlan
from oobleck.runtime import keys

LOOP_TICK_S = 0.002
STOP_GRACE_S = 5.0


@dataclass
class NodeState:
    node: int
    channel: Optional[Channel] = None
    pid: Optional[int] = None
    last_seen: float = 0.0
    ready: bool = False  # agent said hello and every worker registered
    member: bool = False  # part of the current plan
    failed: bool = False
    frozen: bool = False
    kill_time: Optional[float] = None  # when the injector struck (wall clock)


@dataclass
class Recovery:
    """One reconfiguration's breakdown, filled in as its phases complete."""

    generation: int
    reason: str
    removed: tuple[int, ...]
    joined: tuple[int, ...]
    failure_time: float  # wall clock of the earliest cause (kill, or join ready)
    detect_s: float
    plan_s: float
    started: float  # wall clock when the controller began reconfiguring
    resume_step: int
    bytes_moved: int
    groups_s: float = 0.0
    state_copy_s: float = 0.0
    established_at: Optional[float] = None
    replicas_identical: Optional[bool] = None


@dataclass
class Outcome:
    """What the run did (for tests and the summary)."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    probes: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)  # generation -> rank -> probe
    checksums: dict[int, dict[str, int]] = field(default_factory=dict)  # generation -> layer -> crc
    generations: int = 0
    stopped: Optional[str] = None
    phase_seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # "node:rank" -> phase -> s
    joins_not_absorbed: list[int] = field(default_factory=list)  # joining nodes still booting at the end
    events_not_applied: int = 0  # scheduled events never due before the last step


class Controller:
    """Runs one training job on a set of node agents (see the module docstring)."""

    def __init__(
        self,
        cfg: Any,
        config_dict: dict[str, Any],
        *,
        recorder: Any = None,
        templates: Any = None,
        initial_plan: Optional[ExecutionPlan] = None,
        schedule: tuple[FaultEvent, ...] = (),
        layer_param_bytes: Optional[list[int]] = None,
        run_id: Optional[str] = None,
        on_event: Optional[Callable[[str, dict[str, Any]], None]] = None,
    ) -> None:
        self.cfg = cfg
        self.config_dict = config_dict
        self.recorder = recorder
        self.templates = templates
        self.initial_plan = initial_plan
        self.injector = Injector(list(schedule), seed=int(cfg.failures.seed))
        self.layer_param_bytes = layer_param_bytes
        # Tags every agent and worker command line (--run-id) so tools and tests can find them;
        # OOBLECK_RUN_ID lets a caller choose it.
        self.run_id = run_id or os.environ.get("OOBLECK_RUN_ID") or uuid.uuid4().hex[:12]
        self.on_event = on_event
        self.steps = int(cfg.job.steps)
        self.global_batch = int(cfg.job.global_batch_size)
        self.gpus = int(cfg.cluster.gpus_per_node)
        self.nodes: dict[int, NodeState] = {}
        self.messages: queue.Queue = queue.Queue()
        self.outcome = Outcome()
        self.store: Any = None
        self.server: Optional[socket.socket] = None
        self.launcher: Any = None  # LocalLauncher or SlurmLauncher (start, signal, kill, shutdown)
        self.generation = -1
        self.plans: dict[int, ExecutionPlan] = {}
        self.base_generation = 0
        self.next_step = 0
        self.attempts: dict[int, int] = {}
        self.last_commit_time = 0.0
        self.train_started: Optional[float] = None
        self.recovery: Optional[Recovery] = None
        self.pending_removed: dict[int, tuple[float, float]] = {}  # node -> (cause time, detect seconds)
        self.pending_joined: dict[int, float] = {}
        self.next_node_id = int(cfg.cluster.nodes)
        self.finished = False
        self._closing = False
        self.exited: set[tuple[int, int]] = set()

    # ------------------------------------------------------------------ outputs
    def _event(self, kind: str, **fields: Any) -> None:
        if self.recorder is not None:
            self.recorder.event(kind, **fields)
        if self.on_event is not None:
            self.on_event(kind, fields)

    # ------------------------------------------------------------------ start-up
    def _start_store(self) -> None:
        cluster = self.cfg.cluster
        try:
            self.store = dist.TCPStore(
                cluster.master_addr,
                int(cluster.master_port),
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=float(cluster.startup_timeout_s)),
            )
        except Exception as error:
            raise RunError(
                f"cannot host the store on {cluster.master_addr}:{cluster.master_port} ({error}); "
                "the port is probably in use: set cluster.master_port=<free port> or 0 to pick one"
            ) from None
        port = int(cluster.master_port) + 1 if int(cluster.master_port) else 0
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind((cluster.master_addr, port))
        except OSError as error:
            raise RunError(
                f"cannot open the agent port {cluster.master_addr}:{port} ({error}); "
                "set cluster.master_port=<free port> (the agent port is the next one) or 0"
            ) from None
        server.listen(64)
        self.server = server
        threading.Thread(target=self._accept, daemon=True, name="agent-accept").start()
        self.store.set(keys.CONFIG, json.dumps(self.config_dict))

    @property
    def store_address(self) -> str:
        return f"{self.cfg.cluster.master_addr}:{self.store.port}"

    @property
    def agent_address(self) -> str:
        assert self.server is not None
        return f"{self.cfg.cluster.master_addr}:{self.server.getsockname()[1]}"

    def _accept(self) -> None:
        assert self.server is not None
        while True:
            try:
                sock, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._read_agent, args=(Channel(sock),), daemon=True).start()

    def _read_agent(self, channel: Channel) -> None:
        node: Optional[int] = None
        while True:
            message = channel.recv()
            if message is None:
                if node is not None:
                    self.messages.put(("lost", node, None, time.time()))
                return
            if message["type"] == "hello":
                node = int(message["node"])
                self.messages.put(("hello", node, (channel, message), time.time()))
            elif node is not None:
                self.messages.put((message["type"], node, message, time.time()))

    def _start_node(self, node: int) -> None:
        self.nodes[node] = NodeState(node=node, last_seen=time.time())
        if self.launcher is not None:
            self.launcher.start(node)

    # ------------------------------------------------------------------ the run
    def run(self) -> Outcome:
        try:
            self._start_store()
            if self.cfg.cluster.kind == "local":
                self.launcher = LocalLauncher(self.agent_address, self.run_id)
            elif self.cfg.cluster.kind == "slurm":
                from oobleck.elastic.slurm import SlurmLauncher  # one agent job step per node

                self.launcher = SlurmLauncher(self.agent_address, self.run_id)
            for node in range(int(self.cfg.cluster.nodes)):
                self._start_node(node)
            self._wait_ready()
            self._publish_initial()
            self._loop()
            return self.outcome
        except OobleckError as error:
            self.outcome.stopped = str(error)
            self._event("stop", reason=str(error).splitlines()[0][:300], step=self.next_step, generation=self.generation)
            raise
        finally:
            self._shutdown()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + float(self.cfg.cluster.startup_timeout_s)
        wanted = set(range(int(self.cfg.cluster.nodes)))
        while not all(self.nodes[n].ready for n in wanted):
            if time.monotonic() > deadline:
                missing = sorted(n for n in wanted if not self.nodes[n].ready)
                raise RunError(
                    f"nodes {missing} did not start within cluster.startup_timeout_s={self.cfg.cluster.startup_timeout_s}; "
                    "check that agents can reach the controller"
                )
            self._drain(LOOP_TICK_S * 5)
            for n in wanted:
                if self.nodes[n].failed:
                    raise RunError(f"node {n} failed while starting (its agent or a worker exited)")

    def _publish_initial(self) -> None:
        live = sorted(n for n, s in self.nodes.items() if s.ready and not s.failed)
        if self.initial_plan is not None:
            plan = self.initial_plan
        else:
            from oobleck.planning.instantiate import instantiate

            job = self.cfg.job
            plan = instantiate(self.templates, live, int(job.global_batch_size), int(job.microbatch_size), int(job.fault_tolerance))
        for n in plan.nodes:
            self.nodes[n].member = True
        if self.recorder is not None:
            templates = self.templates.to_dict() if self.templates is not None else None
            self.recorder.write_plan({"templates": templates, "plan": plan.to_dict()})
        self._arm_due()
        self._publish(0, plan, None, 0)
        self.train_started = time.time()
        self.last_commit_time = self.train_started

    def _publish(self, generation: int, plan: ExecutionPlan, reconfiguration: Optional[ReconfigurationPlan], resume: int) -> None:
        document = {
            "generation": generation,
            "plan": plan.to_dict(),
            "reconfiguration": reconfiguration.to_dict() if reconfiguration is not None else None,
            "resume_step": resume,
        }
        self.plans[generation] = plan
        self.store.set(keys.plan(generation), json.dumps(document))
        self.store.set(keys.GEN, str(generation))
        self.generation = generation
        self.outcome.generations = generation + 1

    def _loop(self) -> None:
        while self.next_step < self.steps:
            self._drain(LOOP_TICK_S)
            self._check_heartbeats()
            self._check_established()
            self._check_commits()
            if self.next_step >= self.steps:
                break
            self._inject()
            # Joins are taken together once every node starting now is up (one generation per
            # batch); a failure is taken at once (and takes any ready joiners along).
            if self.pending_removed or (self.pending_joined and not self._booting()):
                self._reconfigure()
        self.finished = True
        self._report_unfinished_schedule()

    def _report_unfinished_schedule(self) -> None:
        """Say so when the run ended before joining nodes were up or scheduled events were due."""
        waiting = sorted(n for n, s in self.nodes.items() if not s.member and not s.failed)
        if waiting:
            self.outcome.joins_not_absorbed = waiting
            self._event(
                "join_not_absorbed", nodes=waiting, step=self.next_step,
                reason="the run ended before these nodes were up (a worker takes seconds to start); join earlier or run more steps",
            )  # fmt: skip
        if self.injector.remaining:
            self.outcome.events_not_applied = self.injector.remaining
            self._event("schedule_not_finished", remaining_events=self.injector.remaining, step=self.next_step)

    # ------------------------------------------------------------------ messages
    def _drain(self, timeout: float) -> None:
        try:
            item = self.messages.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.messages.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, node: int, payload: Any, when: float) -> None:
        state = self.nodes.get(node)
        if kind == "hello":
            channel, message = payload
            if state is None or state.failed:  # an unknown agent (e.g. srun started it): adopt it
                state = self.nodes[node] = NodeState(node=node)
            state.channel, state.pid, state.last_seen = channel, int(message["pid"]), when
            channel.send({
                "type": "start",
                "store": self.store_address,
                "gpus": self.gpus,
                "run_id": self.run_id,
                "heartbeat_s": float(self.cfg.cluster.heartbeat_interval_s),
            })
            threading.Thread(target=self._await_workers, args=(node,), daemon=True).start()
            return
        if state is None or state.failed:
            return
        state.last_seen = max(state.last_seen, when)
        if kind == "hb":
            return
        if kind == "registered":
            state.ready = True
            if self.generation >= 0 and not state.member:
                self.pending_joined[node] = when
                self._event("join", node=node, step=self.next_step, generation=self.generation)
            return
        if kind == "exit":
            self.exited.add((node, int(payload["local_rank"])))
            if self.finished or self._closing:
                return
            self._check_commits()  # a clean exit after the last step is not a failure
            if self.next_step >= self.steps:
                return
            # A worker that raised wrote its traceback and exited 1; one killed by a signal did not.
            error = self._worker_error(node, int(payload["local_rank"])) if int(payload["code"]) > 0 else None
            if error is not None:
                raise RunError(f"worker (node {node}, local rank {payload['local_rank']}) raised an exception:\n{error}")
            self._node_failed(node, f"worker {payload['local_rank']} exited with code {payload['code']}", when)
            return
        if kind == "boot_timeout":
            self._node_failed(node, f"workers did not register within cluster.startup_timeout_s={self.cfg.cluster.startup_timeout_s}", when)
            return
        if kind == "lost":
            if self.finished or self._closing:
                return
            self._node_failed(node, "agent connection closed", when)

    def _await_workers(self, node: int) -> None:
        """Wait (in a helper thread, own store connection) for a node's workers to register."""
        host, _, port = self.store_address.rpartition(":")
        store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=float(self.cfg.cluster.startup_timeout_s)))
        try:
            store.wait([keys.worker_registered(node, r) for r in range(self.gpus)])
        except Exception:
            self.messages.put(("boot_timeout", node, None, time.time()))
            return
        self.messages.put(("registered", node, None, time.time()))

    def _worker_error(self, node: int, local_rank: int) -> Optional[str]:
        key = keys.worker_error(node, local_rank)
        deadline = time.monotonic() + 0.2  # the worker writes its error just before exiting
        while time.monotonic() < deadline:
            if self.store.check([key]):
                return self.store.get(key).decode()
            time.sleep(0.01)
        return None

    def _check_heartbeats(self) -> None:
        now = time.time()
        timeout = float(self.cfg.cluster.heartbeat_timeout_s)
        for state in list(self.nodes.values()):
            if state.failed or state.channel is None or now - state.last_seen <= timeout:
                continue
            # Frozen or cut off: make sure it is gone, then treat it as failed.
            if self.launcher is not None and self.launcher.can_kill(state.node):
                self.launcher.kill(state.node, signal.SIGKILL)
            self._node_failed(state.node, f"no heartbeat for {now - state.last_seen:.1f} s", now)

    def _node_failed(self, node: int, reason: str, detected: float) -> None:
        state = self.nodes[node]
        if state.failed:
            return
        state.failed = True
        if self.launcher is not None and self.launcher.can_kill(node):
            self.launcher.kill(node, signal.SIGKILL)  # whatever is left of it
        cause = state.kill_time
        if cause is None and self.store.check([keys.strike_time(node)]):
            cause = float(self.store.get(keys.strike_time(node)).decode())
        cause = cause if cause is not None else detected
        self._event("failure", node=node, reason=reason, step=self.next_step, generation=self.generation, detect_s=round(detected - cause, 4))
        if node in self.pending_joined:
            del self.pending_joined[node]
        if state.member:
            self.pending_removed[node] = (cause, detected - cause)

    # ------------------------------------------------------------------ steps
    def _check_commits(self) -> None:
        while self.generation >= 0 and self.next_step < self.steps:
            key = keys.decision(self.generation, self.next_step)
            if not self.store.check([key]) or self.store.get(key).decode() != keys.COMMIT:
                return
            self._record_commit(self.generation, self.next_step)

    def _record_commit(self, generation: int, step: int) -> None:
        plan = self.plans[generation]
        last = [
            a.rank
            for a in plan.assignments()
            if a.stage == plan.pipelines[a.pipeline].template.num_stages - 1
        ]
        loss_sum = sum(float(self.store.get(keys.loss(generation, step, r)).decode()) for r in last)
        now = time.time()
        elapsed = now - self.last_commit_time
        self.last_commit_time = now
        attempts = self.attempts.get(step, 0) + 1
        row = {
            "step": step,
            "samples": self.global_batch,
            "samples_per_s": self.global_batch / elapsed if elapsed > 0 else 0.0,
            "loss": loss_sum / self.global_batch,
            "generation": generation,
            "pipelines": len(plan.pipelines),
            "attempts": attempts,
            "step_time_s": elapsed,
            "nodes": len(plan.nodes),
        }
        self.outcome.steps.append(row)
        if self.recorder is not None:
            self.recorder.step(**row)
        self.next_step = step + 1
        if self.recovery is not None and self.recovery.generation == generation:
            self._finish_recovery(now)
        self._arm_due()

    def _check_established(self) -> None:
        recovery = self.recovery
        generation = self.generation
        if generation < 0 or generation in self.outcome.checksums:
            return
        key = keys.established(generation)
        if not self.store.check([key]) or self.store.get(key).decode() != keys.YES:
            return
        now = time.time()
        self.base_generation = generation
        plan = self.plans[generation]
        ranks = [a.rank for a in plan.assignments()]
        timings = [json.loads(self.store.get(keys.timing(generation, r))) for r in ranks]
        merged: dict[str, int] = {}
        identical = True
        for r in ranks:
            for layer, crc in json.loads(self.store.get(keys.checksums(generation, r))).items():
                if merged.setdefault(layer, crc) != crc:
                    identical = False
        self.outcome.checksums[generation] = merged if identical else {}
        self.outcome.probes[generation] = {r: json.loads(self.store.get(keys.probe(generation, r))) for r in ranks}
        if recovery is not None and recovery.generation == generation:
            recovery.groups_s = max(t["groups_s"] for t in timings)
            recovery.state_copy_s = max(t["state_copy_s"] for t in timings)
            recovery.established_at = now
            recovery.replicas_identical = identical
        if not identical:
            raise RunError(f"generation {generation}: replicas of some layer differ after establishing (checksum mismatch)")

    def _finish_recovery(self, now: float) -> None:
        r = self.recovery
        assert r is not None
        established = r.established_at if r.established_at is not None else now
        row = {
            "generation": r.generation,
            "reason": r.reason,
            "removed": list(r.removed),
            "joined": list(r.joined),
            "resume_step": r.resume_step,
            "detect_s": round(r.detect_s, 4),
            "plan_s": round(r.plan_s, 4),
            "groups_s": round(r.groups_s, 4),
            "state_copy_s": round(r.state_copy_s, 4),
            "bytes_moved": r.bytes_moved,
            "first_step_s": round(now - established, 4),
            "total_s": round(now - r.failure_time, 4),
            "replicas_identical": r.replicas_identical,
        }
        self.outcome.recoveries.append(row)
        self._event("reconfiguration", **row)
        self.recovery = None

    # ------------------------------------------------------------------ faults
    def _booting(self) -> bool:
        return any(not s.ready and not s.failed for s in self.nodes.values())

    def _live_members(self) -> list[int]:
        return sorted(n for n, s in self.nodes.items() if s.member and not s.failed)

    def _arm_due(self) -> None:
        # Events apply in order, each after the previous change is absorbed (joining nodes up and
        # in the plan, the reconfiguration's first step committed): a schedule then means the
        # same sequence of generations however long start-up or recovery takes.
        striking = any(s.kill_time is not None and not s.failed for s in self.nodes.values())
        if self._booting() or striking or self.pending_joined or self.pending_removed or self.recovery is not None:
            return
        elapsed = time.time() - self.train_started if self.train_started else 0.0
        for action in self.injector.due(self.next_step, elapsed, self._live_members()):
            self._apply(action)

    def _inject(self) -> None:
        if self.injector.remaining:
            self._arm_due()

    def _apply(self, action: Action) -> None:
        event = action.event
        if action.kind == "join":
            ids = list(action.nodes) or list(range(self.next_node_id, self.next_node_id + action.count))
            if self.launcher is None:
                raise RunError(f"{event.origin}: joins start new agents, which this cluster kind cannot do")
            for node in ids:
                self.next_node_id = max(self.next_node_id, node + 1)
                self._start_node(node)
            self._event("join_started", nodes=ids, step=self.next_step, generation=self.generation, origin=event.origin)
            return
        if action.kind == "arm":
            for node in action.nodes:
                strike = {"step": event.step, "phase": event.phase, "action": "raise" if event.action == "raise" else ("freeze" if event.freeze else "remove")}
                if event.phase == "reconfigure":
                    strike["generation"] = self.generation + 1
                self.store.set(keys.strike(node), json.dumps(strike))
            self._event("fault_armed", nodes=list(action.nodes), step=event.step, phase=event.phase, action=event.action)
            return
        sig = signal.SIGSTOP if action.kind == "freeze" else signal.SIGKILL
        for node in action.nodes:
            state = self.nodes[node]
            state.kill_time = time.time()
            if self.launcher is not None and self.launcher.can_kill(node):
                self.launcher.send_signal(node, sig)
            elif state.channel is not None:
                state.channel.send({"type": "kill", "signal": "SIGSTOP" if sig == signal.SIGSTOP else "SIGKILL"})
            state.frozen = sig == signal.SIGSTOP
        self._event("fault_injected", nodes=list(action.nodes), fault=action.kind, step=self.next_step, origin=event.origin)

    # ------------------------------------------------------------------ reconfiguration
    def _reconfigure(self) -> None:
        started = time.time()
        generation = self.generation
        step = self.next_step
        while step < self.steps:
            value = self.store.compare_set(keys.decision(generation, step), "", keys.ABORT).decode()
            if value != keys.COMMIT:
                break
            self._record_commit(generation, step)
            step = self.next_step
        if step >= self.steps:
            self.pending_removed.clear()
            self.pending_joined.clear()
            return
        self.attempts[step] = self.attempts.get(step, 0) + 1
        if self.store.compare_set(keys.established(generation), "", keys.NO).decode() == keys.YES:
            self.base_generation = generation
        self.store.set(keys.abort(generation), "1")
        base = self.plans[self.base_generation]
        live = sorted(n for n, s in self.nodes.items() if not s.failed and (s.member or n in self.pending_joined))
        removed = tuple(n for n in base.nodes if n not in live)
        joined = tuple(n for n in live if n not in base.nodes)
        causes = [t for t, _ in self.pending_removed.values()] + list(self.pending_joined.values())
        detects = [d for _, d in self.pending_removed.values()]
        superseded = self.recovery
        if superseded is not None:
            self._event("reconfiguration_superseded", generation=superseded.generation, by=generation + 1)
            causes.append(superseded.failure_time)
        self.pending_removed.clear()
        self.pending_joined.clear()
        try:
            try:
                reconfiguration = self._plan(base, removed, joined)
            except PlanningError:
                if step > 0:
                    raise
                # Nothing to keep yet (e.g. every replica of a layer died in step 0): start over.
                reconfiguration = self._fresh_plan(base, removed, joined, live)
        except PlanningError as error:
            lost = f"lost nodes {list(removed)}" if removed else "membership change"
            when = f"after step {step - 1}" if step > 0 else "before the first step committed"
            raise RunError(f"cannot continue training in place {when} ({lost}): {error}") from None
        if step == 0:
            # Nothing has committed: every layer is still its seeded initial state, which each
            # worker builds itself. Copying it would need its holders in the first plan to have
            # built it, and a worker slow to start may never have seen that plan.
            reconfiguration = dataclasses.replace(reconfiguration, transfers=())
        for n, state in self.nodes.items():
            state.member = n in reconfiguration.new.nodes and not state.failed
        plan_s = time.time() - started
        self._publish(generation + 1, reconfiguration.new, reconfiguration, step)
        self.recovery = Recovery(
            generation=generation + 1,
            reason="failure" if removed else "join",
            removed=removed,
            joined=joined,
            failure_time=min(causes) if causes else started,
            detect_s=max(detects) if detects else 0.0,
            plan_s=plan_s,
            started=started,
            resume_step=step,
            bytes_moved=reconfiguration.bytes_moved,
        )

    def _fresh_plan(
        self, base: ExecutionPlan, removed: tuple[int, ...], joined: tuple[int, ...], live: list[int]
    ) -> ReconfigurationPlan:
        """The best plan for ``live`` from scratch, with nothing to copy (before the first commit)."""
        from oobleck.planning.instantiate import instantiate

        if self.templates is None:
            raise PlanningError("no pipeline templates to plan with")
        job = self.cfg.job
        plan = instantiate(self.templates, live, int(job.global_batch_size), int(job.microbatch_size), int(job.fault_tolerance))
        return ReconfigurationPlan(old=base, new=plan, removed=removed, joined=joined, transfers=())

    def _plan(self, base: ExecutionPlan, removed: tuple[int, ...], joined: tuple[int, ...]) -> ReconfigurationPlan:
        from oobleck.planning.reconfigure import reconfigure

        if self.templates is None:
            raise PlanningError("no pipeline templates to reconfigure with")
        return reconfigure(base, self.templates, removed, joined, self.layer_param_bytes)

    # ------------------------------------------------------------------ shutdown
    def stop_message(self, message: str) -> None:
        if self.store is None:
            return
        try:
            self.store.set(keys.STOP, message)
            if self.generation >= 0:
                self.store.compare_set(keys.decision(self.generation, self.next_step), "", keys.ABORT)
                self.store.compare_set(keys.established(self.generation), "", keys.NO)
                self.store.set(keys.abort(self.generation), "1")
        except Exception:
            pass

    def _shutdown(self) -> None:
        self._closing = True
        self.stop_message("finished" if self.finished else (self.outcome.stopped or "stopped"))
        deadline = time.monotonic() + STOP_GRACE_S
        # Give finished workers a moment to exit on their own, then ask agents to stop.
        if self.finished:
            expected = {(n, r) for n, st in self.nodes.items() if st.member and not st.failed for r in range(self.gpus)}
            while time.monotonic() < deadline and not expected <= self.exited:
                try:
                    self._drain(0.02)
                except OobleckError:
                    break
        if self.finished:
            for node, state in self.nodes.items():
                for local_rank in range(self.gpus):
                    key = keys.phase_times(node, local_rank)
                    if state.member and not state.failed and self.store.check([key]):
                        self.outcome.phase_seconds[f"{node}:{local_rank}"] = json.loads(self.store.get(key))
        for state in self.nodes.values():
            if state.channel is not None and not state.failed:
                state.channel.send({"type": "shutdown"})
        if self.launcher is not None:
            self.launcher.shutdown(max(1.0, deadline - time.monotonic()))
        for state in self.nodes.values():
            if state.channel is not None:
                state.channel.close()
        if self.server is not None:
            self.server.close()


def summarize(outcome: Outcome, cfg: Any) -> dict[str, Any]:
    """Totals for summary.json: steps, samples, throughput, recoveries and their breakdown."""
    steps = outcome.steps
    rates = [s["samples_per_s"] for s in steps[1:]] or [s["samples_per_s"] for s in steps]
    recoveries = outcome.recoveries
    summary: dict[str, Any] = {
        "steps": len(steps),
        "first_step": steps[0]["step"] if steps else None,
        "last_step": steps[-1]["step"] if steps else None,
        "consecutive_steps": [s["step"] for s in steps] == list(range(len(steps))),
        "samples": sum(s["samples"] for s in steps),
        "median_samples_per_s": round(statistics.median(rates), 3) if rates else 0.0,
        "final_loss": round(steps[-1]["loss"], 5) if steps else None,
        "generations": outcome.generations,
        "recoveries": len(recoveries),
        "retried_steps": sum(1 for s in steps if s["attempts"] > 1),
    }
    if recoveries:
        for key in ("detect_s", "plan_s", "groups_s", "state_copy_s", "first_step_s", "total_s"):
            summary[f"recovery_median_{key}"] = round(statistics.median(r[key] for r in recoveries), 4)
        summary["recovery_bytes_moved"] = sum(r["bytes_moved"] for r in recoveries)
        summary["resumed_at_steps"] = [r["resume_step"] for r in recoveries]
    if outcome.joins_not_absorbed:
        summary["joins_not_absorbed"] = outcome.joins_not_absorbed
    if outcome.events_not_applied:
        summary["events_not_applied"] = outcome.events_not_applied
    if outcome.stopped:
        summary["stopped"] = outcome.stopped.splitlines()[0]
    return summary

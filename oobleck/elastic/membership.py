"""Membership: which nodes exist, which are up, which failed, and the agents' connections.

The controller's view of the cluster, fed by the agent port (``agent_port``: the agents' messages,
once they said hello with the run's secret) and the store: a node is *up* once its agent said hello with the run's secret and every worker of its
current incarnation registered in the store; it *fails* when a worker exits unexpectedly, its
agent's connection closes, or its heartbeats stop for ``cluster.heartbeat_timeout_s`` (it is then
killed, to be sure it is gone). Every worker also beats on its own (``oobleck.elastic.watchdog``):
a worker whose heartbeat stops (``kill -STOP`` of the worker alone) fails its node the same way,
and so do the ranks a collective waited on for longer than ``cluster.collective_timeout_s``.
Failures and arrivals accumulate as pending changes that the
controller takes (``take_changes``) and hands to the strategy. Workers are restarted (a new
*incarnation*) by their agents on request; exits of an older incarnation are expected, not
failures.

Messages count only from the connection a node's agent said hello on: a second connection for
the node is dropped and its close is not the node's.
"""

from __future__ import annotations

import dataclasses
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from oobleck.elastic import node_probes
from oobleck.elastic.agent_port import AgentPort
from oobleck.elastic.events import EventKind
from oobleck.elastic.protocol import Channel
from oobleck.elastic.watchdog import Beat, Verdict, WorkerBeats, parse_beat, stranded, unanswered
from oobleck.runtime import keys
from oobleck.runtime.sealed_store import SealedStore

# A worker heartbeat older than this many intervals no longer tells what the worker is doing.
FRESH_BEATS = 3


@dataclass
class NodeState:
    node: int
    channel: Channel | None = None
    pid: int | None = None
    # When the controller last heard from the node's agent, on its monotonic clock: silence is a
    # duration, and a step of the wall clock (NTP, a VM's clock resynchronised after a pause) must
    # not make every node look silent at once.
    heard_at: float = 0.0
    incarnation: int = 0  # worker restarts so far
    up: bool = False  # agent said hello and every worker of this incarnation registered
    was_up: bool = False  # up at some point (a restarted node coming back up is not a join)
    failed: bool = False
    frozen: bool = False
    kill_time: float | None = None  # when the injector struck (wall clock)
    exits: int = 0  # workers of the current incarnation that exited
    registered_at: float | None = None  # when the current incarnation's workers were all up
    old_exited_at: float | None = None  # when the last worker of an older incarnation exited


@dataclass(frozen=True)
class WorkerFindings:
    """What the workers' heartbeats say about the current generation (``Membership.check_workers``)."""

    verdict: Verdict | None = None  # a collective that outlasted cluster.collective_timeout_s
    stranded: tuple[int, ...] = ()  # ranks that left the generation and wait for the next one


@dataclass(frozen=True)
class Changes:
    """Membership changes since the last ``take_changes``."""

    removed: dict[int, tuple[float, float]]  # node -> (cause time, detection seconds)
    joined: dict[int, float]  # node -> time it came up

    def __bool__(self) -> bool:
        return bool(self.removed or self.joined)


class Membership:
    """The node table and everything that changes it (see the module docstring)."""

    def __init__(
        self,
        cfg: Any,
        store: SealedStore,
        store_address: str,
        *,
        secret: str,
        run_id: str,
        worker_module: str,
        event: Callable[..., None],
        run_finished: Callable[[], bool],
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.store_address = store_address
        self.secret = secret
        self.run_id = run_id
        self.worker_module = worker_module
        self.event = event
        self.run_finished = run_finished  # a worker exiting after the last step is not a failure
        self.gpus = int(cfg.cluster.gpus_per_node)
        self.nodes: dict[int, NodeState] = {}
        self.messages: queue.Queue = queue.Queue()
        self.port: AgentPort | None = None
        self.launcher: Any = None
        self.closing = False
        self._boot_waits: list[threading.Thread] = []
        self._boot_waits_end = threading.Event()
        self.exited: set[tuple[int, int]] = set()
        self._removed: dict[int, tuple[float, float]] = {}
        self._first_removal_at: float | None = None  # monotonic time of the first failure waiting
        self._joined: dict[int, float] = {}
        self.accepting_joins = False  # nodes up before the first plan are not joins
        self.beats = WorkerBeats()
        self._next_beat_check = 0.0

    # ------------------------------------------------------------------ agent port
    def listen(self, listener: socket.socket | None = None) -> None:
        """Open the agent port (``oobleck.elastic.agent_port``) on ``listener`` if bound already."""
        self.port = AgentPort(self.cfg.cluster, self.secret, self.messages, lambda: self.closing, listener)

    @property
    def server(self) -> socket.socket | None:
        """The agent port's listening socket."""
        return self.port.server if self.port is not None else None

    @property
    def agent_address(self) -> str:
        assert self.port is not None
        return self.port.address

    # ------------------------------------------------------------------ nodes
    def start_node(self, node: int) -> None:
        self.nodes[node] = NodeState(node=node, heard_at=time.monotonic())
        if self.launcher is not None:
            self.launcher.start(node)

    def alive(self) -> list[int]:
        return sorted(n for n, s in self.nodes.items() if s.up and not s.failed)

    def available(self) -> list[int]:
        """The nodes a decision may use: alive, or restarting their workers (up before, not failed).
        A failure during a restart must not drop a node only because its fresh workers are still
        booting; a joining node counts once its workers are up."""
        return sorted(n for n, s in self.nodes.items() if (s.up or s.was_up) and not s.failed)

    def booting(self) -> bool:
        return any(not s.up and not s.failed for s in self.nodes.values())

    def striking(self) -> bool:
        return any(s.kill_time is not None and not s.failed for s in self.nodes.values())

    def restart_workers(self, nodes: list[int]) -> None:
        """Ask each node's agent to kill its workers and start a new incarnation."""
        for node in nodes:
            state = self.nodes[node]
            state.incarnation += 1
            state.up = False
            state.exits = 0
            state.registered_at = state.old_exited_at = None
            if state.channel is None or not state.channel.send({"type": "restart", "incarnation": state.incarnation}):
                self.node_failed(node, "its agent could not be asked to restart its workers", time.time())
                continue
            self._await_workers(node, state.incarnation)

    def take_changes(self) -> Changes:
        changes = Changes(dict(self._removed), dict(self._joined))
        self._removed.clear()
        self._joined.clear()
        self._first_removal_at = None
        return changes

    def pending(self) -> bool:
        return bool(self._removed or self._joined)

    def lost_pending(self) -> bool:
        """A failure waits to be handled (joins wait until every booting node is up)."""
        return bool(self._removed)

    def failures_settled(self, window_s: float) -> bool:
        """No failure waits, or the first waiting one is ``window_s`` old: those detected with it
        (``cluster.failure_settle_s``) are in, and one decision covers them all."""
        return self._first_removal_at is None or time.monotonic() - self._first_removal_at >= window_s

    # ------------------------------------------------------------------ messages
    def drain(self, timeout: float) -> None:
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

    def wake(self) -> None:
        """End the loop's current ``drain`` now (something outside the agents' messages happened)."""
        self.messages.put(("wake", -1, None, time.time()))

    def _handle(self, kind: str, node: int, payload: Any, when: float) -> None:
        if kind == "wake":
            return
        state = self.nodes.get(node)
        if kind == "hello":
            channel, message = payload
            if state is None or state.failed:  # an unknown agent (e.g. srun started it): adopt it
                state = self.nodes[node] = NodeState(node=node)
            elif state.channel is not None:  # a second agent for a node that has one
                print(f"oobleck: dropped a second agent for node {node}", file=sys.stderr, flush=True)
                channel.close()
                return
            state.channel, state.pid, state.heard_at = channel, message["pid"], time.monotonic()
            channel.send(
                {
                    "type": "start",
                    "store": self.store_address,
                    "gpus": self.gpus,
                    "run_id": self.run_id,
                    "heartbeat_s": float(self.cfg.cluster.heartbeat_interval_s),
                    "incarnation": state.incarnation,
                    "worker_module": self.worker_module,
                    "fork_server": self.launcher.worker_server if self.launcher is not None else "",
                }
            )
            self._await_workers(node, state.incarnation)
            return
        if state is None or state.failed:
            return
        if kind in ("hb", "exit", "lost"):
            channel, payload = (payload, None) if kind == "lost" else payload
            if channel is not state.channel:
                return  # a connection that is not the node's agent (one dropped as a second agent)
        # Heard when handled, not when received: a backlog of the controller's own is not the node's
        # silence, and ``when`` is a wall-clock time.
        state.heard_at = time.monotonic()
        if kind == "hb":
            return
        if kind == "registered":
            if payload != state.incarnation:
                return  # an older incarnation's registration
            state.up = True
            state.registered_at = when
            if self.accepting_joins and not state.was_up:
                self._joined[node] = when
                self.event(EventKind.JOIN, node=node)
            state.was_up = True
            return
        if kind == "exit":
            if int(payload["incarnation"]) != state.incarnation:
                state.old_exited_at = when  # a worker of an incarnation being restarted
                return
            self.exited.add((node, int(payload["local_rank"])))
            if self.closing or self.run_finished():
                return
            # A worker that raised wrote its traceback and exited 1: that stops the run, with the
            # error's last line (its cause) on the first line. One killed by a signal (a negative
            # code) went with its node.
            if int(payload["code"]) > 0:
                local_rank = int(payload["local_rank"])
                report = node_probes.error_report(self.store, keys.worker_error(node, local_rank, state.incarnation))
                raise node_probes.worker_error(node, local_rank, int(payload["code"]), report)
            self.node_failed(node, f"worker {payload['local_rank']} exited with code {payload['code']}", when)
            return
        if kind == "boot_timeout":
            if payload == state.incarnation and not state.up:
                self.node_failed(
                    node,
                    f"workers did not register within cluster.startup_timeout_s={self.cfg.cluster.startup_timeout_s}",
                    when,
                )
            return
        if kind == "lost":
            if self.closing or self.run_finished():
                return
            self.node_failed(node, "agent connection closed", when)

    def _await_workers(self, node: int, incarnation: int) -> None:
        """Wait (``node_probes.await_registration``) for a node's workers to register."""
        self._boot_waits = [t for t in self._boot_waits if t.is_alive()]
        thread = node_probes.await_registration(
            self.store_address,
            self.store.space,
            [keys.worker_registered(node, r, incarnation) for r in range(self.gpus)],
            float(self.cfg.cluster.startup_timeout_s),
            self._boot_waits_end,
            self.messages,
            node,
            incarnation,
        )
        self._boot_waits.append(thread)

    # ------------------------------------------------------------------ failures
    def check_heartbeats(self) -> None:
        now = time.monotonic()
        timeout = float(self.cfg.cluster.heartbeat_timeout_s)
        for state in list(self.nodes.values()):
            silent = now - state.heard_at
            if state.failed or state.channel is None or silent <= timeout:
                continue
            # Frozen or cut off: make sure it is gone, then treat it as failed.
            wall = time.time()
            self.node_failed(state.node, f"no heartbeat for {silent:.1f} s", wall, cause=wall - silent)

    def check_workers(self, generation: int, ranks: dict[tuple[int, int], int]) -> WorkerFindings:
        """Read every worker's heartbeat (each ``cluster.heartbeat_interval_s``): fail the nodes of
        workers whose beat stopped for ``cluster.heartbeat_timeout_s``, and say what the ranks of
        ``generation`` wait on (``ranks``: worker -> its rank in that generation's plan): a
        collective that outlasted ``cluster.collective_timeout_s``, and ranks that left the
        generation and wait for the next one as long. A worker program that does not beat (its key
        never appears) is watched through its agent only; a beat the run did not write is none."""
        cluster = self.cfg.cluster
        now = time.monotonic()  # silences are durations (``NodeState.heard_at``)
        if now < self._next_beat_check or self.closing or self.run_finished():
            return WorkerFindings()
        self._next_beat_check = now + float(cluster.heartbeat_interval_s)
        watched = {
            keys.heartbeat(state.node, local_rank, state.incarnation): (state.node, local_rank)
            for state in self.nodes.values()
            if state.up and not state.failed
            for local_rank in range(self.gpus)
        }
        beats = self.store.read_present(list(watched), parse_beat)
        fresh: dict[tuple[int, int], Beat | None] = {}
        for key, (node, local_rank) in watched.items():
            if key not in beats and self.beats.since(key) is None:
                continue  # this worker program does not beat
            beat = beats.get(key)
            self.beats.update(key, beat if isinstance(beat, Beat) else None, now)
            since = self.beats.since(key)
            assert since is not None
            silent = now - since
            if silent > float(cluster.heartbeat_timeout_s):
                wall = time.time()
                self.node_failed(
                    node,
                    f"worker {local_rank} sent no heartbeat for {silent:.1f} s (frozen or hung)",
                    wall,
                    cause=wall - silent,
                )
                continue
            recent = silent <= FRESH_BEATS * float(cluster.heartbeat_interval_s)
            fresh[(node, local_rank)] = beat if recent and isinstance(beat, Beat) else None
        by_rank = {rank: fresh.get(worker) for worker, rank in ranks.items() if not self.nodes[worker[0]].failed}
        timeout = float(cluster.collective_timeout_s)
        return WorkerFindings(unanswered(by_rank, generation, timeout), stranded(by_rank, generation, timeout))

    def unreachable(self, workers: list[tuple[int, int]]) -> list[int]:
        """The nodes of ``workers`` whose data plane does not answer: no worker of the node accepts a
        TCP connection at the data-plane address it registered (``oobleck.runtime.liveness.
        DataPlaneProbe``, bound where its process groups bind) within
        ``cluster.data_plane_probe_timeout_s``. All are tried at once. A node cut off from the others'
        data plane, though its agent and the store still reach the controller, is one; so is a node
        whose workers registered no address (they are not probed, and not blamed: empty)."""
        timeout_s = float(self.cfg.cluster.data_plane_probe_timeout_s)
        addresses: dict[int, list[tuple[str, int]]] = {}
        for node, local_rank in workers:
            state = self.nodes.get(node)
            if state is None or state.failed:
                continue
            key = keys.worker_registered(node, local_rank, state.incarnation)
            record = self.store.read(key, node_probes.registration)
            if isinstance(record, dict) and record.get("data_address"):
                host, _, port = str(record["data_address"]).rpartition(":")
                addresses.setdefault(node, []).append((host, int(port)))
        return node_probes.silent_nodes(addresses, timeout_s)

    def node_failed(self, node: int, reason: str, detected: float, cause: float | None = None) -> None:
        state = self.nodes[node]
        if state.failed:
            return
        state.failed = True
        if self.launcher is not None and self.launcher.can_kill(node):
            self.launcher.kill(node, signal.SIGKILL)  # whatever is left of it
        if state.channel is not None:
            state.channel.close()  # no CLOSE-WAIT socket of a dead agent stays behind
        if state.kill_time is not None:
            cause = state.kill_time
        else:
            struck = self.store.read(keys.strike_time(node), node_probes.wall_time)
            cause = struck if isinstance(struck, float) else cause
        cause = cause if cause is not None else detected
        self.event(EventKind.FAILURE, node=node, reason=reason, detect_s=round(detected - cause, 4))
        self._joined.pop(node, None)
        if not self._removed:
            self._first_removal_at = time.monotonic()
        self._removed[node] = (cause, detected - cause)

    def kill(self, node: int, sig: int) -> None:
        """Deliver a fault signal to a whole node (SIGKILL: it crashes; SIGSTOP: it freezes)."""
        state = self.nodes[node]
        state.kill_time = time.time()
        reaches = self.launcher is not None and self.launcher.can_kill(node)
        # The agent signals its own process group at once (``Launcher.signals_land_at_once``).
        agent = None if reaches and self.launcher.signals_land_at_once else state.channel
        if agent is not None:
            agent.send({"type": "kill", "signal": signal.Signals(sig).name})
        # A kill also goes through the launcher, which reaches a node whose agent cannot act (a
        # frozen one); a freeze the agent delivered needs nothing more (and Slurm refuses to stop
        # a step of a multi-node allocation: "Invalid job id specified").
        if reaches and (sig == signal.SIGKILL or agent is None):
            self.launcher.send_signal(node, sig)
        state.frozen = sig == signal.SIGSTOP

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, grace_s: float) -> None:
        self.closing = True
        for state in self.nodes.values():
            if state.channel is not None and not state.failed:
                state.channel.send({"type": "shutdown"})
        if self.launcher is not None:
            self.launcher.shutdown(grace_s)
        for state in self.nodes.values():
            if state.channel is not None:
                state.channel.close()
        if self.port is not None:
            self.port.close()  # its accept thread would keep this object, and the store, alive
        self._boot_waits_end.set()
        for thread in self._boot_waits:
            thread.join(timeout=node_probes.BOOT_POLL_S + 1.0)

    def describe(self) -> dict[int, dict[str, Any]]:
        return {n: dataclasses.asdict(s) | {"channel": s.channel is not None} for n, s in self.nodes.items()}

"""One node's torchft worker short of its training step (``baselines.torchft.worker`` adds that):
what it reads from the controller's store at start (the run config, the lighthouse, the first
plan), the replica group it joins (its Manager, its part of the model, the watch on its peers) and
leaves when the group breaks, torchft's state hooks (what a healing replica receives: the model,
the optimizer and the data position), the harness's strikes and phase timing, and the final record
it leaves at the end."""

from __future__ import annotations

import io
import json
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from baselines.torchft.config import TorchftConfig, require_torchft, run_detection
from baselines.torchft.groups import PeerWatch, group_store, make_manager, vacant_shard
from baselines.torchft.replica import PipelineStage, WholeModel, layer_checksums
from baselines.torchft.service import FINAL_COUNT, final_record
from oobleck.config import from_container, to_container
from oobleck.data import GlobalBatchSampler, build_dataset
from oobleck.errors import RunError
from oobleck.launcher import launcher_class
from oobleck.planning.outputs import ExecutionPlan
from oobleck.runtime import keys
from oobleck.runtime.entry import carry_out_strike, exit_now, read_strike
from oobleck.runtime.liveness import Liveness
from oobleck.runtime.store_client import connect
from oobleck.strategy import strategy_config


class TorchftNode:
    """A torchft worker's place in the run and its replica group (see the module docstring)."""

    def __init__(self, host: str, port: int, node: int, local_rank: int, incarnation: int) -> None:
        self.node, self.local_rank, self.incarnation = node, local_rank, incarnation
        self.space = keys.KeySpace.from_environment()  # the run's secret, handed down by the agent
        self.store = connect(host, port, 60.0, self.space)
        self.cfg = from_container(json.loads(self.store.get(keys.CONFIG)))
        cluster, job = self.cfg.cluster, self.cfg.job
        self.config: TorchftConfig = strategy_config(self.cfg.strategy)  # type: ignore[assignment]
        require_torchft(self.config.log_level)
        # torchft 0.2.0's PGTransport trips torch 2.13's deprecation and read-only buffer warnings.
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchft\.")
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torchft\.")
        if cluster.device != "cpu":
            raise RunError(
                f"strategy=torchft runs torchft's ProcessGroupGloo on CPUs; cluster.device={cluster.device} is not wired up (use cpu)"
            )
        if int(cluster.torch_threads) > 0:
            torch.set_num_threads(int(cluster.torch_threads))
        single_machine = launcher_class(cluster).single_machine
        if single_machine:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # torchft's gloo groups on loopback
        self.liveness = Liveness(
            connect(host, port, 60.0, self.space),
            keys.heartbeat(node, local_rank, incarnation),
            float(cluster.heartbeat_interval_s),
        )
        self.job = job
        self.steps = int(job.steps)
        self.batch = int(job.global_batch_size)
        self.micro = int(job.microbatch_size)
        self.dataset = build_dataset(job, self.cfg.model)
        self.sampler = GlobalBatchSampler(len(self.dataset), self.batch, int(job.seed))
        found = run_detection(self.config, to_container(self.cfg))[0]
        self.pg_timeout_s = found.pg_timeout_s
        # How long a replica may spend in the quorum and the cross-replica all-reduce when a peer
        # replica group is lost: the lighthouse drops it after its heartbeat timeout, a collective
        # it never answers fails after the process-group timeout.
        self.cross_replica_bound_s = found.heartbeat_timeout_ms / 1000 + found.pg_timeout_s
        self.advertised = cluster.master_addr if single_machine else socket.gethostname()
        # The data position travels with the state when a replica heals.
        self.batches_drawn = 0  # attempts so far: the batch index of the next attempt
        self.last_committed_batch = -1
        self.last_shards: list[int] = []  # shards trained in the last committed step
        self.shard: int | None = None  # this replica's fixed shard (async quorum)
        self.healed_at: float | None = None
        self.heal_report: tuple[float, float] | None = None  # (heal_s, join_to_heal_s) until reported
        self.registered_at = 0.0
        self.attempts = self.commits = self.failed_votes = self.failed_since_commit = 0
        self.heals: list[dict[str, float]] = []
        self.strike: dict[str, Any] | None = None
        self.phase_seconds: dict[str, float] = {}
        self.quorum_wait_s = 0.0
        self.manager: Any = None
        self.replica: WholeModel | PipelineStage | None = None
        self.watch: PeerWatch | None = None
        self.left: str | None = None

    # ------------------------------------------------------------------ the replica group
    def _join(self, document: dict[str, Any]) -> bool:
        """Build the Manager and the replica for this node's place in the first plan; False: this node
        stands by (it joined a run of multi-node groups)."""
        plan = ExecutionPlan.from_dict(document["plan"])
        c, cluster = self.config, self.cfg.cluster
        k = int(c.nodes_per_replica)
        self.shards = len(plan.pipelines)
        place = next(((p.index, p.nodes.index(self.node)) for p in plan.pipelines if self.node in p.nodes), None)
        if place is None and k > 1:
            return False
        group, rank = place if place is not None else (None, 0)
        self.shard = group  # a joiner gets one when it heals (groups.vacant_shard)
        members = plan.pipelines[group].nodes if group is not None else (self.node,)
        self.name = members[0]
        self.group_store, self._listener, store_host, store_port = group_store(
            self.store, group, rank, k, self.advertised, float(cluster.startup_timeout_s)
        )
        self.lighthouse = str(json.loads(self.store.get(keys.SERVICES))["lighthouse"])
        self.manager = make_manager(
            c,
            rank=rank,
            world_size=k,
            store_host=store_host,
            store_port=store_port,
            lighthouse=self.lighthouse,
            # torchft reads the trailing digits as the replica group's id
            replica_id=f"node{self.node}" if k == 1 else f"group{group}",
            hostname=self.advertised,
            pg_timeout_s=self.pg_timeout_s,
            state_dict=self._state_dict,
            load_state_dict=self._load_state_dict,
        )
        if k == 1:
            self.replica = WholeModel(self.cfg, self.manager, lambda: self._phase("allreduce"), self._wait_quorum)
            return True
        assert group is not None  # a pipelined replica group has its pipeline
        stage = plan.pipelines[group].template.stages[rank]
        peers = {n: int(document["incarnations"].get(str(n), 0)) for n in members if n != self.node}
        self.watch = PeerWatch(
            connect(self.store.host, self.store.port, 60.0, self.space),
            peers,
            float(cluster.heartbeat_timeout_s),
            float(cluster.heartbeat_interval_s),
            self._peer_lost,
        )
        self.replica = PipelineStage(
            self.cfg,
            self.manager,
            stage.layers,
            rank,
            k,
            self.group_store,
            self.pg_timeout_s,
            self._wait_quorum,
            self.cross_replica_bound_s,
        )
        return True

    def _peer_lost(self, node: int) -> None:
        """From the peer watch: the main thread may be blocked in torchft waiting for that peer."""
        self._leave(f"node {node} of its replica group sent no heartbeat for {self.cfg.cluster.heartbeat_timeout_s} s")
        exit_now(0)

    def _leave(self, why: str) -> None:
        """This node's replica group is broken: say so, stop heartbeating to the lighthouse, leave."""
        self.left = why
        print(
            f"torchft: node {self.node} leaves: {why}; its replica group cannot train any more",
            file=sys.stderr,
            flush=True,
        )
        try:
            self.publish_final()
        except Exception:  # the run's store may be going away too
            pass
        if self.manager is not None:
            self.manager.shutdown(wait=False)

    # ------------------------------------------------------------------ torchft's state hooks
    def _state_dict(self) -> dict[str, Any]:
        assert self.replica is not None
        data = {
            "batches_drawn": self.batches_drawn,
            "last_committed_batch": self.last_committed_batch,
            "shards": list(self.last_shards),
        }
        return {**self.replica.state_dict(), "data": data}

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.replica is not None
        self.replica.load_state_dict(state)
        data = state["data"]
        self.batches_drawn = int(data["batches_drawn"])
        self.last_committed_batch = int(data["last_committed_batch"])
        self.last_shards = [int(s) for s in data["shards"]]
        if self.shard is None:
            self.shard = vacant_shard(self.last_shards, self.shards, self.node % self.shards)
        self.healed_at = time.time()

    # ------------------------------------------------------------------ faults and timing
    def _read_strike(self) -> None:
        key = keys.strike(self.node)
        if self.strike is None and self.store.check([key]):
            self.strike = read_strike(self.store, self.node)  # None: a value the run did not write
            self.store.delete_key(key)
            if self.strike is not None and self.strike["phase"] == "reconfigure":
                raise RunError(
                    "strategy=torchft has no reconfiguration phase to strike in (torchft heals in place); use phase any|forward|backward|allreduce|optimizer"
                )

    def _phase(self, phase: str, step: int | None = None) -> None:
        strike = self.strike
        step = self.manager.current_step() if step is None else step
        if strike is None or strike["phase"] != phase or step < int(strike["step"]):
            return
        self.strike = None
        carry_out_strike(strike, self.store, self.node, f"step {step}, phase {phase}")

    def _wait_quorum(self) -> None:
        started = time.perf_counter()
        self._quorum(self.manager.wait_quorum)
        self.quorum_wait_s += time.perf_counter() - started

    def _quorum(self, call: Callable[[], Any]) -> None:
        """A quorum call of the Manager. Its timeout says only "Timeout expired": the quorum comes
        from the lighthouse, so a lighthouse that does not answer for strategy.quorum_timeout_s
        ends the run with that cause on the line summary.json keeps."""
        try:
            call()
        except TimeoutError as error:
            raise RunError(
                f"torchft: no quorum within strategy.quorum_timeout_s={self.config.quorum_timeout_s:g} s: the "
                f"lighthouse at {self.lighthouse} did not answer (unreachable or down); torchft said: {error}"
            ) from error

    def _time(self, name: str, seconds: float) -> None:
        self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + seconds

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        if self.manager is not None:
            self.manager.shutdown(wait=False)
        self.liveness.stop()

    def publish_final(self) -> None:
        replica = self.replica
        if replica is None:
            return
        if self.cfg.runtime.save_final_params and self.left is None:
            for index, layer in replica.layers().items():
                key = keys.final_params(index)
                if not self.store.check([key]):  # replicas are identical: any one's copy will do
                    buffer = io.BytesIO()
                    torch.save({k: v.detach().cpu() for k, v in layer.state_dict().items()}, buffer)
                    self.store.set(key, buffer.getvalue())
        record = {
            "node": self.node,
            "replica": self.name,
            "stage_last": replica.reports_steps,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "finished": self.left is None,
            "left": self.left,
            "steps": self.manager.current_step(),
            "checksums": layer_checksums(replica.layers(), replica.optimizer),
            "attempts": self.attempts,
            "commits": self.commits,
            "failed_votes": self.failed_votes,
            "heals": self.heals,
        }
        self.store.set(final_record(self.store.add(FINAL_COUNT, 1)), json.dumps(record))
        self.store.set(keys.phase_times(self.node, self.local_rank), json.dumps(self.phase_seconds))

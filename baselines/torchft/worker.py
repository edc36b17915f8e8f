"""The torchft worker: one replica group per node, training the whole model with torchft's Manager.

``python -m baselines.torchft.worker --store HOST:PORT --node-id K --local-rank 0 --incarnation I``
(the CLI of ``oobleck.runtime.worker``; node agents start it because ``Torchft.worker_module``
names it). It reads the run config and the lighthouse address (``keys.SERVICES``) from the
controller's store, hosts its replica group's own TCPStore (torchft's Manager keeps its server
address there), builds the same model and AdamW as ``oobleck.runtime.reference``, registers, and
then loops until ``job.steps`` updates committed:

1. ``Manager.start_quorum()`` (synchronous quorum, ``use_async_quorum=False``): the lighthouse
   returns the replicas taking part, torchft reconfigures its ``ProcessGroupGloo`` when they
   changed, and a replica that is behind (a joiner) receives a live peer's state (``PGTransport``)
   before the step: its model, optimizer and data position;
2. the harness's step-indexed global batch (``GlobalBatchSampler``) of the *batch index* is split
   over the quorum's participants by participating rank, so every update trains one whole global
   batch whatever the quorum size; each replica scales its microbatch losses by 1/global batch;
3. one flat ``Manager.allreduce(SUM)`` of the gradients plus the summed loss and, per
   participant, its node id and heal times (so every replica can report the whole step);
4. ``Manager.should_commit()`` (the vote): on True, clip, set the learning rate of the update
   and step AdamW; the first replica to commit update k reports it (``keys.step_report``, then
   ``keys.decision`` with the step time, under generation 0, so the controller's ledger and
   outputs work unchanged). On False nothing is applied, and the batch index moves on anyway
   (``redo_uncommitted_batches=false``, as torchft's training loops drop a failed step's batch):
   the report of the next committed update counts the batches skipped.

Faults armed at a phase (``strike/<node>``) fire at the same points as in the harness's own worker
(forward, backward, all-reduce, optimizer of the update in flight). At the end every replica
leaves a final record (checksums, attempts, votes, heals; ``baselines.torchft.service``).
A worker that raises writes its traceback to ``error/<node>/<local rank>`` and exits 1
(``oobleck.runtime.entry``, shared with the harness's own worker).
"""

from __future__ import annotations

import io
import json
import os
import socket
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from baselines.torchft.policy import TorchftConfig
from baselines.torchft.service import FINAL_COUNT, final_record, require_torchft
from oobleck.config import from_container
from oobleck.data import GlobalBatchSampler, build_dataset, collate
from oobleck.errors import RunError
from oobleck.launcher import launcher_class
from oobleck.models import build_reference_model, loss_fn
from oobleck.runtime import keys
from oobleck.runtime.comm import make_store
from oobleck.runtime.entry import WorkerArgs, carry_out_strike, exit_now, parse_strike, run_worker, stop_requested
from oobleck.runtime.state import learning_rate, tensor_hash
from oobleck.strategy import strategy_config

# Per participant in the all-reduced tensor: node id + 1, healed this attempt (0/1), seconds the
# heal took (quorum and state transfer), seconds from registering to that heal (a fresh joiner).
SLOT = 4


def host_group_store(addr: str) -> tuple[dist.TCPStore, socket.socket]:
    """A TCPStore for this replica group, listening on ``addr`` only (a free port)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((addr, 0))
    listener.listen(64)
    store = dist.TCPStore(
        addr,
        listener.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=listener.fileno(),
        use_libuv=True,
    )
    return store, listener


class TorchftWorker:
    def __init__(self, host: str, port: int, node: int, local_rank: int, incarnation: int) -> None:
        self.node, self.local_rank, self.incarnation = node, local_rank, incarnation
        self.store = make_store(host, port, 60.0)
        self.cfg = from_container(json.loads(self.store.get(keys.CONFIG)))
        cluster, job = self.cfg.cluster, self.cfg.job
        self.config: TorchftConfig = strategy_config(self.cfg.strategy)  # type: ignore[assignment]
        require_torchft(self.config.log_level)
        # torchft 0.2.0's PGTransport trips torch 2.13's deprecation and read-only buffer warnings.
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchft\.")
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torchft\.")
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport

        if cluster.device != "cpu":
            raise RunError(
                f"strategy=torchft runs torchft's ProcessGroupGloo on CPUs; cluster.device={cluster.device} is not wired up (use cpu)"
            )
        if int(cluster.torch_threads) > 0:
            torch.set_num_threads(int(cluster.torch_threads))
        single_machine = launcher_class(cluster).single_machine
        if single_machine:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # torchft's gloo groups on loopback
        self.job = job
        self.steps = int(job.steps)
        self.batch = int(job.global_batch_size)
        self.micro = int(job.microbatch_size)
        self.dataset = build_dataset(job, self.cfg.model)
        self.sampler = GlobalBatchSampler(len(self.dataset), self.batch, int(job.seed))
        self.model = build_reference_model(self.cfg.model, int(job.seed))
        self.params = list(self.model.parameters())  # a tied weight is one parameter, counted once
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=float(job.lr),
            betas=(float(job.beta1), float(job.beta2)),
            weight_decay=float(job.weight_decay),
        )
        # The data position travels with the state when a replica heals.
        self.batches_drawn = 0  # attempts so far: the batch index of the next attempt
        self.last_committed_batch = -1
        self.healed_at: float | None = None
        self.registered_at = 0.0
        self.attempts = self.commits = self.failed_votes = self.failed_since_commit = 0
        self.heals: list[dict[str, float]] = []
        self.strike: dict[str, Any] | None = None
        self.secret = os.environ.get(keys.SECRET_ENV, "")  # handed down by the agent: strikes and stop are signed
        self.phase_seconds: dict[str, float] = {}

        c = self.config
        advertised = cluster.master_addr if single_machine else socket.gethostname()
        self.group_store, self._listener = host_group_store(advertised)
        self.pg = ProcessGroupGloo(timeout=timedelta(seconds=float(c.pg_timeout_s)))
        services = json.loads(self.store.get(keys.SERVICES))
        self.manager = Manager(
            pg=self.pg,
            load_state_dict=self._load_state_dict,
            state_dict=self._state_dict,
            min_replica_size=int(c.min_replicas),
            use_async_quorum=False,  # the batch is split over the quorum, so it is needed before the forward
            timeout=timedelta(seconds=float(c.timeout_s)),
            quorum_timeout=timedelta(seconds=float(c.quorum_timeout_s)),
            connect_timeout=timedelta(seconds=float(c.connect_timeout_s)),
            rank=0,
            world_size=1,
            store_addr=advertised,
            store_port=self.group_store.port,
            lighthouse_addr=services["lighthouse"],
            replica_id=f"node{node}",  # torchft reads the trailing digits as the replica group id
            hostname=advertised,
            heartbeat_interval=timedelta(milliseconds=int(c.heartbeat_interval_ms)),
            # A healing replica receives the state over the same gloo group (as torchft's train_ddp.py).
            checkpoint_transport=PGTransport(
                self.pg, timeout=timedelta(seconds=float(c.timeout_s)), device=torch.device("cpu")
            ),
            init_sync=False,  # every replica builds the same seeded initial state
        )

    # ------------------------------------------------------------------ torchft's state hooks
    def _state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optim": self.optimizer.state_dict(),
            "data": {"batches_drawn": self.batches_drawn, "last_committed_batch": self.last_committed_batch},
        }

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.batches_drawn = int(state["data"]["batches_drawn"])
        self.last_committed_batch = int(state["data"]["last_committed_batch"])
        self.healed_at = time.time()

    # ------------------------------------------------------------------ faults
    def _read_strike(self) -> None:
        key = keys.strike(self.node)
        if self.strike is None and self.store.check([key]):
            self.strike = parse_strike(self.secret, self.store.get(key))  # None: a foreign write
            self.store.delete_key(key)
            if self.strike is not None and self.strike["phase"] == "reconfigure":
                raise RunError(
                    "strategy=torchft has no reconfiguration phase to strike in (torchft heals in place); use phase any|forward|backward|allreduce|optimizer"
                )

    def _phase(self, phase: str, step: int) -> None:
        strike = self.strike
        if strike is None or strike["phase"] != phase or step < int(strike["step"]):
            return
        self.strike = None
        carry_out_strike(strike, self.store, self.node, f"step {step}, phase {phase}")

    def _time(self, name: str, seconds: float) -> None:
        self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + seconds

    # ------------------------------------------------------------------ training
    def run(self) -> bool:
        """Train until ``job.steps`` updates committed (True) or the run stops (False)."""
        self.registered_at = time.time()  # run_worker registered this worker just now
        self.store.wait([keys.GEN], timedelta(seconds=float(self.cfg.cluster.startup_timeout_s)))
        # torchft needs no new generation; its steps are reported under the first (checkpoints,
        # which would need one, are refused before launch: baselines.torchft.service).
        self.generation = int(self.store.get(keys.GEN))
        while self.manager.current_step() < self.steps:
            if stop_requested(self.store, self.secret):
                return False
            self.attempt()
        self.publish_final()
        return True

    def attempt(self) -> None:
        manager = self.manager
        self._read_strike()
        step = manager.current_step()
        started = time.perf_counter()
        attempt_wall = time.time()
        self.healed_at = None
        manager.start_quorum()  # synchronous: quorum, group reconfiguration and any heal
        quorum_done = time.perf_counter()
        step = manager.current_step()  # a heal brings the step count of the peer
        participants, rank = manager.num_participants(), manager.participating_rank()
        batch = step if self.config.redo_uncommitted_batches else self.batches_drawn
        microbatches = self.batch // self.micro
        lo, hi = (
            (rank * microbatches // participants, (rank + 1) * microbatches // participants)
            if rank is not None
            else (0, 0)
        )

        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        self._phase("forward", step)
        for index, mb in enumerate(range(lo, hi)):
            inputs, targets = collate(self.dataset, self.sampler.microbatch_indices(batch, mb, self.micro))
            loss = loss_fn(self.model(inputs), targets)
            if index == 0:
                self._phase("backward", step)
            (loss / self.batch).backward()
            loss_sum += float(loss.detach())
        if hi == lo:
            self._phase("backward", step)
        computed = time.perf_counter()

        self._phase("allreduce", step)
        slots = torch.zeros(SLOT * participants)
        if rank is not None:
            healed = self.healed_at is not None
            slots[SLOT * rank : SLOT * (rank + 1)] = torch.tensor(
                [
                    self.node + 1.0,
                    1.0 if healed else 0.0,
                    self.healed_at - attempt_wall if healed else 0.0,
                    self.healed_at - self.registered_at if healed and self.commits == 0 else 0.0,
                ]
            )
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor([loss_sum]), slots])
        manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n
        reduced = time.perf_counter()

        committed = manager.should_commit()  # the vote
        voted = time.perf_counter()
        self.attempts += 1
        self.batches_drawn += 1  # the batch is spent whatever the vote (unless redone by config)
        if not committed:
            self.failed_votes += 1
            self.failed_since_commit += 1
            self._time("quorum", quorum_done - started)
            return
        self._phase("optimizer", step)
        if float(self.job.grad_clip) > 0:
            torch.nn.utils.clip_grad_norm_(self.params, float(self.job.grad_clip))
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.job, step)
        self.optimizer.step()
        done = time.perf_counter()
        self.commits += 1
        skipped = batch - self.last_committed_batch - 1
        self.last_committed_batch = batch
        values = flat[offset:].tolist()
        rows = [values[1 + SLOT * r : 1 + SLOT * (r + 1)] for r in range(participants)]
        healed_rows = [r for r in rows if r[1] > 0]
        for r in healed_rows:
            if int(r[0]) - 1 == self.node:
                self.heals.append({"step": step, "heal_s": r[2], "join_to_heal_s": r[3]})
        report = {
            "loss_sum": values[0],
            "samples": microbatches * self.micro,
            "nodes": participants,
            "pipelines": participants,
            "attempts": self.failed_since_commit + 1,
            "batch": batch,
            "skipped_batches": skipped,
            "skipped_samples": skipped * self.batch,
            "replicas": sorted(int(r[0]) - 1 for r in rows),
            "healed": sorted(int(r[0]) - 1 for r in healed_rows),
            "heal_s": round(max((r[2] for r in healed_rows), default=0.0), 4),
            "join_to_heal_s": round(max((r[3] for r in healed_rows), default=0.0), 4),
            "quorum_s": round(quorum_done - started, 4),
        }
        self.failed_since_commit = 0
        # The first replica to commit update ``step`` reports it; its decision (which carries the
        # step time) comes last, so the ledger finds the report when it reads the decision.
        self.store.compare_set(keys.step_report(self.generation, step), "", json.dumps(report))
        self.store.compare_set(keys.decision(self.generation, step), "", keys.commit_decision(False, done - started))
        for name, seconds in (
            ("quorum", quorum_done - started),
            ("forward_backward", computed - quorum_done),
            ("allreduce", reduced - computed),
            ("commit_vote", voted - reduced),
            ("optimizer", done - voted),
        ):
            self._time(name, seconds)

    # ------------------------------------------------------------------ the end
    def checksums(self) -> dict[str, int]:
        """Per layer: a hash of its parameters and AdamW moments (equal on every replica, bit for bit)."""
        result = {}
        for index, layer in enumerate(self.model):
            pieces = []
            for p in layer.parameters():
                state = self.optimizer.state.get(p, {})
                pieces += [p.detach().reshape(-1)] + [
                    state[k].reshape(-1) for k in ("exp_avg", "exp_avg_sq") if k in state
                ]
            result[str(index)] = tensor_hash(torch.cat(pieces))
        return result

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    def publish_final(self) -> None:
        if self.cfg.runtime.save_final_params:
            for index, layer in enumerate(self.model):
                key = keys.final_params(index)
                if not self.store.check([key]):  # replicas are identical: any one's copy will do
                    buffer = io.BytesIO()
                    torch.save({k: v.detach().cpu() for k, v in layer.state_dict().items()}, buffer)
                    self.store.set(key, buffer.getvalue())
        record = {
            "node": self.node,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "finished": True,
            "steps": self.manager.current_step(),
            "checksums": self.checksums(),
            "attempts": self.attempts,
            "commits": self.commits,
            "failed_votes": self.failed_votes,
            "heals": self.heals,
        }
        self.store.set(final_record(self.store.add(FINAL_COUNT, 1)), json.dumps(record))
        self.store.set(keys.phase_times(self.node, self.local_rank), json.dumps(self.phase_seconds))


def main(argv: list[str] | None = None) -> int:
    def build(args: WorkerArgs) -> TorchftWorker:
        return TorchftWorker(args.host, args.port, args.node, args.local_rank, args.incarnation)

    return run_worker("baselines.torchft.worker", __doc__.splitlines()[0], build, argv)


if __name__ == "__main__":
    exit_now(main())

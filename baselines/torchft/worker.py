"""The torchft worker: one node's part of a replica group, trained with torchft's real Manager.

``python -m baselines.torchft.worker --store HOST:PORT --node-id K --local-rank 0 --incarnation I``
(the CLI of ``oobleck.runtime.worker``; node agents start it because ``Torchft.worker_module``
names it). It reads the run config and the lighthouse address (``keys.SERVICES``) from the
controller's store, beats like every worker (``oobleck.runtime.liveness``), reads the first plan
(``keys.plan``: which replica group it belongs to, at which position, with which layers), and
builds its Manager (group rank = position; the group's first node hosts the group's TCPStore)
and its part of the model (``baselines.torchft.replica``). Then, until ``job.steps`` updates
committed, each attempt is torchft's training step:

1. ``Manager.start_quorum()``. ``strategy.async_quorum=true`` (the Manager's default): the quorum
   runs in the background while the replica trains its fixed shard of the batch (``groups``) and
   its gradient reduction waits for it; a replica that is behind (a joiner) is not a participant
   (its gradient counts zero) and applies the state it healed with before the optimizer step.
   ``false``: the quorum (and any heal) first, then the batch is split over the participants by
   participating rank, so every update trains the whole batch.
2. Forward and backward of this replica's microbatches, each summed loss scaled so that the
   quorum's average of the gradients is the gradient of the mean loss over the samples trained;
   the gradient is averaged over the quorum through ``Manager.allreduce`` (torchft's DDP hook, or
   the stage's own reduction). The batch index is ``batches_drawn`` (moves on at every attempt, as
   torchft's data loaders do; it travels with a healed state), or the step with
   ``redo_uncommitted_batches``.
3. A small ``Manager.allreduce`` (sum) by the workers that hold the loss: the summed loss and, per
   participant, its name, shard and heal times, so every replica can report the whole step.
4. ``Manager.should_commit()`` (the vote): on True, clip, set the learning rate of the update and
   step AdamW; the first replica to commit update k reports it (``keys.step_report``, then
   ``keys.decision`` with the step time, under generation 0, so the controller's ledger and outputs
   work unchanged). The report names the batch, the shards trained and what was skipped.

A node of a group of several whose peer is gone leaves (its replica group is broken for good; it
returns, and the harness counts the node lost). A node that joined a run of such groups stands by
until the run ends. Faults armed at a phase (``strike/<node>``) fire at the same points as in the
harness's own worker. At the end every worker leaves a final record (checksums, attempts, votes,
heals; ``baselines.torchft.service``). A worker that raises writes its traceback to
``error/<node>/<local rank>`` and exits 1 (``oobleck.runtime.entry``).

This module holds the training (the step above, repeated) and the CLI; what the worker reads at
start, its replica group, torchft's state hooks, strikes and the final record are
``baselines.torchft.node``.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import torch
from torch.distributed import ReduceOp

from baselines.torchft.config import replica_shards
from baselines.torchft.groups import resolve_shards
from baselines.torchft.node import TorchftNode
from baselines.torchft.replica import GroupLost
from baselines.torchft.report import SLOT, Row, rows_of, step_report
from oobleck.data import collate
from oobleck.runtime import keys
from oobleck.runtime.entry import WorkerArgs, exit_now, run_worker, stop_requested
from oobleck.runtime.state import learning_rate


class TorchftWorker(TorchftNode):
    """torchft's training step, repeated until ``job.steps`` updates commit (module docstring)."""

    # ------------------------------------------------------------------ training
    def run(self) -> bool:
        """Train until ``job.steps`` updates committed (True), or the run stops or this node leaves (False)."""
        self.registered_at = time.time()  # run_worker registered this worker just now
        self.store.wait([keys.GEN], timedelta(seconds=float(self.cfg.cluster.startup_timeout_s)))
        # torchft needs no new generation; its steps are reported under the first (checkpoints,
        # which would need one, are refused before launch: baselines.torchft.service).
        self.generation = int(self.store.get(keys.GEN))
        if not self._join(json.loads(self.store.get(keys.plan(self.generation)))):
            return self._stand_by()
        try:
            while self.manager.current_step() < self.steps:
                if stop_requested(self.store):
                    return False
                self.attempt()
        except GroupLost as error:
            self._leave(f"its replica group failed ({error})")
            return False
        except Exception:
            if self.watch is None:
                raise
            # In a group of several nodes torchft's own calls fail when a peer is gone (its Manager
            # server, its votes): give the peer watch the time to tell, which ends this process.
            cluster = self.cfg.cluster
            time.sleep(float(cluster.heartbeat_timeout_s) + 2 * float(cluster.heartbeat_interval_s))
            raise
        if self.watch is not None:
            self.watch.stop()
        self.publish_final()
        return True

    def _stand_by(self) -> bool:
        """A joined node of a run of multi-node groups: idle until the run stops (the store going
        away ends the wait too)."""
        interval = float(self.cfg.cluster.heartbeat_interval_s)
        while not stop_requested(self.store):
            time.sleep(interval)
        return False

    def _microbatches(self) -> tuple[list[int], float]:
        """This attempt's microbatches and the loss scale that makes the quorum's average exact."""
        microbatches = self.batch // self.micro
        if self.config.async_quorum:
            return list(replica_shards(microbatches, self.shards, self._shard())), self.shards / self.batch
        participants, rank = self.manager.num_participants(), self.manager.participating_rank()
        if rank is None:
            return [], 0.0
        lo, hi = rank * microbatches // participants, (rank + 1) * microbatches // participants
        return list(range(lo, hi)), participants / self.batch

    def attempt(self) -> None:
        manager, replica = self.manager, self.replica
        assert replica is not None
        self._read_strike()
        step = manager.current_step()
        started = time.perf_counter()
        attempt_wall = time.time()
        self.healed_at, self.quorum_wait_s = None, 0.0
        self._quorum(manager.start_quorum)  # async: returns at once; sync: quorum, reconfiguration, any heal
        if not self.config.async_quorum:
            self.quorum_wait_s = time.perf_counter() - started
            step = manager.current_step()  # a heal brings the step count of the peer
            self._note_heal(attempt_wall)
        batch = step if self.config.redo_uncommitted_batches else self.batches_drawn
        microbatches, scale = self._microbatches()

        def load(mb: int) -> tuple[torch.Tensor, torch.Tensor]:
            return collate(self.dataset, self.sampler.microbatch_indices(batch, mb, self.micro))

        replica.zero_grad()
        loss_sum = replica.train(load, microbatches, scale, lambda phase: self._phase(phase, step))
        computed, quorum_in_compute = time.perf_counter(), self.quorum_wait_s
        replica.finish_gradients(lambda phase: self._phase(phase, step))
        reduced = time.perf_counter()
        shared = self._share_step(loss_sum) if replica.reports_steps else None
        shared_at = time.perf_counter()
        committed = manager.should_commit()  # the vote; an async heal is applied here
        voted = time.perf_counter()
        if self.config.async_quorum and self.healed_at is not None:
            self._note_heal(attempt_wall)
            # It trained an old batch on old weights; it now holds its peers' state and data position.
            redo = self.config.redo_uncommitted_batches
            batch = manager.current_step() - (1 if committed else 0) if redo else self.batches_drawn
        self.attempts += 1
        self.batches_drawn += 1  # the batch is spent whatever the vote (unless redone by config)
        if not committed:
            self.failed_votes += 1
            self.failed_since_commit += 1
            self._time("quorum", self.quorum_wait_s)
            return
        step = manager.current_step() - 1  # the update just committed (a replica that healed took its peers' count)
        self._phase("optimizer", step)
        replica.step(float(self.job.grad_clip), learning_rate(self.job, step))
        done = time.perf_counter()
        self.commits += 1
        skipped = batch - self.last_committed_batch - 1
        self.last_committed_batch = batch
        self.failed_since_commit, attempts = 0, self.failed_since_commit + 1
        if shared is not None:  # a healing replica trained an old batch on old weights: it does not report
            self._report(step, batch, skipped, attempts, shared, done - started)
        for name, seconds in (
            ("quorum", self.quorum_wait_s),
            ("forward_backward", computed - started - quorum_in_compute),
            ("allreduce", reduced - computed - (self.quorum_wait_s - quorum_in_compute)),
            ("step_report", shared_at - reduced),
            ("commit_vote", voted - shared_at),
            ("optimizer", done - voted),
        ):
            self._time(name, seconds)

    def _note_heal(self, attempt_wall: float) -> None:
        if self.healed_at is not None:
            joined = self.healed_at - self.registered_at if self.commits == 0 else 0.0
            self.heal_report = (self.healed_at - attempt_wall, joined)
            self.heals.append(
                {"step": self.manager.current_step(), "heal_s": self.heal_report[0], "join_to_heal_s": joined}
            )

    def _share_step(self, loss_sum: float) -> tuple[float, list[Row]] | None:
        """Step 3 of the module docstring: the summed loss and every participant's row (None: this
        replica did not take part, healing, so its loss and data position are not this step's)."""
        manager = self.manager
        participants, rank = manager.num_participants(), manager.participating_rank()
        slots = torch.zeros(SLOT * participants)
        if rank is not None:
            heal = self.heal_report
            row = Row(self.name, self._shard(), heal[0] if heal else None, heal[1] if heal else 0.0)
            slots[SLOT * rank : SLOT * (rank + 1)] = torch.tensor(row.values())
            self.heal_report = None  # reported in a step this replica trained
        flat = torch.cat([torch.tensor([loss_sum], dtype=torch.float32), slots])
        manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        values = flat.tolist()
        return (values[0], rows_of(values[1:])) if rank is not None else None

    def _shard(self) -> int:
        return self.shard if self.shard is not None else self.node % self.shards

    def _report(
        self, step: int, batch: int, skipped: int, attempts: int, shared: tuple[float, list[Row]], step_s: float
    ) -> None:
        loss_sum, rows = shared
        asynchronous = bool(self.config.async_quorum)
        self.last_shards = sorted(r.shard for r in rows)
        if asynchronous and self.config.nodes_per_replica == 1:  # joiners exist only with one-node groups
            self.shard = resolve_shards([(r.name, r.shard) for r in rows], self.shards).get(self.name, self.shard)
        report = step_report(
            rows,
            loss_sum=loss_sum,
            batch=batch,
            batch_size=self.batch,
            shards=self.shards if asynchronous else None,
            skipped_batches=skipped,
            attempts=attempts,
            nodes_per_replica=int(self.config.nodes_per_replica),
            quorum_s=self.quorum_wait_s,
        )
        # The first replica to commit update ``step`` reports it; its decision (which carries the
        # step time) comes last, so the ledger finds the report when it reads the decision.
        self.store.compare_set(keys.step_report(self.generation, step), "", json.dumps(report))
        self.store.compare_set(keys.decision(self.generation, step), "", keys.commit_decision(False, step_s))


def main(argv: list[str] | None = None) -> int:
    def build(args: WorkerArgs) -> TorchftWorker:
        return TorchftWorker(args.host, args.port, args.node, args.local_rank, args.incarnation)

    return run_worker("baselines.torchft.worker", __doc__.splitlines()[0], build, argv)


if __name__ == "__main__":
    exit_now(main())

"""The worker process: one per device, started by its node's agent, never restarted.

``python -m oobleck.runtime.worker --store HOST:PORT --node-id K --local-rank R --incarnation I``
connects to the controller's TCPStore, reads the run config, registers, and then lives through
generations:

1. read the newest plan document that includes this worker (``plan/<g>``, a ``PlanDocument``); a
   plan naming a newer incarnation of this node means a restart replaced this process: it exits;
2. *establish* the generation: build its process groups, then get the state of the layers it
   holds (its stage's and its shadow copies'): load them from the checkpoint the plan names (a
   start, resume or restart), build the seeded initial state (step 0), or receive parameters and
   AdamW state of newly assigned layers (chunked, checksummed) and send those others need; pass
   the ``established`` barrier, drop layers no longer held, report timings and checksums;
3. train from the plan's resume step: the plan's schedule (``oobleck.schedules``: 1F1B, Bamboo's
   redundant forwards, re-routed stages), gradient all-reduce, global-norm clipping, the commit
   decision, the optimizer step, and, when
   the commit says so, snapshot the layers this worker writes and write them in the background.
   An abort of the generation (a membership change) at any wait jumps back to 1 with the state
   of the last committed step intact.

A worker that raises writes its traceback to ``error/<node>/<local rank>`` and exits 1; the
controller stops the run and prints it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from oobleck.data import GlobalBatchSampler, build_dataset
from oobleck.errors import RunError
from oobleck.faults.kinds import Phase
from oobleck.launcher import launcher_class
from oobleck.layer_state import LayerState, layer_checksum, layer_state, learning_rate
from oobleck.models.spec import model_spec
from oobleck.runtime import keys
from oobleck.runtime.backend import open_backend
from oobleck.runtime.checkpointing import CheckpointWriter, restore_layers
from oobleck.runtime.comm import Communicator
from oobleck.runtime.control import ControlWaits
from oobleck.runtime.entry import WorkerArgs, carry_out_strike, exit_now, read_strike, run_worker
from oobleck.runtime.executor import StepContext, clip_and_step, global_grad_norm, run_schedule, sync_gradients
from oobleck.runtime.liveness import DataPlaneProbe, Liveness
from oobleck.runtime.plan_document import PlanDocument
from oobleck.runtime.reaper import Reaper
from oobleck.runtime.resources import resource_probe
from oobleck.runtime.sealed_store import ForeignValue
from oobleck.runtime.store_client import connect
from oobleck.runtime.topology import Topology, build_topology, group_specs
from oobleck.runtime.transfer import PreparedLayers, incoming_layers, probe_links, transfer_state
from oobleck.runtime.waits import Aborted, AbortWatch, Waiter
from oobleck.schema import from_container


class Superseded(Exception):
    """A restart replaced this process (the plan names a newer incarnation of its node)."""


class Worker:
    def __init__(self, host: str, port: int, node: int, local_rank: int, incarnation: int = 0) -> None:
        self.host, self.port = host, port
        self.node, self.local_rank = node, local_rank
        self.incarnation = incarnation
        self.worker = (node, local_rank)
        self.space = keys.KeySpace.from_environment()  # the run's secret, handed down by the agent
        self.store = connect(host, port, 60.0, self.space)
        self.cfg = from_container(json.loads(self.store.get(keys.CONFIG)))
        cluster, job = self.cfg.cluster, self.cfg.job
        self.liveness = Liveness(
            connect(host, port, 60.0, self.space),
            keys.heartbeat(node, local_rank, incarnation),
            float(cluster.heartbeat_interval_s),
        )
        if cluster.torch_threads > 0:
            torch.set_num_threads(int(cluster.torch_threads))
        self.backend = open_backend(cluster, node, local_rank)
        self.data_plane = DataPlaneProbe(launcher_class(cluster).worker_address(cluster, node))
        self.registration = {"data_address": self.data_plane.address}  # see oobleck.runtime.entry.run_worker
        self.device = self.backend.device
        self.timeout_s = float(cluster.collective_timeout_s)
        self.wait_s = float(cluster.startup_timeout_s)
        self.watch = AbortWatch(host, port, self.timeout_s, self.space)
        self.reaper = Reaper(self.timeout_s + float(self.cfg.runtime.reap_margin_s))
        self.waiter = Waiter(
            self.watch, self.timeout_s, float(cluster.heartbeat_timeout_s) + 5.0, self.backend, self.liveness
        )
        self.control = ControlWaits(self.store, self.liveness, self.waiter, self.timeout_s, self.wait_s)
        self.spec = model_spec(self.cfg.model, int(job.seed))
        self.dataset = build_dataset(job, self.cfg.model)
        self.sampler = GlobalBatchSampler(len(self.dataset), int(job.global_batch_size), int(job.seed))
        self.layers: dict[int, LayerState] = {}
        # Pay the optimizer's one-time import cost (seconds) at start-up, not inside the first step.
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
        self.strike: dict[str, Any] | None = None
        self.phase_seconds: dict[str, float] = {}  # where this worker's step time went
        self.bucket_bytes = int(float(self.cfg.runtime.bucket_mb) * (1 << 20))
        self.checkpointer = CheckpointWriter(host, port, self.worker, self.cfg.checkpoint, self.space)

    # ------------------------------------------------------------------ generations
    def run(self) -> None:
        generation = self.control.next_generation(None)
        while generation is not None:
            document = PlanDocument.from_json(self.store.get(keys.plan(generation)))
            if document.incarnation(self.node) > self.incarnation:
                raise Superseded()
            topology = build_topology(document.plan, self.worker, self.spec.tied_layers)
            self.liveness.enter(generation, topology.rank if topology is not None else -1)
            if topology is None:  # not used by this generation: wait for the next one
                generation = self.control.next_generation(generation)
                continue
            self.watch.watch(generation)
            comm = Communicator(
                generation,
                topology.rank,
                group_specs(topology, document.reconfiguration),
                host=self.host,
                port=self.port,
                timeout_s=self.timeout_s,
                waiter=self.waiter,
                space=self.space,
            )
            try:
                self.establish(generation, document, topology, comm)
                finished = self.train(generation, document, topology, comm)
            except Aborted:
                finished = False
            for items, pending in comm.release():
                self.reaper.park(items, pending)
            if finished:
                self.checkpointer.close(float(self.cfg.checkpoint.write_timeout_s))
                return
            generation = self.control.next_generation(generation)

    # ------------------------------------------------------------------ establish
    def establish(self, generation: int, document: PlanDocument, topology: Topology, comm: Communicator) -> None:
        committed = document.resume_step
        held = topology.assignment.held_layers
        load_s = 0.0
        reconfiguration = document.reconfiguration
        if document.load_checkpoint:
            # A start from a checkpoint (a resume or a restart): every worker loads what it holds.
            loading = time.monotonic()
            self.layers = restore_layers(document.load_checkpoint, held, self._empty_layer, committed)
            load_s = time.monotonic() - loading
        elif reconfiguration is None or committed == 0:
            # Before the first commit every layer is its seeded initial state: each worker builds
            # its own (the controller plans no copies then; see DecisionExecutor._reconfigure).
            for index in held:
                if index not in self.layers:
                    self.layers[index] = self._new_layer(index, 0)
        incoming = incoming_layers(topology, reconfiguration)
        empty_layer: Callable[[int], LayerState] = lambda index: self._empty_layer(index, committed)  # noqa: E731
        prepared = None
        if incoming and self.cfg.runtime.prefault_copies and self.device == "cpu":
            prepared = PreparedLayers(incoming, empty_layer)  # while the groups are created
        started = time.monotonic()
        comm.build()
        groups_s = time.monotonic() - started
        self._read_strike()  # a fresh process (a restart) has not read its node's strike yet
        self._fire_strike(Phase.RECONFIGURE, None, generation)
        probe_bytes = int(float(self.cfg.runtime.link_probe_mb) * (1 << 20))
        probes = probe_links(topology, comm, reconfiguration, probe_bytes) if probe_bytes > 0 else {}
        moved = time.monotonic()
        copies = transfer_state(
            topology,
            comm,
            reconfiguration,
            self.layers,
            prepared.take if prepared else empty_layer,
            committed=committed,
            generation=generation,
        )
        missing = [i for i in held if i not in self.layers]
        if missing:
            raise RunError(
                f"generation {generation}: worker {self.worker} was assigned layers {missing} but no transfer provided them"
            )
        transfer_s = time.monotonic() - moved
        count = self.store.add(keys.ready_count(generation), 1)
        if count == len(topology.world):
            self.store.compare_set(keys.established(generation), "", keys.YES)
        what = f"generation {generation} to be established"
        self.control.wait_world(keys.established(generation), what)
        try:
            established = self.store.get(keys.established(generation)).decode()
        except ForeignValue as error:  # never acted on: the controller ends the generation
            with self.liveness.waiting(what):
                self.waiter.await_abort(what, error)
        if established != keys.YES:
            raise Aborted()
        # Every held layer, and every layer this rank copied out (so a copy is compared with its
        # source even when the source drops it now): the controller requires them all to agree.
        checksums = {str(i): layer_checksum(self.layers[i]) for i in sorted(set(held) | set(copies.copied_out))}
        for index in [i for i in self.layers if i not in held]:
            del self.layers[index]
        self.store.set(keys.checksums(generation, topology.rank), json.dumps(checksums))
        self.store.set(
            keys.timing(generation, topology.rank),
            json.dumps(
                {
                    "groups_s": groups_s,
                    "state_copy_s": transfer_s,
                    "load_s": load_s,
                    "bytes_in": copies.bytes_in,
                    "bytes_out": copies.bytes_out,
                    "link_probe_bytes_per_s": probes.get("warm", {}),
                    "link_probe_cold_bytes_per_s": probes.get("cold", {}),
                    "prefault_s": prepared.seconds if prepared else 0.0,
                    "prefault_wait_s": prepared.waited_s if prepared else 0.0,
                }
            ),
        )
        self.store.set(
            keys.probe(generation, topology.rank),
            json.dumps(
                resource_probe(
                    {
                        "pid": os.getpid(),
                        "worker": list(self.worker),
                        "groups": len(comm.groups),
                        "parked": self.reaper.parked(),
                        "dropping": self.reaper.dropping(),
                        "parked_overdue_s": round(self.reaper.overdue_s(), 3),
                        "layers": len(self.layers),
                    }
                )
            ),
        )

    def _new_layer(self, index: int, committed: int) -> LayerState:
        return layer_state(self.spec, self.cfg.job, index, self.device, committed)

    def _empty_layer(self, index: int, committed: int) -> LayerState:
        """A layer whose whole state is about to be overwritten (a copy, a checkpoint)."""
        return layer_state(self.spec, self.cfg.job, index, self.device, committed, initialise=False)

    # ------------------------------------------------------------------ training
    def _read_strike(self) -> None:
        if self.local_rank != 0:
            return
        self.strike = read_strike(self.store, self.node)

    def _fire_strike(self, phase: Phase | str, step: int | None, generation: int) -> None:
        strike = self.strike
        if strike is None or strike["phase"] != phase:
            return
        if phase == Phase.RECONFIGURE:
            if generation < int(strike.get("generation", 1)):
                return
        elif step is None or step < int(strike["step"]):  # armed late: strike at the next chance
            return
        self.strike = None
        carry_out_strike(strike, self.store, self.node, f"step {step}, phase {phase}")

    def train(self, generation: int, document: PlanDocument, topology: Topology, comm: Communicator) -> bool:
        job = self.cfg.job
        ctx = StepContext(
            topology=topology,
            comm=comm,
            layers=self.layers,
            spec=self.spec,
            dataset=self.dataset,
            sampler=self.sampler,
            global_batch_size=int(job.global_batch_size),
            device=self.device,
            bucket_bytes=self.bucket_bytes,
            overlap_grad_reduce=bool(self.cfg.runtime.overlap_grad_reduce),
            record_work=bool(self.cfg.runtime.record_work),
        )
        try:
            return self._train_steps(generation, document, topology, ctx)
        finally:
            ctx.close()

    def _train_steps(self, generation: int, document: PlanDocument, topology: Topology, ctx: StepContext) -> bool:
        job = self.cfg.job
        step = document.resume_step
        world = len(topology.world)
        every_steps = document.checkpoint.every_steps
        times = self.phase_seconds
        while step < int(job.steps):
            self._read_strike()
            current = step
            ctx.hook = lambda phase: self._fire_strike(phase, current, generation)  # noqa: B023 (called within this iteration)
            for layer in self.layers.values():
                layer.zero_grad()
            t0 = time.perf_counter()
            loss = run_schedule(ctx, step)
            t1 = time.perf_counter()
            ctx.phase(Phase.ALLREDUCE)
            sync_gradients(ctx)
            t2 = time.perf_counter()
            norm = global_grad_norm(ctx)
            if topology.is_last:
                self.store.set(keys.loss(generation, step, topology.rank), repr(loss))
            if ctx.record_work:
                self.store.set(keys.work(generation, step, topology.rank), json.dumps(ctx.work))
            # The last rank to vote decides; compare_set hands it the decision that stands (the
            # controller's abort may have come first), and the others read it: two round trips.
            decision = self.control.decide(generation, step, world, every_steps, time.perf_counter() - t0)
            if not keys.is_commit(decision):
                raise Aborted()
            t3 = time.perf_counter()
            ctx.phase(Phase.OPTIMIZER)
            clip_and_step(ctx, norm, float(job.grad_clip), learning_rate(job, step))
            if keys.decision_kind(decision) == keys.COMMIT_CHECKPOINT:
                self.checkpointer.write(step + 1, document.checkpoint, self.layers)
            t4 = time.perf_counter()
            for name, seconds in (
                ("pipeline_1f1b", t1 - t0),
                ("grad_allreduce", t2 - t1),
                ("norm_and_commit", t3 - t2),
                ("optimizer", t4 - t3),
            ):
                times[name] = times.get(name, 0.0) + seconds
            times["redundant_forward"] = times.get("redundant_forward", 0.0) + ctx.redundant_s
            ctx.redundant_s = 0.0
            step += 1
        if self.cfg.runtime.save_final_params:
            self.publish_final_params(topology)
        self.store.set(keys.phase_times(self.node, self.local_rank), json.dumps(times))
        return True

    def publish_final_params(self, topology: Topology) -> None:
        import io

        for index in topology.assignment.layers:
            if topology.norm_owner.get(index) == topology.rank:
                buffer = io.BytesIO()
                torch.save({k: v.detach().cpu() for k, v in self.layers[index].module.state_dict().items()}, buffer)
                self.store.set(keys.final_params(index), buffer.getvalue())


def main(argv: list[str] | None = None) -> int:
    def build(args: WorkerArgs) -> Worker:
        return Worker(args.host, args.port, args.node, args.local_rank, args.incarnation)

    # Superseded: a restart replaced this process; its successor carries on.
    return run_worker("oobleck.runtime.worker", __doc__.splitlines()[0], build, argv, quiet=(Superseded,))


if __name__ == "__main__":
    exit_now(main())

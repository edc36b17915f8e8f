"""Planner outputs: pipeline templates, instantiated execution plans and reconfiguration plans.

These frozen dataclasses are the contract between the planner and everything that consumes a plan
(the runtime, the control plane, the simulator, plan.json). They serialise to plain dicts, so the
controller can publish them through the TCPStore and every process rebuilds the identical plan.

Vocabulary:
- a *stage* is a contiguous layer range ``[start, end)`` on ``gpus`` devices of one node; each of
  those devices holds the whole stage and takes a share of every microbatch (data parallel inside
  the stage), which is what the cost model's ``F/g`` plus an in-node all-reduce describes;
- a *template* is the best stage layout for a node count; a *pipeline* is a template instantiated
  on concrete node ids with a number of microbatches per iteration;
- a *worker* is one device: ``(node id, local rank)``;
- a *shadow* is a redundant copy of another stage's layers that a stage's workers also hold,
  keep identical to the originals (they join those layers' gradient reduction with a zero
  gradient and apply the same optimizer step) and run the forward pass of, redundantly (the
  Bamboo-style strategy; Oobleck's own plans have none); ``ExecutionPlan.redundancy`` says where
  that forward pass runs (``oobleck.schedules.bamboo``);
- a *re-route* (``Reroute``): a pipeline that lost the stage of layers ``[start, end)`` keeps a
  template with a gap there, and each of its microbatches runs those layers on the same stage of
  a peer pipeline (ReCycle-style; ``oobleck.schedules.recycle``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

Worker = tuple[int, int]  # (node id, local rank on that node)


def as_worker(value: Iterable[int]) -> Worker:
    """A worker read back from JSON, where it is a two-element list."""
    node, local_rank = value
    return int(node), int(local_rank)


@dataclass(frozen=True)
class StageSpec:
    """Layers ``[start, end)`` on ``gpus`` devices ``gpu_offset .. gpu_offset+gpus-1`` of pipeline node ``node``."""

    start: int
    end: int
    node: int  # position of the node within its pipeline (0-based), not a node id
    gpu_offset: int
    gpus: int

    @property
    def layers(self) -> range:
        return range(self.start, self.end)


@dataclass(frozen=True)
class PipelineTemplate:
    """The chosen stage layout for ``num_nodes`` nodes, with its cost-model figures."""

    num_nodes: int
    stages: tuple[StageSpec, ...]
    stage_seconds: tuple[float, ...]  # w_i: forward + backward (+ boundary transfer) per microbatch
    stage_memory_bytes: tuple[float, ...]  # peak bytes per device of each stage
    reference_microbatches: int  # the m at which templates were ranked (4 * stages by default)
    reference_iteration_s: float  # predicted iteration time at that m

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PipelineTemplate:
        return cls(
            num_nodes=data["num_nodes"],
            stages=tuple(StageSpec(**stage) for stage in data["stages"]),
            stage_seconds=tuple(data["stage_seconds"]),
            stage_memory_bytes=tuple(data["stage_memory_bytes"]),
            reference_microbatches=data["reference_microbatches"],
            reference_iteration_s=data["reference_iteration_s"],
        )

    @property
    def num_layers(self) -> int:
        return self.stages[-1].end


@dataclass(frozen=True)
class PipelineInstance:
    """A template on concrete nodes, taking microbatches ``[first_microbatch, first_microbatch+microbatches)``."""

    index: int
    template: PipelineTemplate
    nodes: tuple[int, ...]
    microbatches: int
    first_microbatch: int
    predicted_iteration_s: float

    def stage_workers(self, stage: int) -> tuple[Worker, ...]:
        spec = self.template.stages[stage]
        node = self.nodes[spec.node]
        return tuple((node, spec.gpu_offset + g) for g in range(spec.gpus))

    def workers(self) -> tuple[Worker, ...]:
        return tuple(w for s in range(self.template.num_stages) for w in self.stage_workers(s))


@dataclass(frozen=True)
class ShadowCopy:
    """The workers of stage ``stage`` of pipeline ``pipeline`` also hold ``layers`` (see module docstring)."""

    pipeline: int
    stage: int
    layers: tuple[int, ...]


# Where a plan's shadows run their redundant forward pass (oobleck.schedules.bamboo): right after
# the stage's own forward (on the critical path), before the wait for gradients (in the bubble),
# or not at all in steady state (kept in host memory and recomputed on failover).
REDUNDANCY_MODES = ("inline", "eager", "lazy")


@dataclass(frozen=True)
class Reroute:
    """Pipeline ``pipeline`` has no stage for layers ``[start, end)`` (its template leaves a gap
    there): its k-th microbatch (in its own order) runs those layers on the stage of pipeline
    ``via[k]`` that holds exactly them, and comes back to ``pipeline`` for the layers after."""

    pipeline: int
    start: int
    end: int
    via: tuple[int, ...]


@dataclass(frozen=True)
class WorkerAssignment:
    """What one device does in a plan."""

    worker: Worker
    rank: int  # rank in this plan's generation (dense, deterministic order)
    pipeline: int
    stage: int
    shard: int  # index of this device among its stage's devices
    shards: int
    layers: tuple[int, ...]
    shadow_layers: tuple[int, ...] = ()  # redundant copies this device also keeps (ShadowCopy)

    @property
    def held_layers(self) -> tuple[int, ...]:
        """Every layer whose state this device keeps: its stage's layers, then its shadows."""
        return self.layers + tuple(layer for layer in self.shadow_layers if layer not in self.layers)


@dataclass(frozen=True)
class ExecutionPlan:
    """Pipelines covering every live node, and the split of one global batch over them."""

    pipelines: tuple[PipelineInstance, ...]
    num_layers: int
    global_batch_size: int
    microbatch_size: int
    fault_tolerance: int
    gpus_per_node: int
    predicted_iteration_s: float  # max over pipelines: they finish together by construction
    shadows: tuple[ShadowCopy, ...] = ()  # redundant layer copies (Bamboo-style plans only)
    redundancy: str = "inline"  # where the shadows' redundant forward runs: REDUNDANCY_MODES
    reroutes: tuple[Reroute, ...] = ()  # stages served by peer pipelines (ReCycle-style plans only)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.microbatch_size

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(sorted(n for p in self.pipelines for n in p.nodes))

    @property
    def predicted_samples_per_s(self) -> float:
        return self.global_batch_size / self.predicted_iteration_s

    def assignments(self) -> tuple[WorkerAssignment, ...]:
        """Every device's role; ranks follow (pipeline, stage, shard) order."""
        return self._assignments

    # The plan is immutable, so its derived tables are computed once (a reconfiguration reads them
    # several times). cached_property writes the instance __dict__, not a dataclass field: eq,
    # hash, asdict and to_dict do not see it.
    @cached_property
    def _assignments(self) -> tuple[WorkerAssignment, ...]:
        shadowed: dict[tuple[int, int], tuple[int, ...]] = {}
        for shadow in self.shadows:
            key = (shadow.pipeline, shadow.stage)
            shadowed[key] = shadowed.get(key, ()) + tuple(shadow.layers)
        result: list[WorkerAssignment] = []
        for pipeline in self.pipelines:
            for stage_index, stage in enumerate(pipeline.template.stages):
                workers = pipeline.stage_workers(stage_index)
                for shard, worker in enumerate(workers):
                    result.append(
                        WorkerAssignment(
                            worker=worker,
                            rank=len(result),
                            pipeline=pipeline.index,
                            stage=stage_index,
                            shard=shard,
                            shards=len(workers),
                            layers=tuple(stage.layers),
                            shadow_layers=shadowed.get((pipeline.index, stage_index), ()),
                        )
                    )
        return tuple(result)

    def assignment_of(self, worker: Worker) -> WorkerAssignment | None:
        for assignment in self.assignments():
            if assignment.worker == worker:
                return assignment
        return None

    def layer_holders(self) -> dict[int, tuple[Worker, ...]]:
        """For each layer, every device holding it (across all pipelines and stage shards, shadows included)."""
        return dict(self._layer_holders)  # a copy: callers may change theirs

    @cached_property
    def _layer_holders(self) -> dict[int, tuple[Worker, ...]]:
        holders: dict[int, list[Worker]] = {layer: [] for layer in range(self.num_layers)}
        if self.shadows:
            for assignment in self.assignments():
                for layer in assignment.held_layers:
                    holders[layer].append(assignment.worker)
        else:  # the same, in the same order, without building every assignment
            for pipeline in self.pipelines:
                for stage in pipeline.template.stages:
                    workers = [(pipeline.nodes[stage.node], stage.gpu_offset + g) for g in range(stage.gpus)]
                    for layer in stage.layers:
                        holders[layer] += workers
        return {layer: tuple(workers) for layer, workers in holders.items()}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExecutionPlan:
        pipelines = []
        for p in data["pipelines"]:
            pipelines.append(
                PipelineInstance(
                    index=p["index"],
                    template=PipelineTemplate.from_dict(p["template"]),
                    nodes=tuple(p["nodes"]),
                    microbatches=p["microbatches"],
                    first_microbatch=p["first_microbatch"],
                    predicted_iteration_s=p["predicted_iteration_s"],
                )
            )
        shadows = tuple(
            ShadowCopy(pipeline=s["pipeline"], stage=s["stage"], layers=tuple(s["layers"]))
            for s in data.get("shadows", ())
        )
        reroutes = tuple(
            Reroute(pipeline=r["pipeline"], start=r["start"], end=r["end"], via=tuple(r["via"]))
            for r in data.get("reroutes", ())
        )
        fields = {k: v for k, v in data.items() if k not in ("pipelines", "shadows", "reroutes")}
        return cls(pipelines=tuple(pipelines), shadows=shadows, reroutes=reroutes, **fields)

    def iter_microbatches(self) -> Iterator[tuple[int, int]]:
        """(pipeline index, global microbatch index) for every microbatch of one iteration."""
        for pipeline in self.pipelines:
            for mb in range(pipeline.first_microbatch, pipeline.first_microbatch + pipeline.microbatches):
                yield pipeline.index, mb


@dataclass(frozen=True)
class LayerTransfer:
    """Copy chunk ``chunk`` of ``chunks`` of layer ``layer``'s state from ``source`` to ``target``.

    A layer is split into ``chunks`` equal parts (by flattened element range), one per surviving
    holder it is copied from, so no single source sends it all. When several workers need the
    layer, each chunk travels down a chain through them: its surviving holder sends it to the
    first (``hop`` 0), which relays it to the second (``hop`` 1), and so on, so every holder sends
    each chunk at most once however many workers need it. A relayed chunk moves in ``pieces``
    equal parts, each forwarded as soon as it has arrived, so the chain streams rather than
    waiting hop by hop (``oobleck.runtime.transfer``).
    """

    layer: int
    source: Worker  # a surviving holder (hop 0), or the worker that received this chunk at hop - 1
    target: Worker
    chunk: int
    chunks: int
    nbytes: int  # parameter bytes of this chunk (optimizer state moves with it)
    hop: int = 0
    pieces: int = 1

    @classmethod
    def of_rows(cls, rows: Iterable[tuple]) -> tuple[LayerTransfer, ...]:
        """The transfers whose fields are ``rows``' tuples, in order: the objects ``cls(*row)``
        makes, without the frozen ``__init__``'s cost (a reconfiguration builds thousands)."""
        new, made = object.__new__, []
        for layer, source, target, chunk, chunks, nbytes, hop, pieces in rows:
            transfer = new(cls)
            transfer.__dict__.update(
                layer=layer,
                source=source,
                target=target,
                chunk=chunk,
                chunks=chunks,
                nbytes=nbytes,
                hop=hop,
                pieces=pieces,
            )
            made.append(transfer)
        return tuple(made)


@dataclass(frozen=True)
class ReconfigurationPlan:
    """How to go from ``old`` to ``new`` after ``removed`` nodes failed and ``joined`` nodes arrived.

    ``standby``: alive nodes the new plan leaves out (a join no template size can use, or more
    nodes than pipelines can cover); pass them back to the next ``reconfigure`` as ``standby``.
    ``min_bytes_moved``: the least parameter bytes any placement of the new plan's pipelines on
    the alive nodes must copy (the assignment optimum; the plan's transfers achieve it).
    ``replanned``: the new plan was instantiated afresh rather than regrouped around the
    pipelines that lost no node; ``reason`` says which and the cost-model figures behind it.
    ``new.fault_tolerance`` is what the new plan tolerates (at most the job's f): lower than the
    job's f means fault tolerance dropped.
    """

    old: ExecutionPlan
    new: ExecutionPlan
    removed: tuple[int, ...]
    joined: tuple[int, ...]
    transfers: tuple[LayerTransfer, ...]
    standby: tuple[int, ...] = ()
    min_bytes_moved: int = 0
    replanned: bool = False
    reason: str = ""

    @property
    def bytes_moved(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "old": self.old.to_dict(),
            "new": self.new.to_dict(),
            "removed": list(self.removed),
            "joined": list(self.joined),
            "transfers": [asdict(t) for t in self.transfers],
            "standby": list(self.standby),
            "min_bytes_moved": self.min_bytes_moved,
            "replanned": self.replanned,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReconfigurationPlan:
        return cls(
            old=ExecutionPlan.from_dict(data["old"]),
            new=ExecutionPlan.from_dict(data["new"]),
            removed=tuple(data["removed"]),
            joined=tuple(data["joined"]),
            transfers=tuple(
                LayerTransfer(
                    layer=t["layer"],
                    source=as_worker(t["source"]),
                    target=as_worker(t["target"]),
                    chunk=t["chunk"],
                    chunks=t["chunks"],
                    nbytes=t["nbytes"],
                    hop=int(t.get("hop", 0)),
                    pieces=int(t.get("pieces", 1)),
                )
                for t in data["transfers"]
            ),
            standby=tuple(data.get("standby", ())),
            min_bytes_moved=int(data.get("min_bytes_moved", 0)),
            replanned=bool(data.get("replanned", False)),
            reason=str(data.get("reason", "")),
        )


def tolerated_failures(plan: ExecutionPlan) -> int:
    """How many node failures ``plan`` survives with every layer keeping a live replica.

    The worst case kills every node holding the least-replicated layer, so it is that layer's
    count of distinct holder nodes, minus one (k pipelines that each hold every layer: k - 1).
    Counts every holder ``ExecutionPlan.layer_holders`` reports.
    """
    if not plan.shadows:
        # Every pipeline holds every layer once, on nodes no other pipeline has.
        return max(0, len(plan.pipelines) - 1) if plan.num_layers else 0
    holders = plan.layer_holders()
    if not holders:
        return 0
    return max(0, min(len({worker[0] for worker in workers}) for workers in holders.values()) - 1)

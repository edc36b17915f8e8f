"""The simulator's cost model beyond the planner's: state sizes, transfers, checkpoints, restarts.

Iteration times always come from the planner's cost model (``pipeline_iteration_time``, paper
Eq. 1-4, on the templates' stage times), so every strategy is timed by the same formula. This
module adds what the planner does not model, every figure from bytes over a bandwidth of the
same cluster model (never seconds measured on another cluster):

- model state: ``state_bytes_per_param`` bytes per parameter in device memory (fp32 Adam:
  parameters, gradients and two moments = 16, DESIGN section 3); moving a layer to a new holder
  sends parameters and the two Adam moments (``moved_bytes_per_param``, 12: gradients are
  recomputed, not moved); a checkpoint holds the same 12 bytes per parameter
  (``checkpoint_bytes_per_param``: what ``oobleck.checkpoint`` writes per layer);
- a transfer set takes ``max(bytes into one node, bytes out of one node) / link bandwidth``: the
  nodes send and receive in parallel over their own links;
- storage: checkpoint writes and reads go at ``storage_write_gbps`` / ``storage_read_gbps`` per
  node (by default the node's own link) and share ``storage_aggregate_gbps`` among every node
  reading or writing at once (``storage_s``: the busiest node's bytes over its bandwidth, or all
  bytes over the aggregate, whichever takes longer; None: no shared limit);
- a checkpoint (``checkpoint_cost``) is what the checkpoint subsystem does: every layer is written
  once, by the holder ``assign_checkpoint_writers`` picks (writers spread over the nodes); each
  writer first copies its layers to host memory (``snapshot_s``: its bytes over
  ``host_copy_gbps``), then writes them to storage (``write_s``, ``storage_s`` of the writers). With
  ``checkpoint_async`` (the runtime's ``checkpoint.async_write``) only the snapshot is on the
  training path, and a checkpoint waits for the previous one's write (``checkpoint.max_pending:
  1``); the checkpoint is durable (a restart can roll back to it) only once its write is done;
- a restart (``restart_parts``), from components: the failure is detected (``detect_s``; not for
  a planned restart or a start), every worker process stops and fresh ones start
  (``restart_fixed_s``: interpreter, framework imports, device context), the process groups form
  (``group_init_s + group_init_per_node_s * nodes``: rendezvous and communicator set-up grow with
  the nodes), each node builds its model state on its devices (its state bytes over
  ``model_build_gbps``), reads the checkpointed state of the layers it holds (``restore_s``, a
  ``storage_s`` of every node at once), and the first step runs (``restart_warmup_s`` beyond a
  steady one). A job's first start pays the same, without detection or reading;
- a reconfiguration or failover in place: ``detect_s`` (for a failure, not a join), its fixed part
  (``reconfigure_fixed_s``, ``failover_s``: planning and new process groups), the layer copies
  over the links and ``warmup_s``;
- Varuna's and Bamboo's D identical pipelines are timed by the planner's own
  ``plan_iteration_time`` (slowest pipeline, then the cross-pipeline ring all-reduce), so all
  three strategies share one formula;
- ``CostConstants``: those constants, one typed block (``costs:``) in every strategy's config
  (``sim.costs`` sets the cluster's for every strategy of an experiment); the charge of each kind
  of decision is ``oobleck.sim.charges.decision_downtime``.

What the real runtime on one machine spends beyond Eq. 1-4, measured on calibration runs, is the
runtime model of ``oobleck.sim.runtime_model``; ``RuntimeOverhead.costs`` puts what it measured
in place of these constants.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from oobleck.errors import ConfigError
from oobleck.planning.inputs import GB, ModelProfile
from oobleck.planning.outputs import ExecutionPlan, LayerTransfer

FP32_BYTES = 4  # LayerProfile.param_bytes counts fp32 parameters


@dataclass
class CostConstants:
    """What the simulator charges a strategy's decisions (``costs:`` in conf/strategy/<name>.yaml,
    where every value carries its source; ``sim.costs`` in an experiment sets the cluster's)."""

    state_bytes_per_param: float = 16.0  # fp32 Adam: parameters, gradients, two moments (DESIGN 3)
    # Parameters and two Adam moments move with a layer; gradients are recomputed.
    moved_bytes_per_param: float = 12.0
    # A checkpoint holds parameters and two Adam moments (oobleck.checkpoint's shards).
    checkpoint_bytes_per_param: float = 12.0
    # Device -> host memory, per device (the checkpoint snapshot): PCIe 4.0 x16 moves 31.5 GB/s
    # each way (16 GT/s x 16 lanes, 128b/130b; the A100's host link); we assume 80% of it.
    host_copy_gbps: float = 25.0
    # Per node, to and from checkpoint storage; None: the node's link (cluster.inter_node_bandwidth_gbps).
    storage_write_gbps: float | None = None
    storage_read_gbps: float | None = None
    # Shared by every node reading or writing checkpoint storage at once; None: no shared limit.
    storage_aggregate_gbps: float | None = None
    # Only the snapshot is on the training path (checkpoint.async_write); false: the write too.
    checkpoint_async: bool = True
    # From a failure to the control plane acting on it (charged before a reconfiguration, failover
    # or restart caused by a failure; never for a join, a start or a planned restart).
    detect_s: float = 0.0
    # A restart's worker processes stop and fresh ones start (interpreter, framework imports,
    # device context); a job's first start pays it too. 2.5 s: a fresh CPU worker's imports here
    # (README, "Start-up": ~1.5 s importing torch and ~1 s torch._dynamo); an experiment sets its
    # cluster's in sim.costs.
    restart_fixed_s: float = 2.5
    # The new process groups of a restart or start: rendezvous plus communicator set-up, a part
    # that grows with the nodes (group_init_s + group_init_per_node_s * nodes).
    group_init_s: float = 0.0
    group_init_per_node_s: float = 0.0
    # Bytes of model state per second one node builds on its devices (parameters and optimizer
    # state of the layers it holds) on a restart or start; None: free.
    model_build_gbps: float | None = None
    reconfigure_fixed_s: float = 2.0  # plan + new process groups, before any state moves
    failover_s: float = 1.0  # a predecessor taking over a stage it already holds
    # What the first step of new process groups (a reconfiguration) or of new workers (a start or
    # restart) takes beyond a steady step.
    warmup_s: float = 0.0
    restart_warmup_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("state_bytes_per_param", "moved_bytes_per_param", "checkpoint_bytes_per_param", "host_copy_gbps"):
            _positive(f"costs.{name}", getattr(self, name))
        for name in ("storage_write_gbps", "storage_read_gbps", "storage_aggregate_gbps", "model_build_gbps"):
            if getattr(self, name) is not None:
                _positive(f"costs.{name}", getattr(self, name))
        for name in SECONDS:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ConfigError(f"costs.{name}={value!r} must be a finite number >= 0 seconds")

    def storage_write(self, link: float) -> float:
        """Bytes/s one node writes to checkpoint storage (``link``: its network bytes/s)."""
        return self.storage_write_gbps * GB if self.storage_write_gbps is not None else link

    def storage_read(self, link: float) -> float:
        return self.storage_read_gbps * GB if self.storage_read_gbps is not None else link

    def group_init(self, nodes: int) -> float:
        """Seconds for the process groups of a restart or start on ``nodes`` nodes."""
        return self.group_init_s + self.group_init_per_node_s * nodes


# CostConstants fields that are seconds (checked >= 0).
SECONDS = (
    "detect_s",
    "restart_fixed_s",
    "group_init_s",
    "group_init_per_node_s",
    "reconfigure_fixed_s",
    "failover_s",
    "warmup_s",
    "restart_warmup_s",
)


def storage_s(per_node_bytes: Iterable[float], per_node_bps: float, aggregate_bps: float | None) -> float:
    """Seconds for nodes moving ``per_node_bytes`` to or from storage at once: the busiest node at
    its own bandwidth, or every byte through the shared aggregate, whichever takes longer (the two
    bounds of a fair share of the aggregate; equal when every node moves the same bytes)."""
    sizes = [b for b in per_node_bytes if b > 0]
    if not sizes:
        return 0.0
    seconds = max(sizes) / per_node_bps
    if aggregate_bps is not None:
        seconds = max(seconds, sum(sizes) / aggregate_bps)
    return seconds


def _positive(key: str, value: Any) -> None:
    if not (isinstance(value, (int, float)) and value > 0):
        raise ConfigError(f"{key}={value!r} must be a positive number")


def layer_params(profile: ModelProfile, start: int, end: int) -> int:
    """Parameters of layers ``[start, end)``."""
    return sum(layer.param_bytes for layer in profile.layers[start:end]) // FP32_BYTES


def model_state_bytes(profile: ModelProfile, state_bytes_per_param: float) -> float:
    """Bytes of the full training state (parameters, gradients, optimizer) of one model replica."""
    return profile.param_bytes / FP32_BYTES * state_bytes_per_param


def transfer_s(transfers: Iterable[tuple[Any, Any, float]], bandwidth: float) -> float:
    """Seconds for ``(source node, target node, bytes)`` transfers that run in parallel per node link."""
    into: dict[Any, float] = defaultdict(float)
    out: dict[Any, float] = defaultdict(float)
    for source, target, nbytes in transfers:
        if source == target:
            continue  # same node: a local copy, not a network transfer
        into[target] += nbytes
        out[source] += nbytes
    busiest = max([*into.values(), *out.values()], default=0.0)
    return busiest / bandwidth


def layer_transfer_s(transfers: Sequence[LayerTransfer], bandwidth: float, moved_per_param_byte: float) -> float:
    """Seconds to carry out a reconfiguration's layer transfers (workers grouped by node)."""
    return transfer_s(
        ((t.source[0], t.target[0], t.nbytes * moved_per_param_byte) for t in transfers),
        bandwidth,
    )


@dataclass(frozen=True)
class CheckpointCost:
    """One checkpoint of one plan: bytes written and the two parts of its time."""

    nbytes: float  # written in all (each layer once)
    snapshot_s: float  # the busiest writer's device -> host copy
    write_s: float  # the busiest node's write to storage

    def pause_s(self, costs: CostConstants, interval_s: float) -> float:
        """Seconds training stops per checkpoint when one is taken every ``interval_s`` of training:
        the snapshot, plus (asynchronous writes) waiting for the previous write when storage is
        slower than the interval, or (synchronous) the whole write."""
        if not costs.checkpoint_async:
            return self.snapshot_s + self.write_s
        return self.snapshot_s + max(0.0, self.write_s - interval_s)

    def durable_after_s(self, costs: CostConstants) -> float:
        """Seconds from the end of the pause until the checkpoint can be restored from."""
        return self.write_s if costs.checkpoint_async else 0.0


def checkpoint_bytes(profile: ModelProfile, costs: CostConstants) -> list[float]:
    """Bytes of each layer's checkpoint shard."""
    per_param_byte = costs.checkpoint_bytes_per_param / FP32_BYTES
    return [layer.param_bytes * per_param_byte for layer in profile.layers]


@dataclass(frozen=True)
class WrittenBytes:
    """What one checkpoint of a plan writes: in all, per writing worker and per node."""

    total: float
    per_worker: tuple[float, ...]
    per_node: tuple[float, ...]


def written_bytes(plan: ExecutionPlan, profile: ModelProfile, costs: CostConstants) -> WrittenBytes:
    """Every layer once, by the holder ``assign_checkpoint_writers`` picks (writers spread)."""
    from oobleck.checkpoint.assignment import assign_checkpoint_writers

    sizes = checkpoint_bytes(profile, costs)
    writers = assign_checkpoint_writers(plan.layer_holders(), dict(enumerate(sizes)))
    per_worker: dict[Any, float] = defaultdict(float)
    per_node: dict[int, float] = defaultdict(float)
    for layer, worker in writers.items():
        per_worker[worker] += sizes[layer]
        per_node[worker[0]] += sizes[layer]
    return WrittenBytes(sum(sizes[layer] for layer in writers), tuple(per_worker.values()), tuple(per_node.values()))


def checkpoint_cost(
    plan: ExecutionPlan,
    profile: ModelProfile,
    costs: CostConstants,
    link: float,
    *,
    written: WrittenBytes | None = None,
) -> CheckpointCost:
    """A checkpoint of ``plan`` as ``oobleck.checkpoint`` takes it (module docstring); ``written``:
    its ``written_bytes`` when already known."""
    written = written or written_bytes(plan, profile, costs)
    return CheckpointCost(
        nbytes=written.total,
        snapshot_s=max(written.per_worker, default=0.0) / (costs.host_copy_gbps * GB),
        write_s=storage_s(written.per_node, costs.storage_write(link), _aggregate(costs)),
    )


def _aggregate(costs: CostConstants) -> float | None:
    return costs.storage_aggregate_gbps * GB if costs.storage_aggregate_gbps is not None else None


def held_bytes_per_node(plan: ExecutionPlan, profile: ModelProfile, bytes_per_param: float) -> list[float]:
    """Per node, ``bytes_per_param`` times the parameters of the layers its workers hold (a layer
    split over a stage's GPUs counts once per node)."""
    per_param_byte = bytes_per_param / FP32_BYTES
    held: dict[int, set[int]] = defaultdict(set)
    for assignment in plan.assignments():
        held[assignment.worker[0]].update(assignment.held_layers)
    return [sum(profile.layers[layer].param_bytes for layer in layers) * per_param_byte for layers in held.values()]


def restore_s(plan: ExecutionPlan, profile: ModelProfile, costs: CostConstants, link: float) -> float:
    """Seconds for every node to read the checkpointed state of the layers its workers hold, all
    nodes at once (``storage_s``)."""
    per_node = held_bytes_per_node(plan, profile, costs.checkpoint_bytes_per_param)
    return storage_s(per_node, costs.storage_read(link), _aggregate(costs))


@dataclass(frozen=True)
class RestartCost:
    """The parts of a restart (or start) onto one plan that depend on the plan (module docstring):
    the fixed process start, the process groups of its nodes, building the model state on the
    devices, and reading the checkpoint back."""

    process_start_s: float
    group_init_s: float
    model_build_s: float
    load_s: float


def restart_cost(
    plan: ExecutionPlan,
    profile: ModelProfile,
    costs: CostConstants,
    link: float,
    *,
    held: dict[float, list[float]] | None = None,
) -> RestartCost:
    """``RestartCost`` of starting fresh workers on ``plan``; ``held``: ``held_bytes_per_node`` by
    bytes per parameter, when already known."""

    def per_node(bytes_per_param: float) -> list[float]:
        if held is not None and bytes_per_param in held:
            return held[bytes_per_param]
        return held_bytes_per_node(plan, profile, bytes_per_param)

    build = 0.0
    if costs.model_build_gbps is not None:
        build = max(per_node(costs.state_bytes_per_param), default=0.0) / (costs.model_build_gbps * GB)
    reads = per_node(costs.checkpoint_bytes_per_param)
    return RestartCost(
        process_start_s=costs.restart_fixed_s,
        group_init_s=costs.group_init(len(plan.nodes)),
        model_build_s=build,
        load_s=storage_s(reads, costs.storage_read(link), _aggregate(costs)),
    )

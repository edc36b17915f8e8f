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
- a checkpoint (``checkpoint_cost``) is what the checkpoint subsystem does: every layer is written
  once, by the holder ``assign_checkpoint_writers`` picks (writers spread over the nodes); each
  writer first copies its layers to host memory (``snapshot_s``: its bytes over
  ``host_copy_gbps``), then writes them to storage (``write_s``: the busiest node's bytes over
  ``storage_write_gbps``, by default the node's own link). With ``checkpoint_async`` (the
  runtime's ``checkpoint.async_write``) only the snapshot is on the training path, and a
  checkpoint waits for the previous one's write (``checkpoint.max_pending: 1``); the checkpoint is
  durable (a restart can roll back to it) only once its write is done;
- a restart (``restart_s``): every worker process stops and fresh ones start and rendezvous
  (``restart_fixed_s``), then each node reads the checkpointed state of the layers it holds
  (its bytes over ``storage_read_gbps``, by default its link), then the first step runs
  (``restart_warmup_s`` beyond a steady one). A job's first start pays the same, without the read;
- Varuna's and Bamboo's D identical pipelines are timed by the planner's own
  ``plan_iteration_time`` (slowest pipeline, then the cross-pipeline ring all-reduce), so all
  three strategies share one formula;
- ``CostConstants``: those constants, one typed block (``costs:``) in every strategy's config
  (``sim.costs`` sets the cluster's for every strategy of an experiment); the charge of each kind
  of decision is ``oobleck.sim.engine.decision_downtime``;
- ``RuntimeOverhead``: what the real runtime on one machine spends beyond Eq. 1-4 (per microbatch,
  per step, CPU cores shared by the workers, the fixed part of a reconfiguration and the first
  step's warm-up, the fixed part of a restart), measured on calibration runs by
  ``oobleck.sim.validate.calibrate``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
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
    # Only the snapshot is on the training path (checkpoint.async_write); false: the write too.
    checkpoint_async: bool = True
    # A restart's processes stop, start again and rendezvous before the checkpoint is read; a
    # job's first start pays it too. 78 s: the Oobleck artifact's Varuna restart of GPT-3 medium
    # (78.7 s, SymbioticLab/Oobleck sosp23-artifact, tools/simulator/varuna_simulator.py,
    # local_rendezvous_timeout_delta), whose checkpoint our cluster model reads in under a second:
    # the part of a restart that does not grow with the model.
    restart_fixed_s: float = 78.0
    reconfigure_fixed_s: float = 2.0  # detect + plan + new process groups, before any state moves
    failover_s: float = 1.0  # a predecessor taking over a stage it already holds
    # What the first step of new process groups (a reconfiguration) or of new workers (a start or
    # restart) takes beyond a steady step.
    warmup_s: float = 0.0
    restart_warmup_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("state_bytes_per_param", "moved_bytes_per_param", "checkpoint_bytes_per_param", "host_copy_gbps"):
            _positive(f"costs.{name}", getattr(self, name))
        for name in ("storage_write_gbps", "storage_read_gbps"):
            if getattr(self, name) is not None:
                _positive(f"costs.{name}", getattr(self, name))
        for name in ("restart_fixed_s", "reconfigure_fixed_s", "failover_s", "warmup_s", "restart_warmup_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"costs.{name}={getattr(self, name)!r} must be >= 0 seconds")

    def storage_write(self, link: float) -> float:
        """Bytes/s one node writes to checkpoint storage (``link``: its network bytes/s)."""
        return self.storage_write_gbps * GB if self.storage_write_gbps is not None else link

    def storage_read(self, link: float) -> float:
        return self.storage_read_gbps * GB if self.storage_read_gbps is not None else link


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


def checkpoint_cost(plan: ExecutionPlan, profile: ModelProfile, costs: CostConstants, link: float) -> CheckpointCost:
    """A checkpoint of ``plan`` as ``oobleck.checkpoint`` takes it (module docstring)."""
    from oobleck.checkpoint.assignment import assign_checkpoint_writers

    sizes = checkpoint_bytes(profile, costs)
    writers = assign_checkpoint_writers(plan.layer_holders(), dict(enumerate(sizes)))
    per_worker: dict[Any, float] = defaultdict(float)
    per_node: dict[int, float] = defaultdict(float)
    for layer, worker in writers.items():
        per_worker[worker] += sizes[layer]
        per_node[worker[0]] += sizes[layer]
    return CheckpointCost(
        nbytes=sum(sizes[layer] for layer in writers),
        snapshot_s=max(per_worker.values(), default=0.0) / (costs.host_copy_gbps * GB),
        write_s=max(per_node.values(), default=0.0) / costs.storage_write(link),
    )


def restore_s(plan: ExecutionPlan, profile: ModelProfile, costs: CostConstants, link: float) -> float:
    """Seconds for every node to read the checkpointed state of the layers its workers hold."""
    sizes = checkpoint_bytes(profile, costs)
    per_node: dict[int, float] = defaultdict(float)
    for assignment in plan.assignments():
        per_node[assignment.worker[0]] += sum(sizes[layer] for layer in assignment.held_layers)
    return max(per_node.values(), default=0.0) / costs.storage_read(link)


@dataclass(frozen=True)
class StepShape:
    """What the runtime step model needs to know of a layout (``oobleck.sim.validate.step_shape``)."""

    planner_s: float  # the planner's predicted iteration (Eq. 1-4: its critical path)
    busiest_microbatches: int  # microbatches of the busiest pipeline
    stage_microbatches: int  # sum over pipelines of microbatches x stages: stage runs per step
    workers: int
    compute_s: float  # the profile's compute of every worker in one step, summed (redundant forward included)


@dataclass(frozen=True)
class RuntimeOverhead:
    """The real runtime's step and recovery time on one machine, beyond the planner's Eq. 1-4.

    A layout's step (commit to commit) takes the longer of its critical path and the CPU it needs
    from the machine's ``cores``:

        critical = planner_s + busiest_microbatches * per_microbatch_s + per_step_s
        cpu      = (compute_scale * compute_s + stage_microbatches * per_microbatch_s
                    + workers * per_worker_s) / cores
        step     = max(critical, cpu)

    - ``planner_s``: the planner's predicted iteration (per-layer compute from the profile);
    - ``per_microbatch_s``: seconds per microbatch a stage runs that Eq. 1-4 does not see (Python
      per op, point-to-point and launch latency, loss and bookkeeping);
    - ``per_step_s``: seconds per step on the critical path (gradient all-reduce latency,
      optimizer, commit barrier with the controller);
    - the CPU floor: the worker processes are CPU-bound and share ``cores`` cores, so a step takes
      at least every worker's CPU time over the cores: its compute (``compute_scale`` times the
      profile's, which was measured on an idle core) plus its per-microbatch overheads plus
      ``per_worker_s`` per worker per step (its optimizer, its share of the collectives and of the
      commit protocol). Workers that wait in a pipeline's bubble use no CPU, which a uniform
      ``workers / cores`` slow-down (the model before) charged them.

    A reconfiguration (or failover) takes ``reconfigure_fixed_s`` (failure detection + planning +
    process-group rebuild, the runtime's own ``detect_s + plan_s + groups_s``) plus the state copy
    (bytes over the link, as in the planner) plus ``warmup_s`` (what the first step of a new
    generation takes beyond a steady one) plus the redone step. A restart takes
    ``restart_fixed_s * dilation(restarted workers)`` (detection to the new workers' process groups:
    their boot is CPU-bound on the shared cores) plus reading the checkpoint at
    ``storage_read_gbps`` plus ``restart_warmup_s``; a checkpoint's snapshot and write run at
    ``host_copy_gbps`` and ``storage_write_gbps``; a Bamboo layout puts ``redundant_exposed`` of its
    redundant forward on the critical path. These are measured on calibration runs of the
    strategy that needs them (None: no such run, the strategy's own constants stay). Every value
    is measured on a calibration run (``source`` names it), never on the run it predicts.
    """

    per_microbatch_s: float
    per_step_s: float
    cores: int
    reconfigure_fixed_s: float
    warmup_s: float
    source: str = ""
    failover_fixed_s: float | None = None  # None: reconfigure_fixed_s
    restart_fixed_s: float | None = None
    restart_warmup_s: float | None = None
    host_copy_gbps: float | None = None
    storage_write_gbps: float | None = None
    storage_read_gbps: float | None = None
    redundant_exposed: float | None = None
    per_worker_s: float = 0.0
    compute_scale: float = 1.0

    def dilation(self, workers: int) -> float:
        """How much slower each of ``workers`` busy processes runs on the machine's cores."""
        return max(1.0, workers / self.cores)

    def step_s(self, shape: StepShape) -> float:
        """Predicted seconds of one step (commit to commit) of a layout."""
        return step_model(
            shape, self.cores, self.per_microbatch_s, self.per_step_s, self.per_worker_s, self.compute_scale
        )

    def costs(self, base: CostConstants, restarted_workers: int) -> CostConstants:
        """``base`` with every term this calibration measured (restarts of ``restarted_workers``)."""
        from dataclasses import replace

        measured: dict[str, Any] = {
            "reconfigure_fixed_s": self.reconfigure_fixed_s,
            "failover_s": self.reconfigure_fixed_s if self.failover_fixed_s is None else self.failover_fixed_s,
            "warmup_s": self.warmup_s,
        }
        if self.restart_fixed_s is not None:
            measured["restart_fixed_s"] = self.restart_fixed_s * self.dilation(restarted_workers)
        if self.restart_warmup_s is not None:
            measured["restart_warmup_s"] = self.restart_warmup_s
        for name in ("host_copy_gbps", "storage_write_gbps", "storage_read_gbps"):
            if getattr(self, name) is not None:
                measured[name] = getattr(self, name)
        return replace(base, **measured)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RuntimeOverhead:
        try:
            data = json.loads(Path(path).read_text())
            return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})
        except (OSError, ValueError, TypeError) as error:
            raise ConfigError(
                f"runtime overhead file {path}: unreadable ({error}); write it with python -m oobleck.sim.validate --calibration"
            ) from None


def step_model(
    shape: StepShape, cores: int, per_microbatch_s: float, per_step_s: float, per_worker_s: float, compute_scale: float
) -> float:
    """``RuntimeOverhead``'s step: the longer of the critical path and the CPU floor."""
    critical = shape.planner_s + shape.busiest_microbatches * per_microbatch_s + per_step_s
    cpu = compute_scale * shape.compute_s + shape.stage_microbatches * per_microbatch_s + shape.workers * per_worker_s
    return max(critical, cpu / cores)


STEP_TERMS = ("per_microbatch_s", "per_step_s", "per_worker_s", "compute_scale")


def fit_step_model(samples: Sequence[tuple[StepShape, float]], cores: int) -> dict[str, float]:
    """``RuntimeOverhead``'s step terms from ``(shape, measured step s)`` samples.

    Least squares on the log ratio (each sample counts by its relative error, whatever its
    length), all terms non-negative, from a few starting points (the model is a maximum of two
    planes, so the fit has more than one basin); the best fit is kept. Terms the samples cannot
    tell apart take the smallest error either way: ask for layouts that differ in what the terms
    charge (microbatches, workers, total compute), which the calibration runs of
    ``benchmarks/bench_validation.py`` do.
    """
    import numpy as np
    from scipy.optimize import least_squares

    if not samples:
        raise ValueError("no step samples to fit the runtime overhead on")
    shapes = [shape for shape, _ in samples]
    measured = np.array([seconds for _, seconds in samples])
    if (measured <= 0).any():
        raise ValueError("step samples must be positive seconds")
    scale = float(np.median(measured))  # terms in units of a typical step: a well-conditioned fit

    def residuals(x: Any) -> Any:
        terms = x * np.array([scale, scale, scale, 1.0])
        return np.log([step_model(s, cores, *terms) for s in shapes] / measured)

    best = None
    for compute_scale in (0.5, 1.0, 2.0):
        for share in (0.0, 0.05, 0.2):
            result = least_squares(residuals, x0=[share, share, share, compute_scale], bounds=(0.0, np.inf))
            if best is None or result.cost < best.cost:
                best = result
    terms = best.x * np.array([scale, scale, scale, 1.0])
    return dict(zip(STEP_TERMS, (float(t) for t in terms)))

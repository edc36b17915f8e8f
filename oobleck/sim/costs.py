"""The simulator's cost model beyond the planner's: state sizes, transfers, checkpoints, restarts.

Iteration times always come from the planner's cost model (``pipeline_iteration_time``, paper
Eq. 1-4, on the templates' stage times), so every strategy is timed by the same formula. This
module adds what the planner does not model:

- model state: ``state_bytes_per_param`` bytes per parameter (fp32 Adam: parameters, gradients
  and two moments = 16, DESIGN section 3); moving a layer to a new holder sends parameters and the
  two Adam moments (``moved_bytes_per_param``, 12: gradients are recomputed, not moved);
- a transfer set takes ``max(bytes into one node, bytes out of one node) / link bandwidth``: the
  nodes send and receive in parallel over their own links;
- Varuna's and Bamboo's D identical pipelines are timed by the planner's own
  ``plan_iteration_time`` (slowest pipeline, then the cross-pipeline ring all-reduce), so all
  three strategies share one formula;
- a checkpoint or restart takes ``fixed + state bytes / storage bandwidth`` unless a per-model
  figure is given (the original artifact's measured constants, see conf/strategy/*.yaml);
- ``CostConstants``: those constants, one typed block (``costs:``) in every strategy's config; the
  charge of each kind of decision is ``oobleck.sim.engine.decision_downtime``;
- ``RuntimeOverhead``: what the real runtime on one machine spends beyond Eq. 1-4 (per microbatch,
  per step, CPU cores shared by the workers, the fixed part of a reconfiguration and the first
  step's warm-up), measured on a calibration run by ``oobleck.sim.validate.calibrate``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from oobleck.errors import ConfigError

from oobleck.planning.plan import LayerTransfer, PipelineTemplate
from oobleck.planning.profile import GB, ModelProfile

FP32_BYTES = 4  # LayerProfile.param_bytes counts fp32 parameters


@dataclass
class CostConstants:
    """What the simulator charges a strategy's decisions (``costs:`` in conf/strategy/<name>.yaml,
    where every value carries its source)."""

    state_bytes_per_param: float = 16.0  # fp32 Adam: parameters, gradients, two moments (DESIGN 3)
    # Parameters and two Adam moments move with a layer; gradients are recomputed.
    moved_bytes_per_param: float = 12.0
    checkpoint_fixed_s: float = 4.4
    storage_bandwidth_gbps: float = 0.95  # aggregate bandwidth to checkpoint storage
    restart_fixed_s: float = 45.0  # new instances and rendezvous, before the state is read back
    restart_bandwidth_gbps: float = 0.167
    # Measured per-model figures take precedence over the formulas (model name -> seconds).
    checkpoint_s_by_model: dict[str, float] = field(default_factory=dict)
    restart_s_by_model: dict[str, float] = field(default_factory=dict)
    reconfigure_fixed_s: float = 2.0  # detect + plan + new process groups, before any state moves
    failover_s: float = 1.0  # a predecessor taking over a stage it already holds

    def checkpoint_s(self, profile: ModelProfile) -> float:
        return per_model_or_formula(
            self.checkpoint_s_by_model, profile.model, self.checkpoint_fixed_s,
            model_state_bytes(profile, self.state_bytes_per_param), self.storage_bandwidth_gbps,
        )  # fmt: skip

    def restart_s(self, profile: ModelProfile) -> float:
        return per_model_or_formula(
            self.restart_s_by_model, profile.model, self.restart_fixed_s,
            model_state_bytes(profile, self.state_bytes_per_param), self.restart_bandwidth_gbps,
        )  # fmt: skip


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


def per_model_or_formula(
    table: Mapping[str, float] | None, model: str, fixed_s: float, nbytes: float, bandwidth_gbps: float
) -> float:
    """A measured per-model figure if the table has the model, else ``fixed + bytes / bandwidth``."""
    if table and model in table and table[model] is not None:
        return float(table[model])
    return fixed_s + nbytes / (bandwidth_gbps * GB)


@dataclass(frozen=True)
class RuntimeOverhead:
    """The real runtime's step and recovery time on one machine, beyond the planner's Eq. 1-4.

    A layout's step takes ``dilation(workers) * (planner_s + busiest * per_microbatch_s +
    per_step_s)``:

    - ``planner_s``: the planner's predicted iteration (per-layer compute from the profile);
    - ``per_microbatch_s``: seconds per microbatch of the busiest pipeline that Eq. 1-4 does not
      see (Python per op, point-to-point and launch latency, loss and bookkeeping);
    - ``per_step_s``: seconds per step (gradient all-reduce latency, optimizer, commit barrier);
    - ``dilation``: ``max(1, workers / cores)``: the worker processes are CPU-bound and share
      ``cores`` cores, so with more workers than cores each runs that much slower.

    A reconfiguration takes ``reconfigure_fixed_s`` (failure detection + planning + process-group
    rebuild, the runtime's own ``detect_s + plan_s + groups_s``) plus the state copy (bytes over
    the link, as in the planner) plus ``warmup_s`` (what the first step of a new generation takes
    beyond a steady one) plus the redone step. Every value is measured on a calibration run
    (``source`` names it), never on the run it predicts.
    """

    per_microbatch_s: float
    per_step_s: float
    cores: int
    reconfigure_fixed_s: float
    warmup_s: float
    source: str = ""

    def dilation(self, workers: int) -> float:
        return max(1.0, workers / self.cores)

    def step_s(self, planner_s: float, busiest_microbatches: int, workers: int) -> float:
        """Predicted seconds of one step of a layout."""
        return self.dilation(workers) * (planner_s + busiest_microbatches * self.per_microbatch_s + self.per_step_s)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RuntimeOverhead:
        try:
            data = json.loads(Path(path).read_text())
            return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})
        except (OSError, ValueError, TypeError) as error:
            raise ConfigError(f"runtime overhead file {path}: unreadable ({error}); write it with python -m oobleck.sim.validate --calibration") from None


def fit_step_overhead(samples: Sequence[tuple[float, int, float]]) -> tuple[float, float]:
    """``(per_microbatch_s, per_step_s)`` from ``(planner_s, busiest microbatches, undilated step)``.

    Non-negative least squares on ``step - planner = busiest * per_microbatch + per_step``: the
    unconstrained fit when both terms come out non-negative (it needs at least two different
    microbatch counts), otherwise the better (smaller squared residual) of the two one-term fits.
    Which term dominates is the data's to say: on this machine it is the per-step one (README).
    """
    import numpy as np

    if not samples:
        raise ValueError("no step samples to fit the runtime overhead on")
    gaps = np.array([max(0.0, step - planner) for planner, _, step in samples])
    counts = np.array([float(mb) for _, mb, _ in samples])
    if len(set(counts.tolist())) >= 2:
        (per_mb, per_step), *_ = np.linalg.lstsq(np.stack([counts, np.ones_like(counts)], axis=1), gaps, rcond=None)
        if per_mb >= 0 and per_step >= 0:
            return float(per_mb), float(per_step)
    only_mb = float(gaps @ counts / (counts @ counts))
    only_step = float(gaps.mean())
    residual_mb = float(((gaps - only_mb * counts) ** 2).sum())
    residual_step = float(((gaps - only_step) ** 2).sum())
    return (only_mb, 0.0) if residual_mb < residual_step else (0.0, only_step)

"""The runtime model: what the real runtime on one machine spends beyond the planner's Eq. 1-4.

``RuntimeOverhead`` holds its terms: per microbatch, per step, CPU cores shared by the workers,
the fixed part of a reconfiguration and the first step's warm-up, the fixed part of a restart.
A layout's step is ``step_model`` of its ``StepShape`` (the longer of its critical path and the
CPU floor of the shared cores); ``fit_step_model`` fits the step terms on calibration runs, and
``oobleck.sim.calibration.calibrate`` measures the rest. ``RuntimeOverhead.costs`` turns the
measured terms into the ``oobleck.recovery_costs.CostConstants`` the simulator charges.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from oobleck.errors import ConfigError
from oobleck.recovery_costs import CostConstants


@dataclass(frozen=True)
class StepShape:
    """What the runtime step model needs to know of a layout (``oobleck.sim.calibration.step_shape``)."""

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

        critical = compute_scale * planner_s + busiest_microbatches * per_microbatch_s + per_step_s
        cpu      = (compute_scale * compute_s + stage_microbatches * per_microbatch_s
                    + workers * per_worker_s) / cores
        step     = max(critical, cpu)

    - ``planner_s``: the planner's predicted iteration (per-layer compute from the profile), scaled
      like the CPU term's compute: both are the profile's seconds, measured on an idle core, and a
      loaded host slows the critical path's compute as much as the rest (unscaled, a re-route or a
      failover that lengthens the critical path without adding CPU work would hide below the CPU
      floor: a re-routed ReCycle step is then predicted equal to the intact one, 0.419 s, where it
      measured 2.05x);
    - ``per_microbatch_s``: seconds per microbatch a stage runs that Eq. 1-4 does not see (Python
      per op, point-to-point and launch latency, loss and bookkeeping);
    - ``per_step_s``: seconds per step on the critical path (gradient all-reduce latency,
      optimizer, commit barrier with the controller);
    - the CPU floor: the worker processes are CPU-bound and share ``cores`` cores, so a step takes
      at least every worker's CPU time over the cores: its compute (``compute_scale`` times the
      profile's, which was measured on an idle core) plus its per-microbatch overheads plus
      ``per_worker_s`` per worker per step (its optimizer, its share of the collectives and of the
      commit protocol). Workers that wait in a pipeline's bubble use no CPU, so the floor counts
      CPU time, not a uniform ``workers / cores`` slow-down, which would charge them too.

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

        # The measured fixed parts include detection, the process groups and building the model
        # (each is measured from the failure or kill to the new generation as a whole): the
        # components that model them apart stay out.
        measured: dict[str, Any] = {
            "detect_s": 0.0,
            "group_init_s": 0.0,
            "group_init_per_node_s": 0.0,
            "model_build_gbps": None,
            "storage_aggregate_gbps": None,
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
    """``RuntimeOverhead``'s step: the longer of the critical path and the CPU floor, the profile's
    compute scaled by ``compute_scale`` in both."""
    critical = compute_scale * shape.planner_s + shape.busiest_microbatches * per_microbatch_s + per_step_s
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
    assert best is not None  # the loop ran at least once
    terms = best.x * np.array([scale, scale, scale, 1.0])
    return dict(zip(STEP_TERMS, (float(t) for t in terms)))

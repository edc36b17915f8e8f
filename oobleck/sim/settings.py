"""The ``sim:`` config section's checks (filled by ``experiment=``), beside the simulator that
reads them; ``oobleck.config.validate`` calls them. The uncertain constants' declarations are
checked by ``oobleck.uncertainty.declared``."""

from __future__ import annotations

from typing import Any

from oobleck.checks import choice, positive
from oobleck.errors import ConfigError
from oobleck.schema import strategy_names

PROFILE_SOURCES = ("analytic", "auto", "measured", "file")


def check_sim(sim: Any, microbatch_size: int) -> None:
    """``sim.*`` as ``ConfigError``; ``microbatch_size`` (``job.microbatch_size``) must divide each
    model's batch."""
    known = strategy_names()
    for index, name in enumerate(sim.strategies):
        choice(f"sim.strategies[{index}]", name, known)
    choice("sim.profile_source", sim.profile_source, PROFILE_SOURCES)
    if sim.duration_h is not None:
        positive("sim.duration_h", sim.duration_h)
    if sim.nodes is not None:
        positive("sim.nodes", sim.nodes)
    positive("sim.timeline_bin_s", sim.timeline_bin_s)
    positive("sim.node_creation_s", sim.node_creation_s, allow_zero=True)
    if not (isinstance(sim.trace_starts, int) and sim.trace_starts >= 1):
        raise ConfigError(f"sim.trace_starts={sim.trace_starts!r} must be an integer >= 1")
    if sim.trace_start_spacing_s is not None:
        positive("sim.trace_start_spacing_s", sim.trace_start_spacing_s)
    for name, batch in (sim.global_batch_size_by_model or {}).items():
        if not (isinstance(batch, int) and batch >= 1):
            raise ConfigError(f"sim.global_batch_size_by_model.{name}={batch!r} must be an integer >= 1")
        if batch % int(microbatch_size):
            raise ConfigError(
                f"sim.global_batch_size_by_model.{name}={batch} is not a multiple of job.microbatch_size={microbatch_size}"
            )
    if not (isinstance(sim.band_samples, int) and sim.band_samples >= 0):
        raise ConfigError(
            f"sim.band_samples={sim.band_samples!r} must be an integer >= 0 (0: the nominal constants only)"
        )
    if not (isinstance(sim.processes, int) and sim.processes >= 0):
        raise ConfigError(f"sim.processes={sim.processes!r} must be an integer >= 0 (0: one per core)")

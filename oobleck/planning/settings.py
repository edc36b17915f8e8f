"""The ``planner:`` config section's checks, beside the planner that reads them;
``oobleck.config.validate`` calls them."""

from __future__ import annotations

from typing import Any

from oobleck.checks import choice, positive

REPLAN_HORIZONS = ("schedule", "fixed")


def check_planner(planner: Any) -> None:
    """``planner.*`` as ``ConfigError``."""
    positive("planner.reference_microbatches_per_stage", planner.reference_microbatches_per_stage)
    positive("planner.transfer_sources", planner.transfer_sources)
    positive("planner.copy_piece_mb", planner.copy_piece_mb)
    choice("planner.replan_horizon", planner.replan_horizon, REPLAN_HORIZONS)
    positive("planner.replan_horizon_steps", planner.replan_horizon_steps, allow_zero=True)
    positive("planner.progress_every_s", planner.progress_every_s)

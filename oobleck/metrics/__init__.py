"""Metrics: the run recorder (CSV/JSON files in the run dir, wandb, progress bar)."""

from oobleck.metrics.recorder import RunRecorder, format_table

__all__ = ["RunRecorder", "format_table"]

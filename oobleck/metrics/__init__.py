"""Metrics: the run recorder (CSV/JSON files in the run dir, wandb, progress bar), the wandb run
layout shared with the simulator (``wandb_run``, ``simulation``) and a reader of offline wandb
run files (``offline``)."""

from oobleck.metrics.offline import find_offline_runs, read_offline_run
from oobleck.metrics.recorder import RunRecorder, format_table

__all__ = ["RunRecorder", "find_offline_runs", "format_table", "read_offline_run"]

"""The single writer of a run's outputs: metrics.csv, events.csv, plan.json, summary.json and wandb.

Only the controller (or the simulator) owns a ``RunRecorder``, so outputs survive the loss of any
worker's node (DESIGN section 7). Rows are appended to the CSV files as they arrive (a killed run
still leaves what it had), wandb gets the same rows (offline by default; the layout, names and
artifacts are ``oobleck.metrics.wandb_run``'s), and a tqdm bar shows step, loss and samples/s
while the run goes on.

A resumed run (``resume=True``, the same run dir) is the same run: its rows are appended to the
earlier attempts' (``earlier_metrics``, ``earlier_events``), its time axis (``time_s``, in the
CSVs and on wandb) continues from the last time they recorded instead of starting at zero, and
its wandb run is the same one.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

from oobleck.metrics.wandb_run import WandbRun, config_yaml, failures_label, run_dir_files, run_identity, sweep_job

STEP_COLUMNS = (
    "step",
    "time_s",
    "samples",
    "samples_per_s",
    "loss",
    "generation",
    "pipelines",
    "attempts",
    "strategy",
    "attempt",
)
EVENT_COLUMNS = ("time_s", "kind", "generation", "step", "attempt")
# History prefixes and their x-axes: per-step values against the step, events against wall time.
WANDB_AXES = {"train/": "step", "event/": "time_s"}
# Run-dir files saved as the run's artifact (with .hydra/ and the resolved config.yaml).
RUN_FILES = ("plan.json", "metrics.csv", "events.csv", "summary.json", "probes.json")


class CsvTable:
    """An append-only CSV file whose header grows when a row brings a new column.

    ``keep=True`` continues an existing file (its rows are read back, as text)."""

    def __init__(self, path: Path, columns: tuple[str, ...], *, keep: bool = False) -> None:
        self.path = path
        self.columns = list(columns)
        self.rows: list[dict[str, Any]] = []
        if keep and path.is_file():
            with path.open(newline="") as handle:
                reader = csv.DictReader(handle)
                self.columns = list(dict.fromkeys([*columns, *(reader.fieldnames or [])]))
                self.rows = [{k: _cell(v) for k, v in row.items() if v != ""} for row in reader]
        self._write_all()

    def append(self, row: Mapping[str, Any]) -> None:
        self.rows.append(dict(row))
        new = [key for key in row if key not in self.columns]
        if new:
            self.columns.extend(new)
            self._write_all()
            return
        with self.path.open("a", newline="") as handle:
            csv.DictWriter(handle, self.columns).writerow(row)

    def _write_all(self) -> None:
        with self.path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, self.columns)
            writer.writeheader()
            writer.writerows(self.rows)


def _cell(text: str) -> Any:
    """A CSV cell back as the value that was written: number, bool, list, or the text itself."""
    if text in ("True", "False"):
        return text == "True"
    for parse in (int, float, json.loads):
        try:
            return parse(text)
        except ValueError:
            continue
    return text


def _number(value: Any) -> float:
    try:
        return float(value) if value not in (None, "") else 0.0
    except (TypeError, ValueError):
        return 0.0


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class RunRecorder:
    """Collects per-step metrics and events of one run and writes them to the run dir and wandb.

    ``wandb`` is the ``logger.wandb`` config section (mode offline|online|disabled, project, entity,
    group, tags) or None to skip wandb. ``resume=True`` keeps the rows already in the run dir's
    CSV files (a requeued job continuing in the same run dir); wandb continues the same run
    whenever the run dir is the same (its id is stored there).
    """

    def __init__(
        self,
        run_dir: str | Path,
        config: Mapping[str, Any],
        *,
        total_steps: int,
        strategy: str = "oobleck",
        wandb: Any = None,
        progress_bar: bool = True,
        metrics_name: str = "metrics.csv",
        events_name: str = "events.csv",
        resume: bool = False,
        host: Mapping[str, Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.strategy = strategy
        self.config = dict(config)
        self.host = dict(host or {})  # the host at the start (oobleck.metrics.host); the end's comes with the summary
        self.started = time.monotonic()
        self.metrics = CsvTable(self.run_dir / metrics_name, STEP_COLUMNS, keep=resume)
        self.events = CsvTable(self.run_dir / events_name, EVENT_COLUMNS, keep=resume)
        self.earlier_metrics = list(self.metrics.rows)  # the earlier attempts' rows (a resume)
        self.earlier_events = list(self.events.rows)
        # The time axis continues from the earlier attempts' last time (0 for a fresh run).
        self.time_offset = max((_number(r.get("time_s")) for r in [*self.metrics.rows, *self.events.rows]), default=0.0)
        self._samples_total = sum(_number(row.get("samples")) for row in self.metrics.rows)
        enabled = wandb is not None and str(wandb.mode) != "disabled"
        self._wandb = self._start_wandb(wandb) if enabled else None
        self._bar = tqdm(total=total_steps, desc=strategy, unit="step", dynamic_ncols=True, disable=not progress_bar)

    def _start_wandb(self, settings: Any) -> WandbRun:
        config = self.config
        cluster = config.get("cluster") or {}
        failures = failures_label(config.get("failures"))
        sweep = sweep_job(self.run_dir)
        identity = run_identity(
            strategy=self.strategy,
            model=str((config.get("model") or {}).get("name", "model")),
            nodes=cluster.get("nodes", "?"),
            failures=failures,
            experiment=config.get("experiment"),
            group=settings.group,
            tags=list(settings.tags or []),
            sweep=sweep,
        )
        labels: dict[str, Any] = {"run_dir": str(self.run_dir), "failures_label": failures}
        if self.host:
            labels["host"] = self.host
        if sweep is not None:
            labels.update(sweep_job_num=sweep.num, sweep_overrides=sweep.override_dirname, sweep_dir=sweep.sweep_dir)
        return WandbRun(settings, identity, {**config, **labels}, self.run_dir, axes=WANDB_AXES, time_key="time_s")

    def elapsed(self) -> float:
        """Seconds on the run's time axis: since this attempt started, after the earlier attempts'."""
        return self.time_offset + time.monotonic() - self.started

    def write_json(self, name: str, data: Mapping[str, Any]) -> Path:
        path = self.run_dir / name
        path.write_text(json.dumps(_jsonable(data), indent=1))
        return path

    def write_plan(self, plan: Mapping[str, Any]) -> Path:
        return self.write_json("plan.json", plan)

    def step(self, **row: Any) -> None:
        row.setdefault("strategy", self.strategy)
        row.setdefault("time_s", round(self.elapsed(), 4))
        self.metrics.append(row)
        self._samples_total += _number(row.get("samples"))
        if self._wandb is not None:
            # This step's values go under train/ ("train/samples" is the step's batch). The run's
            # totals (summary "samples") are set once at the end; no history key shares their name.
            history = {f"train/{k}": v for k, v in row.items() if k not in ("step", "time_s")}
            history["train/samples_total"] = self._samples_total
            self._wandb.log({"step": row.get("step"), "time_s": row["time_s"], **history})
        self._bar.update(1)
        postfix = {k: row[k] for k in ("loss", "samples_per_s", "generation") if row.get(k) is not None}
        self._bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()})

    def event(self, kind: str, **fields: Any) -> None:
        fields.setdefault("time_s", round(self.elapsed(), 4))
        row = {"kind": kind, **fields}
        self.events.append(row)
        if self._wandb is not None:
            self._wandb.event(kind, float(fields["time_s"]), {k: v for k, v in fields.items() if k != "time_s"})
        self._bar.write(
            f"[{row['time_s']:8.2f}s] {kind}: " + ", ".join(f"{k}={v}" for k, v in fields.items() if k != "time_s")
        )

    def finish(self, **summary: Any) -> dict[str, Any]:
        """Write summary.json, print it as a table and close wandb. Returns the summary."""
        self._bar.close()
        summary.setdefault("strategy", self.strategy)
        summary.setdefault("wall_time_s", round(self.elapsed(), 3))
        if summary.get("attempts"):  # this attempt's time boundaries (the earlier ones' are in their rows)
            summary["attempts"][-1].update(
                started_time_s=round(self.time_offset, 4), ended_time_s=round(self.elapsed(), 4)
            )
        summary.setdefault("run_dir", str(self.run_dir))
        self.write_json("summary.json", summary)
        print(format_table(printed_summary(summary)), flush=True)
        if self._wandb is not None:
            run, self._wandb = self._wandb, None
            try:
                if "host" in summary:  # the end's load and the run's processes, beside the start's
                    run.update_config({"host": summary["host"]})
                run.table("events", self.events.rows, self.events.columns)
                files = run_dir_files(self.run_dir, RUN_FILES)
                run.artifact(f"run-files-{run.run.id}", "run-files", files, {"config.yaml": config_yaml(self.config)})
            finally:
                local = run.finish(_jsonable(summary))
            print(run.sync_hint(local), flush=True)
        return summary


def printed_summary(summary: Mapping[str, Any]) -> dict[str, Any]:
    """What the terminal shows of a summary: as summary.json, except that the per-worker
    ``phase_seconds`` (one entry per worker and phase, in summary.json) become one line, each
    phase's share of all workers' step time."""
    printed = {key: value for key, value in summary.items() if key != "phase_seconds"}
    totals: dict[str, float] = {}
    for phases in (summary.get("phase_seconds") or {}).values():
        for phase, seconds in phases.items():
            totals[phase] = totals.get(phase, 0.0) + float(seconds)
    whole = sum(totals.values())
    if whole > 0:
        shares = sorted(totals.items(), key=lambda item: -item[1])
        printed["phase_share"] = ", ".join(f"{phase} {seconds / whole:.0%}" for phase, seconds in shares if seconds > 0)
    return printed


def format_table(summary: Mapping[str, Any], title: str = "summary") -> str:
    """Two aligned columns, one row per key; nested dicts are flattened with dots."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            flat[prefix] = value

    walk("", summary)
    width = max((len(key) for key in flat), default=0)
    lines = [f"== {title}", *(f"{key.ljust(width)}  {_fmt(value)}" for key, value in flat.items())]
    return os.linesep.join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt(v) for v in value)
    return str(value)

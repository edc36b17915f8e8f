"""The single writer of a run's outputs: metrics.csv, events.csv, plan.json, summary.json and wandb.

Only the controller (or the simulator) owns a ``RunRecorder``, so outputs survive the loss of any
worker's node (DESIGN section 7). Rows are appended to the CSV files as they arrive (a killed run
still leaves what it had), wandb gets the same rows (offline by default), and a tqdm bar shows
step, loss and samples/s while the run goes on.
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

STEP_COLUMNS = ("step", "time_s", "samples", "samples_per_s", "loss", "generation", "pipelines", "attempts", "strategy")
EVENT_COLUMNS = ("time_s", "kind", "generation", "step")


class CsvTable:
    """An append-only CSV file whose header grows when a row brings a new column."""

    def __init__(self, path: Path, columns: tuple[str, ...]) -> None:
        self.path = path
        self.columns = list(columns)
        self.rows: list[dict[str, Any]] = []
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
    group, tags) or None to skip wandb.
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
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.strategy = strategy
        self.started = time.monotonic()
        self.metrics = CsvTable(self.run_dir / metrics_name, STEP_COLUMNS)
        self.events = CsvTable(self.run_dir / events_name, EVENT_COLUMNS)
        self._wandb_mode = str(wandb.mode) if wandb is not None else "disabled"
        self._wandb_run = self._start_wandb(wandb, config) if wandb is not None else None
        self._bar = tqdm(total=total_steps, desc=strategy, unit="step", dynamic_ncols=True, disable=not progress_bar)

    def _start_wandb(self, settings: Any, config: Mapping[str, Any]) -> Any:
        mode = str(settings.mode)
        if mode == "disabled":
            return None
        import wandb  # imported lazily: it is slow to import and only the writer needs it

        model = config.get("model", {}).get("name", "model")
        cluster = config.get("cluster", {})
        tags = [self.strategy, str(model), f"nodes={cluster.get('nodes', '?')}", *list(settings.tags or [])]
        return wandb.init(
            project=settings.project,
            entity=settings.entity,
            group=settings.group or config.get("experiment", "default"),
            tags=tags,
            config=dict(config),
            dir=str(self.run_dir),
            mode=mode,
            settings=wandb.Settings(silent=True),
            name=f"{self.strategy}-{model}-{self.run_dir.name}",
            reinit="create_new",
        )

    def elapsed(self) -> float:
        return time.monotonic() - self.started

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
        if self._wandb_run is not None:
            numeric = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
            self._wandb_run.log(numeric, step=int(row["step"]))
        self._bar.update(1)
        postfix = {k: row[k] for k in ("loss", "samples_per_s", "generation") if row.get(k) is not None}
        self._bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()})

    def event(self, kind: str, **fields: Any) -> None:
        fields.setdefault("time_s", round(self.elapsed(), 4))
        row = {"kind": kind, **fields}
        self.events.append(row)
        if self._wandb_run is not None:
            numeric = {f"event/{kind}/{k}": v for k, v in fields.items() if isinstance(v, (int, float))}
            if numeric:
                # commit=False attaches the event to the current step instead of advancing
                # wandb's step counter (which would make the next step's row look out of order).
                self._wandb_run.log(numeric, commit=False)
        self._bar.write(f"[{row['time_s']:8.2f}s] {kind}: " + ", ".join(f"{k}={v}" for k, v in fields.items() if k != "time_s"))

    def finish(self, **summary: Any) -> dict[str, Any]:
        """Write summary.json, print it as a table and close wandb. Returns the summary."""
        self._bar.close()
        summary.setdefault("strategy", self.strategy)
        summary.setdefault("wall_time_s", round(self.elapsed(), 3))
        summary.setdefault("run_dir", str(self.run_dir))
        self.write_json("summary.json", summary)
        print(format_table(summary), flush=True)
        if self._wandb_run is not None:
            self._wandb_run.summary.update(_jsonable({k: v for k, v in summary.items() if not isinstance(v, Mapping)}))
            try:
                import wandb

                self._wandb_run.log({"events": wandb.Table(dataframe=_events_frame(self.events))})
            finally:
                run_path = Path(self._wandb_run.dir).parent
                self._wandb_run.finish()
            self._wandb_run = None
            hint = f"; upload it with: wandb sync {run_path}" if self._wandb_mode == "offline" else ""
            print(f"wandb: run saved in {run_path}{hint}", flush=True)
        return summary


def _events_frame(table: CsvTable) -> Any:
    import pandas as pd

    return pd.DataFrame(table.rows, columns=table.columns).astype(str)


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

"""Load real run dirs and simulator outputs into tidy pandas tables.

A real run dir (``python -m oobleck.run``) holds ``metrics.csv`` (one row per step), ``events.csv``,
``summary.json``, ``plan.json`` and ``.hydra/config.yaml``; a simulation dir
(``python -m oobleck.simulate``) holds ``sim_metrics.csv`` (one row per period of constant state),
``sim_events.csv``, ``sim_summary.csv`` and ``summary.json``. Missing or malformed files raise
``RunError`` naming the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from oobleck.errors import RunError

BREAKDOWN = ("useful", "redundant", "checkpoint", "restart", "reconfiguration", "lost", "idle")
FREQUENCY_ORDER = ("6h", "3h", "1h", "30m", "10m", "5m")


def _csv(path: Path, required: bool = True) -> pd.DataFrame:
    if not path.is_file():
        if required:
            raise RunError(f"{path} does not exist; is {path.parent} a run dir of python -m oobleck.run/simulate?")
        return pd.DataFrame()
    try:
        return pd.read_csv(path)
    except (pd.errors.ParserError, UnicodeDecodeError) as error:
        raise RunError(f"{path}: not a readable CSV ({error})") from None
    except pd.errors.EmptyDataError:
        return pd.DataFrame()


def _json(path: Path, required: bool = True) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise RunError(f"{path} does not exist")
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise RunError(f"{path}: not valid JSON ({error})") from None


@dataclass
class RunData:
    """One real run: per-step metrics, events, summary, plan and resolved config."""

    path: Path
    metrics: pd.DataFrame
    events: pd.DataFrame
    summary: dict[str, Any]
    plan: dict[str, Any]
    config: dict[str, Any]


def load_run(run_dir: str | Path) -> RunData:
    path = Path(run_dir)
    config: dict[str, Any] = {}
    hydra_cfg = path / ".hydra" / "config.yaml"
    if hydra_cfg.is_file():
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(OmegaConf.load(hydra_cfg), resolve=False)  # type: ignore[assignment]
    return RunData(
        path=path,
        metrics=_csv(path / "metrics.csv"),
        events=_csv(path / "events.csv", required=False),
        summary=_json(path / "summary.json", required=False),
        plan=_json(path / "plan.json", required=False),
        config=config,
    )


def load_runs(run_dirs: list[str | Path]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Metrics and events of several real runs, with a ``run`` column (the dir name)."""
    metrics, events = [], []
    for run_dir in run_dirs:
        data = load_run(run_dir)
        metrics.append(data.metrics.assign(run=data.path.name))
        if not data.events.empty:
            events.append(data.events.assign(run=data.path.name))
    return (
        pd.concat(metrics, ignore_index=True) if metrics else pd.DataFrame(),
        pd.concat(events, ignore_index=True) if events else pd.DataFrame(),
    )


@dataclass
class SimData:
    path: Path
    metrics: pd.DataFrame
    events: pd.DataFrame
    summary: pd.DataFrame


def load_sim(run_dir: str | Path) -> SimData:
    path = Path(run_dir)
    return SimData(
        path=path,
        metrics=_csv(path / "sim_metrics.csv"),
        events=_csv(path / "sim_events.csv", required=False),
        summary=_csv(path / "sim_summary.csv"),
    )


def frequency_label(trace: str) -> str:
    """``synthetic/10m`` -> ``10m`` (the x axis of the failure-frequency figure)."""
    return str(trace).rsplit("/", 1)[-1]


def timeline(segments: pd.DataFrame, bin_s: float) -> pd.DataFrame:
    """Time-weighted mean throughput per bin of ``bin_s`` seconds, per (model, trace, strategy).

    Columns: model, trace, strategy, time_h (bin start, hours from the trace start), samples_per_s,
    nodes_alive (time-weighted mean).
    """
    rows: list[dict[str, Any]] = []
    if segments.empty:
        return pd.DataFrame(columns=["model", "trace", "strategy", "time_h", "samples_per_s", "nodes_alive"])
    for (model, trace, strategy), group in segments.groupby(["model", "trace", "strategy"], sort=False):
        start = group["t_start_s"].min()
        end = group["t_end_s"].max()
        edges = np.arange(start, end + bin_s, bin_s)
        t0 = group["t_start_s"].to_numpy()
        t1 = group["t_end_s"].to_numpy()
        rate = group["samples_per_s"].to_numpy()
        alive = group["nodes_alive"].to_numpy()
        for left in edges[:-1]:
            right = min(left + bin_s, end)
            overlap = np.clip(np.minimum(t1, right) - np.maximum(t0, left), 0.0, None)
            width = overlap.sum()
            if width <= 0:
                continue
            rows.append(
                {
                    "model": model,
                    "trace": trace,
                    "strategy": strategy,
                    "time_h": (left - start) / 3600.0,
                    "samples_per_s": float((overlap * rate).sum() / width),
                    "nodes_alive": float((overlap * alive).sum() / width),
                }
            )
    return pd.DataFrame(rows)


def breakdown(summary: pd.DataFrame) -> pd.DataFrame:
    """Long form of the effective-time breakdown: model, trace, strategy, category, node_hours, fraction."""
    rows = []
    for _, row in summary.iterrows():
        for category in BREAKDOWN:
            rows.append(
                {
                    "model": row["model"],
                    "trace": row["trace"],
                    "strategy": row["strategy"],
                    "category": category,
                    "node_hours": row[f"{category}_node_s"] / 3600.0,
                    "fraction": row[f"{category}_fraction"],
                }
            )
    return pd.DataFrame(rows)


def throughput_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Throughput (samples/s) per model and trace, one column per strategy, plus Oobleck's ratios."""
    table = summary.pivot_table(index=["model", "trace"], columns="strategy", values="throughput", sort=False)
    for baseline in ("varuna", "bamboo"):
        if "oobleck" in table and baseline in table:
            table[f"oobleck/{baseline}"] = table["oobleck"] / table[baseline].replace(0.0, np.nan)
    return table

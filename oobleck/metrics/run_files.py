"""The files of a real run dir as written by the run recorder, read back: ``metrics.csv``,
``events.csv``, ``summary.json``, ``plan.json`` and ``.hydra/config.yaml``. Shared by the analysis
(``analysis.load``) and the simulator's validation against real runs (``oobleck.sim.validate``), so
that the simulator never imports the analysis. Missing or malformed files raise ``RunError``
naming the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from oobleck.errors import RunError


def read_csv(path: Path, required: bool = True) -> pd.DataFrame:
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


def read_json(path: Path, required: bool = True) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise RunError(f"{path} does not exist")
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise RunError(f"{path}: not valid JSON ({error})") from None


def read_yaml(path: Path) -> Any:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as error:  # omegaconf raises several yaml/grammar errors
        raise RunError(f"{path}: not readable YAML ({error})") from None


@dataclass
class RunFiles:
    """One real run's files: per-step metrics, events, summary, plan and resolved config."""

    path: Path
    metrics: pd.DataFrame
    events: pd.DataFrame
    summary: dict[str, Any]
    plan: dict[str, Any]
    config: dict[str, Any]


def read_run_files(run_dir: str | Path) -> RunFiles:
    """Every file of ``run_dir`` (``metrics.csv`` is required, the others may be missing)."""
    path = Path(run_dir)
    hydra_cfg = path / ".hydra" / "config.yaml"
    return RunFiles(
        path=path,
        metrics=read_csv(path / "metrics.csv"),
        events=read_csv(path / "events.csv", required=False),
        summary=read_json(path / "summary.json", required=False),
        plan=read_json(path / "plan.json", required=False),
        config=read_yaml(hydra_cfg) if hydra_cfg.is_file() else {},
    )

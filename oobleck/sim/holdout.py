"""The validation's held-out set: read the pre-registered cases, score each set apart.

``benchmarks/validation_holdout.yaml`` holds real-run configurations fixed before the simulator's
runtime model last changed and never used to choose its form (its header states the rules). The
protocol (``benchmarks/bench_validation.py``) runs them beside the calibration runs and the
development set (the runs the model was developed on) and reports ``scores``: rows within target
per set, the held-out set's apart.

``read_holdout(path)`` returns the cases as ``{name: Case}`` and refuses a malformed file with one
message naming the case and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from oobleck.errors import RunError

HOLDOUT = "holdout"
DEVELOPMENT = "development"
CASE_KEYS = ("strategy", "what", "overrides")


@dataclass(frozen=True)
class Case:
    """One real run to predict: its strategy, what it exercises, and its ``oobleck.run`` overrides."""

    name: str
    strategy: str
    what: str
    overrides: tuple[str, ...]


def read_holdout(path: str | Path) -> dict[str, Case]:
    """The cases of a held-out file (module docstring)."""
    from omegaconf import OmegaConf

    path = Path(path)
    try:
        data: Any = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as error:  # omegaconf raises several file and YAML errors
        raise RunError(f"{path}: unreadable ({error})") from None
    cases = data.get(HOLDOUT) if isinstance(data, dict) else None
    if not isinstance(cases, dict) or not cases:
        raise RunError(f"{path}: no '{HOLDOUT}:' mapping of cases (name: {{strategy, what, overrides}})")
    out = {}
    for name, case in cases.items():
        if not isinstance(case, dict) or sorted(case) != sorted(CASE_KEYS):
            raise RunError(f"{path}: case {name} must have exactly {', '.join(CASE_KEYS)}")
        overrides = case["overrides"]
        if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o for o in overrides):
            raise RunError(f"{path}: case {name}: overrides must be a list of key=value strings")
        out[str(name)] = Case(str(name), str(case["strategy"]), str(case["what"]), tuple(overrides))
    return out


def scores(table: pd.DataFrame, column: str = "set") -> pd.DataFrame:
    """Rows within target per set of a validation table (its ``column`` names each row's set):
    one row per set, the development set first, then the held-out one."""
    if column not in table:
        raise RunError(f"scores: the validation table has no {column!r} column")
    rows = []
    order = [s for s in (DEVELOPMENT, HOLDOUT) if s in set(table[column])]
    order += sorted(set(table[column]) - set(order))
    for name in order:
        part = table[table[column] == name]
        within = int(part["within_target"].sum())
        rows.append({column: name, "rows": len(part), "within_target": within, "share": within / len(part)})
    return pd.DataFrame(rows)

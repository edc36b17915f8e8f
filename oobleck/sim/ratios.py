"""Oobleck's throughput over each baseline's, per shifted start and as a median and range.

A ratio is only a number when the baseline ran and made progress. Otherwise the cell says why
(``note``), never ``inf``: ``OOM`` (the baseline fits in no layout's memory), ``no progress``
(it completed nothing: the ratio is unbounded). Separately, ``no_durable_progress`` marks a run
that kept nothing from before its last membership change (every iteration it did was rolled
back): its throughput is only the tail after the last change, so the ratio says little.
"""

from __future__ import annotations

import math

import pandas as pd

BASELINES = ("varuna", "bamboo")
REFERENCE = "oobleck"
KEYS = ("model", "trace", "start")


def _note(oom: bool, throughput: float) -> str:
    if oom:
        return "OOM"
    if not throughput > 0:
        return "no progress"
    return ""


def add_speedups(summary: pd.DataFrame) -> pd.DataFrame:
    """Columns ``speedup_vs_<baseline>`` (Oobleck's throughput over the baseline's on the same
    model, trace and start; NaN where it is not a number) and ``speedup_vs_<baseline>_note``."""
    out = summary.copy()
    keys = [k for k in KEYS if k in summary]
    rows = summary.set_index([*keys, "strategy"])
    for baseline in BASELINES:
        values, notes = [], []
        for _, row in summary.iterrows():
            key = tuple(row[k] for k in keys)
            try:
                ours = rows.loc[(*key, row["strategy"])]
                theirs = rows.loc[(*key, baseline)]
            except KeyError:
                values.append(math.nan)
                notes.append("")
                continue
            note = _note(bool(theirs["oom"]), float(theirs["throughput"]))
            notes.append(note)
            values.append(float(ours["throughput"]) / float(theirs["throughput"]) if not note else math.nan)
        out[f"speedup_vs_{baseline}"] = values
        out[f"speedup_vs_{baseline}_note"] = notes
    return out


def speedup_ranges(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, trace, baseline): Oobleck's speedup over the starts (median, min, max,
    how many starts gave a number) and the starts in which either kept no durable progress."""
    if REFERENCE not in set(summary["strategy"]):
        return pd.DataFrame()
    rows = []
    for (model, trace), group in summary.groupby(["model", "trace"], sort=False):
        ours = group[group["strategy"] == REFERENCE]
        for baseline in BASELINES:
            theirs = group[group["strategy"] == baseline]
            if theirs.empty:
                continue
            ratios = ours[f"speedup_vs_{baseline}"].dropna()
            notes = sorted(set(ours[f"speedup_vs_{baseline}_note"]) - {""})
            rows.append(
                {
                    "model": model,
                    "trace": trace,
                    "baseline": baseline,
                    "starts": len(ours),
                    "ratio_median": float(ratios.median()) if not ratios.empty else math.nan,
                    "ratio_min": float(ratios.min()) if not ratios.empty else math.nan,
                    "ratio_max": float(ratios.max()) if not ratios.empty else math.nan,
                    "ratio_starts": len(ratios),
                    "oobleck_throughput_median": float(ours["throughput"].median()),
                    "baseline_throughput_median": float(theirs["throughput"].median()),
                    "baseline_oom": bool(theirs["oom"].any()),
                    "baseline_no_durable_progress_starts": int(theirs["no_durable_progress"].sum()),
                    "oobleck_no_durable_progress_starts": int(ours["no_durable_progress"].sum()),
                    "note": ", ".join(notes),
                }
            )
    return pd.DataFrame(rows)

"""Oobleck's throughput over each baseline's: per shifted start, as a median and range, and as a
band over the uncertain constants with the cliff it may cross.

A ratio is only a number when the baseline ran and made progress. Otherwise the cell says why
(``note``), never ``inf``: ``OOM`` (the baseline fits in no layout's memory), ``does not run``
(it refused the cluster, e.g. torchft on nodes of several GPUs), ``no progress`` (it completed
nothing: the ratio is unbounded). Separately, ``no_durable_progress`` marks a run
that kept nothing from before its last membership change (every iteration it did was rolled
back): its throughput is only the tail after the last change, so the ratio says little.

The band (``speedup_ranges`` with the experiment's ``band`` rows): the ratio at every (sample,
start) of the uncertain constants (``oobleck.uncertainty``), the nominal point included:
``ratio_low`` and ``ratio_high`` are its lowest and highest, ``ratio_band_median`` its median;
``band_unbounded`` counts the points where the baseline made no progress at all (then
``ratio_high`` is NaN: the band is unbounded above). The cliff: a strategy that restarts on a
failure keeps durable progress only while a restart plus one checkpoint interval (and that
checkpoint's write) fits between two failures (its ``recovery_cycle_s`` against the trace's
``failure_interval_s``). Below that threshold its ratio moves smoothly with the constants; above
it the ratio is 20x to unbounded. The cycle counts only where the baseline restarted on at least
``RESTARTS_ON_MOST`` of the failures that took a working node (Varuna on every one; Bamboo only
when a stage and its only copy go together, where the rest of its failures fail over and the
cycle says nothing of its throughput). ``cycle_low_s`` and ``cycle_high_s`` are the baseline's cycle
over the band, and ``cliff`` is True where the band crosses the threshold (some points fit,
others do not): such a cell's median hides that the answer depends on constants nobody measured.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

BASELINE_ORDER = ("varuna", "bamboo", "torchft", "recycle")
# "Restarts on a failure": on at least half of the failures that took a working node.
RESTARTS_ON_MOST = 0.5
REFERENCE = "oobleck"
KEYS = ("model", "trace", "start")


def baselines_in(frame: pd.DataFrame) -> list[str]:
    """The strategies Oobleck is compared with: every other one present, known ones first."""
    present = [s for s in dict.fromkeys(frame["strategy"]) if s != REFERENCE]
    return [s for s in BASELINE_ORDER if s in present] + [s for s in present if s not in BASELINE_ORDER]


def _note(oom: bool, throughput: float, ran: bool = True) -> str:
    if oom:
        return "OOM"
    if not ran:
        return "does not run"
    if not throughput > 0:
        return "no progress"
    return ""


def add_speedups(summary: pd.DataFrame) -> pd.DataFrame:
    """Columns ``speedup_vs_<baseline>`` (Oobleck's throughput over the baseline's on the same
    model, trace and start; NaN where it is not a number) and ``speedup_vs_<baseline>_note``."""
    out = summary.copy()
    keys = [k for k in KEYS if k in summary]
    rows = summary.set_index([*keys, "strategy"])
    for baseline in baselines_in(summary):
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
            note = _note(bool(theirs["oom"]), float(theirs["throughput"]), bool(theirs.get("ran", True)))
            notes.append(note)
            values.append(float(ours["throughput"]) / float(theirs["throughput"]) if not note else math.nan)
        out[f"speedup_vs_{baseline}"] = values
        out[f"speedup_vs_{baseline}_note"] = notes
    return out


def band_of(band: pd.DataFrame, model: str, trace: str, baseline: str) -> dict[str, float | int | bool]:
    """The ratio band and the cliff of one cell from the experiment's band rows (module docstring)."""
    cell = band[(band["model"] == model) & (band["trace"] == trace)]
    ours = cell[cell["strategy"] == REFERENCE].set_index(["sample", "start"])
    theirs = cell[cell["strategy"] == baseline].set_index(["sample", "start"])
    if "ran" not in theirs:  # band rows written before the column existed: every strategy ran
        theirs = theirs.assign(ran=True)
    joined = (
        ours[["throughput"]]
        .rename(columns={"throughput": "throughput_ours"})
        .join(
            theirs[["throughput", "oom", "ran", "recovery_cycle_s", "restart_share", "failure_interval_s"]], how="inner"
        )
    )
    oom = joined["oom"].astype(bool) | ~joined["ran"].astype(bool)  # never ran: no ratio, not unbounded
    stalled = ~oom & ~(joined["throughput"] > 0)
    usable = joined[~oom & ~stalled]
    ratios = (usable["throughput_ours"] / usable["throughput"]).to_numpy(dtype=float)
    # A stalled baseline is an unbounded ratio: it counts above every number in the median.
    ranked = np.concatenate([ratios, np.full(int(stalled.sum()), math.inf)])
    median = float(np.median(ranked)) if ranked.size else math.nan
    restarting = joined[pd.to_numeric(joined["restart_share"], errors="coerce") >= RESTARTS_ON_MOST]
    cycles = pd.to_numeric(restarting["recovery_cycle_s"], errors="coerce").dropna()
    interval = float(joined["failure_interval_s"].iloc[0]) if len(joined) else math.nan
    low_cycle = float(cycles.min()) if not cycles.empty else math.nan
    high_cycle = float(cycles.max()) if not cycles.empty else math.nan
    return {
        "band_points": int(len(joined)),
        "band_samples": int(joined.index.get_level_values("sample").nunique()) if len(joined) else 0,
        "ratio_low": float(ratios.min()) if ratios.size else math.nan,
        "ratio_high": float(ratios.max()) if ratios.size and not stalled.any() else math.nan,
        "ratio_band_median": median if math.isfinite(median) else math.nan,
        "band_unbounded": int(stalled.sum()),
        "failure_interval_s": interval,
        "cycle_low_s": low_cycle,
        "cycle_high_s": high_cycle,
        "cliff": bool(low_cycle < interval <= high_cycle),
        "beyond_cliff": bool(low_cycle >= interval),
    }


def speedup_ranges(summary: pd.DataFrame, band: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (model, trace, baseline): Oobleck's speedup over the starts (median, min, max,
    how many starts gave a number), the starts in which either kept no durable progress, and with
    ``band`` the band and the cliff (module docstring)."""
    if REFERENCE not in set(summary["strategy"]):
        return pd.DataFrame()
    rows = []
    for (model, trace), group in summary.groupby(["model", "trace"], sort=False):
        ours = group[group["strategy"] == REFERENCE]
        for baseline in baselines_in(summary):
            theirs = group[group["strategy"] == baseline]
            if theirs.empty:
                continue
            ratios = ours[f"speedup_vs_{baseline}"].dropna()
            notes = sorted(set(ours[f"speedup_vs_{baseline}_note"]) - {""})
            row = {
                "model": model,
                "trace": trace,
                "baseline": baseline,
                "starts": len(ours),
                "ratio_median": float(ratios.median()) if not ratios.empty else math.nan,
                "ratio_min": float(ratios.min()) if not ratios.empty else math.nan,
                "ratio_max": float(ratios.max()) if not ratios.empty else math.nan,
                "ratio_starts": len(ratios),
                "oobleck_throughput_median": float(ours["throughput"].median()),
                # Oobleck never ran either: no strategy laid the model out (a row of its own in a figure).
                "oobleck_oom": bool(ours["oom"].all()) if "oom" in ours else False,
                "baseline_throughput_median": float(theirs["throughput"].median()),
                "baseline_oom": bool(theirs["oom"].any()),
                # Started only once more nodes joined (not out of memory): the longest such wait.
                "baseline_start_delay_s_max": float(theirs["start_delay_s"].max())
                if "start_delay_s" in theirs
                else math.nan,
                "baseline_no_durable_progress_starts": int(theirs["no_durable_progress"].sum()),
                "oobleck_no_durable_progress_starts": int(ours["no_durable_progress"].sum()),
                "note": ", ".join(notes),
            }
            if band is not None and not band.empty:
                row.update(band_of(band, model, trace, baseline))
            rows.append(row)
    return pd.DataFrame(rows)

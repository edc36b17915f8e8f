"""``python -m oobleck.simulate`` end to end in a subprocess: outputs, figures and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

pytestmark = pytest.mark.slow  # starts processes

REPO = Path(__file__).resolve().parents[2]


def _simulate(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "oobleck.simulate",
            f"hydra.run.dir={tmp_path / 'run'}",
            "logger.progress_bar=false",
            # wandb's runs of a simulation are tests/metrics/test_sim_wandb.py's (each costs a
            # second or more and a wandb service process)
            "logger.wandb.mode=disabled",
            *overrides,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_simulates_every_strategy_on_a_short_trace(tmp_path: Path):
    trace = tmp_path / "short.csv"
    lines = [f"0,add,n{i}" for i in range(8)] + ["1800000,remove,n2", "2400000,remove,n5", "3000000,add,n9"]
    trace.write_text("\n".join(lines) + "\n")
    done = _simulate(
        tmp_path,
        "experiment=paper_spot",
        "sim.models=[gpt2_small]",
        f"sim.traces=[{trace}]",
        "sim.duration_h=1.5",
        "sim.timeline_bin_s=600",
        "sim.trace_starts=2",
        "sim.trace_start_spacing_s=300",
        "sim.band_samples=1",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    summary = pd.read_csv(run / "sim_summary.csv")
    strategies = ["bamboo", "oobleck", "recycle", "torchft", "varuna"]  # torchft and ReCycle beside the paper's three
    assert sorted(summary["strategy"]) == sorted(strategies * 2)
    assert sorted(set(summary["start"])) == [0, 1] and sorted(set(summary["start_offset_s"])) == [0.0, 300.0]
    assert (summary["duration_s"] == 5400).all() and (summary["throughput"] > 0).all()
    assert "inf" not in (run / "sim_summary.csv").read_text()
    ratios = pd.read_csv(run / "sim_ratios.csv")
    assert sorted(ratios["baseline"]) == ["bamboo", "recycle", "torchft", "varuna"] and (ratios["starts"] == 2).all()
    assert (ratios["ratio_min"] <= ratios["ratio_median"]).all() and (
        ratios["ratio_median"] <= ratios["ratio_max"]
    ).all()
    events = pd.read_csv(run / "sim_events.csv")
    failures = events[events["kind"] == "failure"].groupby(["strategy", "start"]).size()
    assert (failures == 2).all() and len(failures) == 10
    assert set(events[events["kind"] == "start"]["time_s"]) == {45.0}  # paper_spot: 45 s to create the nodes
    assert {"reconfiguration"} <= set(events[events["strategy"] == "oobleck"]["kind"])
    assert {"reroute"} <= set(events[events["strategy"] == "recycle"]["kind"])
    assert {"continue"} <= set(events[events["strategy"] == "torchft"]["kind"])
    metrics = pd.read_csv(run / "sim_metrics.csv")
    assert {"t_start_s", "t_end_s", "phase", "samples_per_s", "nodes_alive"} <= set(metrics.columns)
    payload = json.loads((run / "summary.json").read_text())
    assert payload["experiment"] == "paper_spot" and len(payload["runs"]) == 10 and len(payload["ratios"]) == 4
    for figure in ("throughput_over_time.png", "effective_time_breakdown.png"):
        assert (run / figure).stat().st_size > 10_000
    assert "oobleck/varuna" in done.stdout and "oobleck/recycle" in done.stdout and "oobleck/torchft" in done.stdout
    # The band over the uncertain constants (conf/testbed/a100_analytic.yaml): 1 nominal + 3 grid
    # points x 1 sample, every start and strategy; the printed ratios carry it in braces.
    band, samples = pd.read_csv(run / "sim_band.csv"), pd.read_csv(run / "sim_samples.csv")
    assert len(samples) == 4 and len(band) == 4 * 2 * 5 and set(band["testbed"]) == {"a100_analytic"}
    assert {"achieved_flop_fraction", "storage_aggregate", "process_start"} <= set(samples.columns)
    assert (ratios["ratio_low"] <= ratios["ratio_min"]).all() and (ratios["band_points"] == 4 * 2).all()
    assert "{" in done.stdout and "the band over the uncertain constants" in done.stdout
    assert (run / "ratio_bands.png").stat().st_size > 10_000


def test_cli_bad_trace_is_one_clear_line(tmp_path: Path):
    bad = tmp_path / "bad.csv"
    bad.write_text("0,add,a\n10,remove,b\n")
    done = _simulate(tmp_path, "sim.models=[gpt2_small]", f"sim.traces=[{bad}]", "sim.figures=false")
    assert done.returncode == 2
    lines = [line for line in done.stderr.strip().splitlines() if line]
    assert lines[-1].startswith("oobleck.simulate: error:") and f"{bad}:2:" in lines[-1]
    assert "Traceback" not in done.stderr
    done = _simulate(tmp_path, "sim.models=[gpt9]", "sim.figures=false")
    assert done.returncode == 2 and "sim.models has 'gpt9'" in done.stderr

"""analysis/: tidy tables from simulator rows, the figures, and loading run dirs."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from analysis.figures import write_figures
from analysis.load import BREAKDOWN, breakdown, load_run, load_sim, throughput_table, timeline
from analysis.paper_figures import main as paper_figures_main
from oobleck.errors import RunError

PNG_MAGIC = b"\x89PNG"


def _segments() -> pd.DataFrame:
    base = {"model": "m", "trace": "synthetic/10m"}
    rows = [
        {**base, "strategy": "oobleck", "t_start_s": 0, "t_end_s": 90, "phase": "running", "nodes_alive": 4, "samples_per_s": 10.0},
        {**base, "strategy": "oobleck", "t_start_s": 90, "t_end_s": 120, "phase": "recovering", "nodes_alive": 3, "samples_per_s": 0.0},
        {**base, "strategy": "varuna", "t_start_s": 0, "t_end_s": 120, "phase": "running", "nodes_alive": 4, "samples_per_s": 5.0},
    ]
    return pd.DataFrame(rows)


def _summary() -> pd.DataFrame:
    rows = []
    for strategy, throughput, useful in (("oobleck", 7.5, 0.9), ("varuna", 5.0, 0.5), ("bamboo", 0.0, 0.0)):
        for trace in ("synthetic/10m", "synthetic/1h"):
            row = {"model": "m", "trace": trace, "strategy": strategy, "throughput": throughput, "oom": strategy == "bamboo"}
            shares = {k: 0.0 for k in BREAKDOWN}
            shares["useful"] = useful
            shares["idle"] = 1.0 - useful
            for key, share in shares.items():
                row[f"{key}_fraction"] = share
                row[f"{key}_node_s"] = share * 3600.0
            rows.append(row)
    return pd.DataFrame(rows)


def test_timeline_is_a_time_weighted_mean_per_bin():
    table = timeline(_segments(), bin_s=60.0)
    ours = table[table["strategy"] == "oobleck"].sort_values("time_h")
    # Bin 0-60 s: running at 10; bin 60-120 s: 30 s at 10 then 30 s at 0.
    assert ours["samples_per_s"].tolist() == pytest.approx([10.0, 5.0])
    assert ours["nodes_alive"].tolist() == pytest.approx([4.0, 3.5])
    assert ours["time_h"].tolist() == pytest.approx([0.0, 60 / 3600])


def test_breakdown_and_throughput_tables():
    long = breakdown(_summary())
    shares = long.groupby(["trace", "strategy"])["fraction"].sum()
    assert shares.tolist() == pytest.approx([1.0] * len(shares))
    table = throughput_table(_summary())
    assert table.loc[("m", "synthetic/10m"), "oobleck/varuna"] == pytest.approx(1.5)
    assert pd.isna(table.loc[("m", "synthetic/10m"), "oobleck/bamboo"])  # bamboo OOM: no ratio


def test_figures_are_written(tmp_path: Path):
    written = write_figures(_segments(), _summary(), tmp_path, bin_s=60.0)
    names = sorted(p.name for p in written)
    assert names == ["effective_time_breakdown.png", "throughput_over_time.png", "throughput_vs_frequency.png"]
    for path in written:
        assert path.read_bytes()[:4] == PNG_MAGIC and path.stat().st_size > 10_000


def test_paper_figures_regenerate_from_a_sim_dir(tmp_path: Path):
    sim = tmp_path / "sim"
    sim.mkdir()
    _segments().to_csv(sim / "sim_metrics.csv", index=False)
    _summary().to_csv(sim / "sim_summary.csv", index=False)
    assert paper_figures_main([str(tmp_path / "out"), str(sim), "--bin-s", "60"]) == 0
    table = (tmp_path / "out" / "paper_table.md").read_text()
    assert "| m | 10m |" in table and "OOM/0" in table
    assert load_sim(sim).summary.shape[0] == 6


def test_load_run_reads_files_and_names_missing_ones(tmp_path: Path):
    with pytest.raises(RunError, match="metrics.csv does not exist"):
        load_run(tmp_path)
    (tmp_path / "metrics.csv").write_text("step,time_s,samples\n1,0.5,8\n2,1.0,8\n")
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 2}))
    run = load_run(tmp_path)
    assert run.metrics["samples"].sum() == 16 and run.summary == {"steps": 2} and run.events.empty
    (tmp_path / "plan.json").write_text("{not json")
    with pytest.raises(RunError, match="plan.json: not valid JSON"):
        load_run(tmp_path)

"""The analysis notebooks execute headless (nbclient) on small inputs: a short simulation, the real
sweep and a hand-written restart run; their jupytext sources hold no outputs."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from analysis.notebooks import HERE, build, execute, names, notebook_path
from oobleck.errors import ConfigError, RunError

# Slow: starts processes. One xdist group with the other user of the session's sweep (conftest.py),
# so the sweep runs once, on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("analysis_sweep")]

CELL_S = 300.0  # per-cell hang guard of the kernel, not a speed target
TRACE = [f"0,add,n{i}" for i in range(8)] + ["1800000,remove,n2", "2400000,remove,n5", "3000000,add,n9"]


def _errors(notebook) -> list[str]:
    return [
        o.get("ename", "")
        for c in notebook.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.output_type == "error"
    ]


def test_sources_are_scripts_with_one_parameters_cell():
    assert names() == ["01_paper_figures", "02_strategy_comparison", "03_validation"]
    for name in names():
        text = notebook_path(name).read_text()
        assert "format_name: percent" in text and '"outputs"' not in text
        notebook = build(name, {"out_dir": "x"})
        tags = [cell.metadata.get("tags", []) for cell in notebook.cells]
        assert tags.count(["parameters"]) == 1 and tags.index(["injected-parameters"]) == tags.index(["parameters"]) + 1
    assert not list(HERE.glob("*.ipynb"))
    with pytest.raises(ConfigError, match="has no parameter colour"):
        build("02_strategy_comparison", {"colour": "red"})
    with pytest.raises(ConfigError, match="no notebook 'nope'"):
        build("nope")


def test_paper_figures_notebook_on_a_short_simulation(tmp_path: Path):
    trace = tmp_path / "short.csv"
    trace.write_text("\n".join(TRACE) + "\n")
    simulate = [
        "experiment=paper_spot",
        "sim.models=[gpt2_small]",
        f"sim.traces=[{trace},synthetic/10m]",
        "sim.duration_h=1.5",
        "sim.trace_starts=1",  # the starts' spread is tested in tests/sim; one keeps this short
        "sim.band_samples=1",
        "logger.wandb.mode=disabled",
    ]
    notebook = execute(
        "01_paper_figures",
        {"simulate": simulate, "out_dir": str(tmp_path / "out"), "bin_s": 300.0},
        out=tmp_path / "01.ipynb",
        cwd=tmp_path,
        timeout_s=CELL_S,
    )
    assert _errors(notebook) == [] and (tmp_path / "01.ipynb").is_file()
    out = tmp_path / "out"
    for stem in ("throughput_vs_frequency", "throughput_over_time", "effective_time_breakdown", "ratio_bands"):
        assert (out / f"{stem}.png").stat().st_size > 10_000 and (out / f"{stem}.pdf").is_file()
    table = (out / "paper_table.md").read_text()
    assert "| GPT-2 small | 10m |" in table and "inf" not in table and "{" in table  # ratios with their bands
    assert set(pd.read_csv(out / "effective_time.csv")["strategy"]) == {
        "Oobleck",
        "Varuna",
        "Bamboo",
        "torchft",
        "ReCycle",
    }
    assert "ReCycle / Oobleck (claimed: up to 1.46x)" in table


def test_strategy_comparison_notebook(sweep, restart_run, tmp_path: Path):
    notebook = execute(
        "02_strategy_comparison",
        {"sweep_dirs": [str(sweep)], "run_dirs": [str(restart_run)], "out_dir": str(tmp_path / "out")},
        cwd=tmp_path,
        timeout_s=CELL_S,
    )
    assert _errors(notebook) == []
    out = tmp_path / "out"
    for stem in ("throughput_timeline", "recovery_breakdown", "time_lost"):
        assert (out / f"{stem}.png").is_file() and (out / f"{stem}.pdf").is_file()
    lost = pd.read_csv(out / "time_lost.csv")
    assert sorted(lost["strategy"]) == ["oobleck", "oobleck", "varuna"]  # all three share remove1@4
    assert set(pd.read_csv(out / "recovery_breakdown.csv")["kind"]) == {"reconfiguration", "restart"}


def test_validation_notebook_calibrates_on_one_job_and_predicts_the_other(sweep, tmp_path: Path):
    notebook = execute(
        "03_validation",
        {"sweep_dirs": [str(sweep)], "calibration_jobs": ["0"], "out_dir": str(tmp_path / "out")},
        cwd=tmp_path,
        timeout_s=CELL_S,
    )
    assert _errors(notebook) == []
    table = pd.read_csv(tmp_path / "out" / "validation.csv")
    assert set(table["model"]) == {"planner", "calibrated", "predicted"}
    assert {"throughput", "recovery_s"} <= set(table["metric"]) and table["run"].str.endswith("/1").all()
    assert (tmp_path / "out" / "validation_ratios.pdf").is_file()


def test_a_failing_notebook_names_its_error(tmp_path: Path):
    with pytest.raises(RunError, match="notebook 02_strategy_comparison failed: .*give run_dirs or sweep_dirs"):
        execute("02_strategy_comparison", {"out_dir": str(tmp_path)}, cwd=tmp_path, timeout_s=CELL_S)

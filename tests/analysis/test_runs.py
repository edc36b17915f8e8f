"""Real runs: a Hydra sweep loaded and labelled by config, the comparison tables and figures,
the sweep's wandb runs (names, groups) and the strategy workspace built on what they log."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from analysis.comparison import recovery_breakdown, time_lost
from analysis.dashboards import EVENT_MARKERS, spec, strategy_workspace
from analysis.load import load_run_set, load_runs, load_sweep
from analysis.run_figures import step_path, throughput_timeline, throughput_timeline_figure, training_start
from oobleck.errors import RunError
from oobleck.metrics.offline import find_offline_runs

# Starts processes: the package's real sweep (tests/analysis/conftest.py), which the notebook tests
# share; on the grouped xdist worker it runs once per session, not once on each worker.
# Slow: starts processes. One xdist group with the other user of the session's sweep (conftest.py),
# so the sweep runs once, on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("analysis_sweep")]

FINISH_S = 60.0  # wandb writes the run file after finish() returns: a hang guard only


def test_sweep_jobs_are_labelled_by_config_not_by_dir(sweep):
    runs = load_sweep(sweep)
    table = runs.runs.set_index("job")
    assert list(table.index) == ["0", "1"] and set(table["sweep"]) == {"sweep"}
    assert table.loc["0", "nodes"] == 3 and table.loc["1", "nodes"] == 4
    assert set(table["strategy"]) == {"oobleck"} and set(table["model"]) == {"gpt3_tiny"}
    assert set(table["failures"]) == {"remove1@4"}
    assert table.loc["1", "label"] == "Oobleck, GPT-3 tiny, 4 nodes, remove1@4"
    assert "cluster.nodes=4" in table.loc["1", "overrides"] and table.loc["1", "samples"] == 320
    # Every metrics row carries its run's labels; the runs' rows never mix.
    assert runs.metrics.groupby("run")["nodes"].first().tolist() == [3, 4]
    assert runs.metrics.groupby("run")["step"].apply(list).tolist() == [list(range(10))] * 2
    assert {"fault_injected", "reconfiguration"} <= set(runs.events["kind"])
    # The same jobs given as plain run dirs still get distinct ids ("0" and "1" are unique here).
    metrics, events = load_runs(list(table["path"]))
    assert sorted(metrics["run"].unique()) == ["0", "1"] and not events.empty


def test_two_sweeps_keep_their_job_zero_apart(sweep, tmp_path):
    import shutil

    other = tmp_path / "multirun" / "other"
    shutil.copytree(sweep / "sweep", other)
    runs = load_run_set(sweeps=[sweep, tmp_path / "multirun"])
    assert sorted(runs.runs["run"]) == ["other/0", "other/1", "sweep/0", "sweep/1"]
    assert runs.runs["label"].is_unique  # same config twice: the run id is added to the label


def test_loader_errors_name_the_folder(tmp_path):
    with pytest.raises(RunError, match="no multirun.yaml"):
        load_sweep(tmp_path)
    with pytest.raises(RunError, match="not a directory"):
        load_sweep(tmp_path / "missing")
    with pytest.raises(RunError, match="no run dirs"):
        load_run_set([])
    (tmp_path / "metrics.csv").write_text("step,time_s\n0,1.0\n")
    with pytest.raises(RunError, match="the same run dir is given twice"):
        load_run_set([tmp_path, tmp_path])
    with pytest.raises(RunError, match="no column 'colour'"):
        load_run_set([tmp_path]).select(colour="red")


def test_time_lost_and_recovery_breakdown(sweep, restart_run):
    runs = load_run_set([restart_run], [sweep]).select(nodes=4)
    assert sorted(runs.runs["strategy"]) == ["oobleck", "varuna"]
    phases = recovery_breakdown(runs)
    ours = phases[phases["strategy"] == "oobleck"]
    assert set(ours["kind"]) == {"reconfiguration"} and {"detect", "plan", "groups", "state_copy", "first_step"} <= set(
        ours["phase"]
    )
    for strategy in ("oobleck", "varuna"):
        total = float(
            runs.events[
                (runs.events["strategy"] == strategy) & runs.events["kind"].isin(["reconfiguration", "restart"])
            ]["total_s"].sum()
        )
        assert phases[phases["strategy"] == strategy]["seconds"].sum() == pytest.approx(total, abs=2e-3)
    theirs = phases[phases["strategy"] == "varuna"].set_index("phase")["seconds"]
    assert theirs["spawn"] == pytest.approx(1.2) and theirs["stop"] == pytest.approx(0.3)
    lost = time_lost(runs).set_index("strategy")
    assert lost.loc["oobleck", "committed_steps"] == 10 and lost.loc["oobleck", "redone_steps"] == 0
    assert lost.loc["varuna", "redone_steps"] == 1 and lost.loc["varuna", "restarts"] == 1  # rolled back to step 3
    assert lost.loc["varuna", "checkpoint_s"] == pytest.approx(0.02)
    for row in lost.to_dict(orient="records"):
        parts = row["useful_s"] + row["recovery_s"] + row["checkpoint_s"] + row["other_lost_s"]
        assert parts == pytest.approx(row["span_s"]) and row["lost_s"] == pytest.approx(row["span_s"] - row["useful_s"])
    assert lost.loc["varuna", "recovery_s"] > lost.loc["oobleck", "recovery_s"]


def test_step_path_breaks_at_a_recovery_and_keeps_outliers():
    rows = pd.DataFrame(
        {"time_s": [1.0, 1.1, 3.0, 3.01], "step_time_s": [0.1, 0.1, 0.2, 0.01], "samples_per_s": [100, 100, 50, 2000]}
    )
    xs, ys = step_path(rows)
    assert xs[:4] == pytest.approx([0.9, 1.0, 1.0, 1.1]) and ys[4] != ys[4]  # NaN: no line across the gap
    assert xs[5:] == pytest.approx([2.8, 3.0, 3.0, 3.01]) and max(y for y in ys if y == y) == 2000  # not clipped


def test_throughput_timeline_marks_failures_and_recoveries(sweep, restart_run, tmp_path):
    runs = load_run_set([restart_run], [sweep]).select(nodes=4)
    fig = throughput_timeline_figure(runs)
    panels = [ax for ax in fig.axes if ax.get_title(loc="left")]
    assert [ax.get_title(loc="left") for ax in panels] == list(runs.runs["label"])
    assert all(ax.get_shared_x_axes().joined(panels[0], ax) for ax in panels)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["failure injected", "reconfiguration", "restart", "checkpoint"]
    for ax, run in zip(panels, runs.runs["run"]):
        events = runs.events[runs.events["run"] == run]
        start = training_start(runs.metrics[runs.metrics["run"] == run])
        lines = [
            line.get_xdata()[0]
            for line in ax.get_lines()
            if len(line.get_xdata()) == 2 and line.get_xdata()[0] == line.get_xdata()[1]
        ]
        injected = (events[events["kind"] == "fault_injected"]["time_s"] - start).tolist()
        assert injected and all(any(abs(x - t) < 1e-9 for x in lines) for t in injected)
        assert ax.get_ylim()[1] >= runs.metrics[runs.metrics["run"] == run]["samples_per_s"].max()
    assert [p.suffix for p in throughput_timeline(runs, tmp_path / "timeline.png")] == [".png", ".pdf"]


def test_sweep_wandb_runs_are_unique_and_grouped(sweep):
    offline = sorted(find_offline_runs(sweep, complete_within_s=FINISH_S), key=lambda r: r.config["sweep_job_num"])
    assert [r.name for r in offline] == ["oobleck-gpt3_tiny-n3-remove1@4-j0", "oobleck-gpt3_tiny-n4-remove1@4-j1"]
    assert {r.group for r in offline} == {"sweep-sweep"} and {r.job_type for r in offline} == {"oobleck"}
    assert len({r.run_id for r in offline}) == 2
    for run in offline:
        assert "cluster.nodes" in run.config["sweep_overrides"] and run.config["strategy"]["name"] == "oobleck"
        job = sweep / "sweep" / str(run.config["sweep_job_num"])
        summary = json.loads((job / "summary.json").read_text())
        assert run.summary["samples"] == summary["samples"] == 320  # 10 steps of 32
        assert json.loads((job / "wandb_run_ids.json").read_text()) == {"run": run.run_id}
        assert {".hydra/config.yaml", ".hydra/overrides.yaml", "metrics.csv", "events.csv", "plan.json"} <= set(
            run.artifact("run-files").files
        )


def test_strategy_workspace_refers_to_what_real_runs_log(sweep):
    offline = find_offline_runs(sweep, complete_within_s=FINISH_S)
    view = spec(strategy_workspace("me", "oobleck", "sweep-sweep"))
    section = view["spec"]["section"]
    filters = {(f["key"]["name"], f["op"], str(f["value"])) for f in section["runSets"][0]["filters"]["filters"]}
    assert filters == {("group", "=", "sweep-sweep"), ("tags", "IN", "['real']")}
    assert section["runSets"][0]["grouping"] == [{"section": "run", "name": "jobType"}]
    logged = {k for r in offline for row in r.history for k in row} | {k for r in offline for k in r.summary}
    axes = {m.name for r in offline for m in r.metrics}
    # Markers and recovery times of kinds these Oobleck runs do not produce (failover, restart,
    # join, checkpoint, stop) are what other strategies' runs log under the same names.
    possible = {f"event/{k}" for k in EVENT_MARKERS} | {f"event/{k}/total_s" for k in ("failover", "restart")}
    for panel in [p for s in section["panelBankConfig"]["sections"] for p in s["panels"]]:
        config = panel["config"]
        keys = {m.removeprefix("summary_metrics.") for m in config.get("metrics", [])}
        assert keys & logged, f"{config.get('chartTitle')}: none of {keys} is logged"
        assert keys <= logged | possible, f"{config.get('chartTitle')}: {keys - logged - possible}"
        if "xAxis" in config:
            assert config["xAxis"] in axes

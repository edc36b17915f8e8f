"""The simulator's wandb runs, read back from their offline files: one per (model, trace,
strategy) with numeric history over simulated time, grouped by experiment, plus the figures run;
and the paper comparison workspace refers only to what those runs hold."""

from __future__ import annotations

import pandas as pd
import pytest

from analysis.dashboards import SIM_EVENTS, SIM_REACTIONS, paper_workspace, spec
from oobleck.config import compose_config
from oobleck.metrics.offline import find_offline_runs
from oobleck.metrics.simulation import SIM_TIME
from oobleck.simulate import run as simulate

# wandb's service writes the run file after finish() returns: a hang guard, not a speed target.
FINISH_S = 60.0
# 8 nodes for 2 h: two nodes lost (30 and 40 minutes in) and one joining (50 minutes in).
TRACE = [f"0,add,n{i}" for i in range(8)] + ["1800000,remove,n2", "2400000,remove,n5", "3000000,add,n9"]


def _compose(*overrides: str):
    return compose_config(*overrides)


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    root = tmp_path_factory.mktemp("sim")
    trace = root / "short.csv"
    trace.write_text("\n".join(TRACE) + "\n")
    cfg = _compose(
        "experiment=paper_spot",
        "sim.models=[gpt2_small]",
        f"sim.traces=[{trace}]",
        "sim.duration_h=1.5",
        "sim.trace_starts=1",
        "sim.timeline_bin_s=600",
        "logger.progress_bar=false",
        "logger.wandb.mode=offline",
    )
    simulate(cfg, root / "run")
    runs = {
        (r.config.get("sim_run") or {}).get("strategy", r.job_type): r
        for r in find_offline_runs(root / "run", complete_within_s=FINISH_S)
    }
    return root / "run", "short", runs  # a trace file is named by its stem


def test_one_run_per_strategy_grouped_by_experiment(simulated):
    run_dir, trace, runs = simulated
    assert sorted(runs) == ["bamboo", "figures", "oobleck", "recycle", "torchft", "varuna"]
    summary = pd.read_csv(run_dir / "sim_summary.csv").set_index("strategy")
    for strategy in ("oobleck", "varuna", "bamboo", "recycle"):
        run = runs[strategy]
        assert run.group == "paper_spot" and run.job_type == strategy
        assert run.name == f"sim-{strategy}-gpt2_small-n8-{trace}"
        assert {"simulation", strategy, "gpt2_small", "nodes=8", f"failures={trace}", "experiment=paper_spot"} <= set(
            run.tags
        )
        # The same config keys a real run has, so one dashboard groups and filters both.
        assert run.config["strategy"]["name"] == strategy and run.config["model"]["name"] == "gpt2_small"
        assert run.config["failures"] == {"kind": "trace", "trace": trace}
        assert run.summary["throughput"] == pytest.approx(summary.loc[strategy, "throughput"])
        assert run.summary["useful_fraction"] == pytest.approx(summary.loc[strategy, "useful_fraction"])


def test_history_is_numeric_over_simulated_time(simulated):
    run_dir, _, runs = simulated
    run = runs["oobleck"]
    assert {m.name: m.step_metric for m in run.metrics}["sim/*"] == SIM_TIME
    rows = [r for r in run.history if "sim/samples_per_s" in r]
    segments = pd.read_csv(run_dir / "sim_metrics.csv").query("strategy == 'oobleck'")
    assert len(rows) == 2 * len(segments)  # both ends of every period of constant state
    assert rows[-1][SIM_TIME] == pytest.approx(1.5)
    assert all(isinstance(r["sim/samples_per_s"], (int, float)) and isinstance(r["sim/nodes_alive"], int) for r in rows)
    # 0 while paper_spot's nodes are being created (sim.node_creation_s), then 8, 7, 6.
    assert {r["sim/nodes_alive"] for r in rows} == {0, 8, 7, 6}
    # Events: markers at their simulated time, and the typed table.
    assert run.column("event/failure") == [1, 2] and run.column("event/join") == [1]
    failures = [r[SIM_TIME] for r in run.history if "event/failure" in r]
    assert failures == pytest.approx([0.5, 40 / 60])
    table = run.table("events")
    kinds = [dict(zip(table["columns"], row))["kind"] for row in table["data"]]
    assert kinds.count("failure") == 2 and "reconfiguration" in kinds
    number = {t["wb_type"] for t in table["column_types"]["params"]["type_map"]["time_s"]["params"]["allowed_types"]}
    assert number == {"none", "number"}
    assert runs["varuna"].column("event/restart") and runs["bamboo"].column("event/reconfiguration")


def test_artifacts_hold_each_runs_rows_and_the_figures(simulated):
    run_dir, _, runs = simulated
    files = runs["varuna"].artifact("sim-files").files
    rows = pd.read_csv(files["sim_metrics.csv"])
    assert set(rows["strategy"]) == {"varuna"} and len(rows) > 1
    assert pd.read_csv(files["sim_summary.csv"])["strategy"].tolist() == ["varuna"]
    outputs = runs["figures"].artifact("sim-outputs").files
    assert {
        "sim_summary.csv",
        "summary.json",
        "throughput_over_time.png",
        "throughput_over_time.pdf",
        "effective_time_breakdown.pdf",
        ".hydra/config.yaml",
    } - {".hydra/config.yaml"} <= set(outputs)
    assert runs["figures"].group == "paper_spot" and runs["figures"].job_type == "figures"
    assert any(k.startswith("figures/") for row in runs["figures"].history for k in row)


def test_paper_workspace_refers_to_what_the_runs_log(simulated):
    _, _, runs = simulated
    view = spec(paper_workspace("me", "oobleck", "paper_spot"))
    section = view["spec"]["section"]
    filters = section["runSets"][0]["filters"]["filters"]
    assert {(f["key"]["name"], f["op"], str(f["value"])) for f in filters} == {
        ("group", "=", "paper_spot"),
        ("tags", "IN", "['simulation']"),
        ("jobType", "!=", "figures"),
    }
    assert section["settings"]["xAxis"] == SIM_TIME
    logged = {k for r in runs.values() for row in r.history for k in row} | {
        k for r in runs.values() for k in r.summary
    }
    # Reactions this short trace does not provoke (failover without a repair, OOM, stop) are
    # still keys the simulator logs when they happen: markers named after the engine's kinds.
    possible = {f"event/{k}" for k in SIM_EVENTS} | {f"event/{k}/downtime_s" for k in SIM_REACTIONS}
    panels = [p for s in section["panelBankConfig"]["sections"] for p in s["panels"]]
    assert len(panels) == 7
    for panel in panels:
        config = panel["config"]
        keys = {m.removeprefix("summary_metrics.") for m in config.get("metrics", [])}
        assert keys and keys & logged, f"{config.get('chartTitle')}: none of {keys} is logged"
        assert keys <= logged | possible, f"{config.get('chartTitle')}: {keys - logged - possible} never logged"
        if panel["viewType"] == "Run History Line Plot":
            assert config["xAxis"] == SIM_TIME

"""RunRecorder writes the run dir's files and a real offline wandb run, read back from its file."""

import json

import pandas as pd
import pytest
from omegaconf import OmegaConf

from oobleck.errors import RunError
from oobleck.metrics import RunRecorder, format_table
from oobleck.metrics.offline import find_offline_runs, read_offline_run
from oobleck.metrics.recorder import printed_summary
from oobleck.metrics.wandb_run import RUN_IDS_FILE, SweepJob, failures_label, run_identity, typed_frame
from testing import config_section

# wandb's service writes the run file after finish() returns: a hang guard, not a speed target.
FINISH_S = 60.0

CONFIG = {
    "model": {"name": "gpt3_tiny"},
    "cluster": {"nodes": 4},
    "failures": {"kind": "explicit", "events": [{"action": "remove", "step": 8, "count": 1}]},
    "strategy": {"name": "oobleck"},
    "experiment": "default",
}


def test_files_and_growing_header(tmp_path):
    recorder = RunRecorder(tmp_path, {"model": {"name": "gpt3_tiny"}}, total_steps=3, progress_bar=False)
    recorder.step(step=0, samples=8, samples_per_s=4.0, loss=5.5, generation=0, pipelines=2, attempts=1)
    recorder.step(step=1, samples=16, samples_per_s=4.1, loss=5.1, generation=1, pipelines=2, attempts=2, redo=True)
    recorder.event("failure", nodes="[2]", generation=0, step=1)
    recorder.event("reconfiguration", generation=1, step=1, total_s=0.8, bytes_moved=1024)
    recorder.write_plan({"pipelines": [[0, 1], [2, 3]]})
    summary = recorder.finish(steps=2, recoveries=1)

    metrics = pd.read_csv(tmp_path / "metrics.csv")
    assert list(metrics["step"]) == [0, 1]
    assert list(metrics["attempts"]) == [1, 2]
    assert "redo" in metrics.columns and metrics["strategy"].eq("oobleck").all()
    events = pd.read_csv(tmp_path / "events.csv")
    assert list(events["kind"]) == ["failure", "reconfiguration"]
    assert events.loc[1, "bytes_moved"] == 1024
    assert json.loads((tmp_path / "summary.json").read_text())["recoveries"] == 1
    assert json.loads((tmp_path / "plan.json").read_text())["pipelines"] == [[0, 1], [2, 3]]
    assert summary["steps"] == 2
    assert not (tmp_path / "wandb").exists() and not (tmp_path / RUN_IDS_FILE).exists()


def _record(run_dir, steps=range(20), *, resume=False, wandb=None):
    """What the controller records for a 4-node run losing a node at step 8 (32 samples per step)."""
    settings = wandb or config_section("logger", wandb={"mode": "offline", "tags": ["mine"]}).wandb
    recorder = RunRecorder(run_dir, CONFIG, total_steps=20, wandb=settings, progress_bar=False, resume=resume)
    recorder.write_plan({"pipelines": [[0, 1], [2, 3]]})
    for step in steps:
        if step == 8:
            recorder.event("fault_injected", nodes=[0], fault="kill", step=8, time_s=1.0 + 0.1 * step)
            recorder.event(
                "reconfiguration",
                generation=1,
                reason="failure",
                removed=[0],
                joined=[],
                resume_step=8,
                detect_s=0.002,
                plan_s=0.001,
                groups_s=0.05,
                state_copy_s=0.0,
                bytes_moved=4096,
                first_step_s=0.2,
                total_s=0.4,
                replicas_identical=True,
                time_s=1.0 + 0.1 * step + 0.4,
            )
        recorder.step(
            step=step,
            samples=32,
            samples_per_s=320.0,
            loss=5.0 - 0.01 * step,
            generation=int(step >= 8),
            pipelines=4 - int(step >= 8),
            attempts=1 + int(step == 8),
            step_time_s=0.1,
            nodes=4 - int(step >= 8),
            time_s=1.1 + 0.1 * step,
        )
    return recorder.finish(
        steps=len(list(steps)), samples=32 * len(list(steps)), recoveries=1, median_samples_per_s=320.0
    )


def test_offline_wandb_run_holds_what_a_dashboard_needs(tmp_path):
    _record(tmp_path)
    (run,) = find_offline_runs(tmp_path, complete_within_s=FINISH_S)
    # Identity: named, grouped with comparable runs, job type = strategy, tags for the comparison.
    assert run.name == "oobleck-gpt3_tiny-n4-remove1@8"
    assert run.group == "gpt3_tiny-n4-remove1@8" and run.job_type == "oobleck"
    assert set(run.tags) >= {"real", "oobleck", "gpt3_tiny", "nodes=4", "failures=remove1@8", "mine"}
    assert run.config["model"]["name"] == "gpt3_tiny" and run.config["cluster"]["nodes"] == 4
    assert run.config["failures_label"] == "remove1@8" and run.config["run_dir"] == str(tmp_path)
    assert json.loads((tmp_path / RUN_IDS_FILE).read_text()) == {"run": run.run_id}
    # The summary's totals are the run's totals, not the last step's (the "32 instead of 640" bug).
    assert run.summary["samples"] == 640 and run.summary["recoveries"] == 1
    assert run.summary["train/samples"] == 32 and run.summary["train/samples_total"] == 640
    # x-axes: train/* against step, event/* against wall time.
    axes = {m.name: m.step_metric for m in run.metrics}
    assert axes["train/*"] == "step" and axes["event/*"] == "time_s" and "step" in axes and "time_s" in axes
    steps = [row for row in run.history if "train/samples_per_s" in row]
    assert [row["step"] for row in steps] == list(range(20))
    assert [row["time_s"] for row in steps] == pytest.approx([1.1 + 0.1 * s for s in range(20)])
    assert run.column("train/samples_total")[-1] == 640 and run.column("train/loss")[0] == pytest.approx(5.0)
    # Events: markers on the time axis with their numeric fields ...
    markers = [row for row in run.history if "event/reconfiguration" in row]
    assert len(markers) == 1 and markers[0]["time_s"] == pytest.approx(2.2)
    assert markers[0]["event/reconfiguration/total_s"] == pytest.approx(0.4)
    assert run.column("event/fault_injected") == [1]
    # ... and a typed table: numbers are numbers, lists are JSON text, flags are booleans.
    table = run.table("events")
    types = {
        name: {t["wb_type"] for t in spec["params"]["allowed_types"]} - {"none"}
        for name, spec in table["column_types"]["params"]["type_map"].items()
    }
    assert types["time_s"] == {"number"} and types["total_s"] == {"number"} and types["bytes_moved"] == {"number"}
    assert types["kind"] == {"string"} and types["removed"] == {"string"} and types["replicas_identical"] == {"boolean"}
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert [r["kind"] for r in rows] == ["fault_injected", "reconfiguration"] and json.loads(rows[1]["removed"]) == [0]
    # Artifacts: the run dir's files and the resolved config, staged for wandb sync.
    files = run.artifact("run-files").files
    assert {"config.yaml", "plan.json", "metrics.csv", "events.csv", "summary.json"} <= set(files)
    staged = OmegaConf.load(files["config.yaml"])
    assert staged.model.name == "gpt3_tiny" and staged.failures.events[0].step == 8
    assert pd.read_csv(files["metrics.csv"])["step"].tolist() == list(range(20))
    assert json.loads(open(files["summary.json"]).read())["samples"] == 640


def test_a_resumed_run_continues_the_same_wandb_run_and_csv(tmp_path):
    _record(tmp_path, range(10))
    _record(tmp_path, range(10, 20), resume=True)
    first, second = sorted(find_offline_runs(tmp_path, complete_within_s=FINISH_S), key=lambda r: r.path.parent.name)
    assert first.run_id == second.run_id and first.resume and second.resume
    assert pd.read_csv(tmp_path / "metrics.csv")["step"].tolist() == list(range(20))
    assert pd.read_csv(tmp_path / "events.csv")["kind"].tolist() == ["fault_injected", "reconfiguration"]
    assert [row["step"] for row in second.history if "train/loss" in row] == list(range(10, 20))


def test_disabled_wandb_writes_no_run(tmp_path):
    _record(tmp_path, range(2), wandb=config_section("logger", wandb={"mode": "disabled"}).wandb)
    assert not (tmp_path / "wandb").exists() and (tmp_path / "metrics.csv").is_file()


def test_identity_rules():
    sweep = SweepJob(num=3, override_dirname="strategy=varuna", sweep_dir="/x/multirun/2026-12-01_10-00-00")
    common = {"strategy": "varuna", "model": "gpt3_tiny", "nodes": 4, "failures": "remove1@8"}
    alone = run_identity(**common, experiment="default", group=None)
    assert (alone.name, alone.group, alone.job_type) == (
        "varuna-gpt3_tiny-n4-remove1@8",
        "gpt3_tiny-n4-remove1@8",
        "varuna",
    )
    swept = run_identity(**common, experiment="default", group=None, sweep=sweep)
    assert swept.name.endswith("-j3") and swept.group == "sweep-2026-12-01_10-00-00"
    assert run_identity(**common, experiment="paper_spot", group=None, sweep=sweep).group == "paper_spot"
    named = run_identity(**common, experiment="paper_spot", group="mine", tags=["x" * 80])
    assert named.group == "mine" and "experiment=paper_spot" in named.tags and max(map(len, named.tags)) == 64
    sim = run_identity(
        strategy="bamboo",
        model="gpt3_6_7b",
        nodes=30,
        failures="spot/ec2_p3_scaled",
        experiment="paper_spot",
        group=None,
        simulated=True,
    )
    assert sim.name == "sim-bamboo-gpt3_6_7b-n30-spot-ec2_p3_scaled" and "simulation" in sim.tags


def test_failure_labels():
    assert failures_label({"kind": "none"}) == "none"
    assert (
        failures_label(
            {
                "kind": "explicit",
                "events": [
                    {"action": "remove", "step": 8, "nodes": [1, 2]},
                    {"action": "join", "time_s": 2.5, "count": 1},
                ],
            }
        )
        == "remove2@8+join1@2.5s"
    )
    assert (
        failures_label({"kind": "explicit", "events": [{"action": "remove", "step": s} for s in range(5)]})
        == "explicit5"
    )
    assert failures_label({"kind": "poisson", "mtbf_s": 60.0}) == "mtbf60s"
    assert failures_label({"kind": "trace", "trace": "synthetic/10m"}) == "synthetic/10m"


def test_typed_frame_types_each_column_by_its_values():
    frame = typed_frame([{"a": 1, "b": "x", "c": [1], "d": True}, {"a": None, "b": 2, "d": None}], ["a", "b", "c", "d"])
    assert str(frame["a"].dtype) == "float64" and frame["a"].isna().tolist() == [False, True]
    assert (
        frame["b"].tolist() == ["x", "2"]
        and frame["c"].tolist() == ["[1]", None]
        and frame["d"].tolist() == [True, None]
    )


def test_a_corrupt_run_file_is_named(tmp_path):
    _record(tmp_path, range(2))
    (run,) = find_offline_runs(tmp_path, complete_within_s=FINISH_S)
    data = bytearray(run.path.read_bytes())
    data[200] ^= 0xFF
    run.path.write_bytes(bytes(data))
    with pytest.raises(RunError, match="checksum mismatch"):
        read_offline_run(run.path)
    (tmp_path / "other.wandb").write_bytes(b"not a run")
    with pytest.raises(RunError, match="not a wandb run file"):
        read_offline_run(tmp_path / "other.wandb")


def test_format_table_flattens():
    text = format_table({"a": 1.23456, "b": {"c": [1, 2]}})
    assert "b.c" in text and "1.235" in text


def test_printed_summary_shows_one_line_of_phase_shares():
    summary = {
        "steps": 3,
        "phase_seconds": {
            "0:0": {"pipeline_1f1b": 3.0, "grad_allreduce": 1.0, "redundant_forward": 0.0},
            "1:0": {"pipeline_1f1b": 3.0, "grad_allreduce": 1.0, "redundant_forward": 0.0},
        },
    }
    printed = printed_summary(summary)
    assert printed == {"steps": 3, "phase_share": "pipeline_1f1b 75%, grad_allreduce 25%"}
    assert "phase_seconds" in summary and printed_summary({"steps": 3}) == {"steps": 3}

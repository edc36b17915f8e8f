"""RunRecorder writes the run dir's files and a real offline wandb run."""

import json

import pandas as pd
from omegaconf import OmegaConf

from oobleck.config import WandbConfig
from oobleck.metrics import RunRecorder, format_table


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


def test_offline_wandb_run(tmp_path):
    settings = OmegaConf.structured(WandbConfig(mode="offline", tags=["test"]))
    recorder = RunRecorder(tmp_path, {"model": {"name": "gpt3_tiny"}}, total_steps=1, wandb=settings, progress_bar=False)
    recorder.step(step=0, samples=8, samples_per_s=4.0, loss=5.5, generation=0, pipelines=1, attempts=1)
    recorder.event("reconfiguration", total_s=0.5)
    recorder.finish(steps=1)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_format_table_flattens():
    text = format_table({"a": 1.23456, "b": {"c": [1, 2]}})
    assert "b.c" in text and "1.235" in text

"""``python -m oobleck.plan`` in a subprocess: tables, plan.json, and one-line errors (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from oobleck.planning.outputs import ExecutionPlan
from oobleck.planning.synthetic import synthetic_profile
from oobleck.planning.templates import TemplateSet

pytestmark = pytest.mark.slow  # starts processes

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240  # a hang guard for the subprocess; no test relies on it


def run_plan(tmp_path: Path, *overrides: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "oobleck.plan", f"hydra.run.dir={tmp_path / 'run'}", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory) -> Path:
    # gpt3_tiny as the layered model sees it: 6 layers, profiled at job.microbatch_size=2.
    profile = synthetic_profile(
        6,
        seed=0,
        model="gpt3_tiny",
        microbatch_size=2,
        param_bytes=200_000,
        activation_bytes=100_000,
        output_bytes=10_000,
    )
    return profile.save(tmp_path_factory.mktemp("profile") / "tiny.json")


def _one_line_error(result: subprocess.CompletedProcess, text: str) -> None:
    """Exit status 2 and one error line naming the problem, the last thing printed (progress lines
    such as "planning: ..." may come before it), without a traceback."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("oobleck.plan: error:")]
    assert errors == lines[-1:] and (errors == [f"oobleck.plan: error: {text}"] or text in errors[0]), result.stderr


def test_plan_from_profile_file(tmp_path, tiny_profile):
    result = run_plan(tmp_path, "profile.source=file", f"profile.path={tiny_profile}", "cluster.nodes=5")
    assert result.returncode == 0, result.stderr
    assert "Templates" in result.stdout and "Plan" in result.stdout and "samples/s" in result.stdout
    document = json.loads((tmp_path / "run" / "plan.json").read_text())
    templates = TemplateSet.from_dict(document["templates"])
    plan = ExecutionPlan.from_dict(document["plan"])
    assert plan.nodes == (0, 1, 2, 3, 4) and len(plan.pipelines) >= 2
    assert sum(p.microbatches for p in plan.pipelines) == 16
    assert all(len(p.nodes) in templates.sizes for p in plan.pipelines)
    assert document["config"]["cluster"]["nodes"] == 5


def test_analytic_gpt3_6_7b_on_30_nodes(tmp_path):
    result = run_plan(
        tmp_path,
        "model=gpt3_6_7b",
        "cluster.nodes=30",
        "job.fault_tolerance=3",
        "profile.source=analytic",
        "cluster.gpus_per_node=4",
        "cluster.device_memory_gb=40",
        "job.microbatch_size=1",
        "job.global_batch_size=512",
    )
    assert result.returncode == 0, result.stderr
    plan = ExecutionPlan.from_dict(json.loads((tmp_path / "run" / "plan.json").read_text())["plan"])
    assert len(plan.pipelines) >= 4 and plan.nodes == tuple(range(30))


def test_a_measurement_this_cpu_cannot_finish_is_refused_before_it_starts(tmp_path):
    """The issue's command: measuring gpt3_6_7b here would take hours (or not fit): one line
    pointing at profile.source=analytic, exit 2, and nothing measured or cached."""
    cache = tmp_path / "cache"
    overrides = ("model=gpt3_6_7b", "cluster.nodes=64", "cluster.gpus_per_node=8", "job.fault_tolerance=3")
    result = run_plan(tmp_path, *overrides, env_extra={"OOBLECK_CACHE_DIR": str(cache)})
    _one_line_error(result, "measuring model=gpt3_6_7b on cpu")
    assert "use profile.source=analytic" in result.stderr
    assert not (cache / "profiles").exists() or not any((cache / "profiles").iterdir())
    assert not (tmp_path / "run" / "plan.json").exists()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["job.fault_tolerance=3", "cluster.device_memory_gb=0.0035"],
            "f=3 needs 4 pipelines of at least n0=2 nodes = 8 nodes; cluster.nodes=4",
        ),
        (["job.global_batch_size=33"], "is not divisible by job.microbatch_size=2"),
        (["job.global_batch_size=4", "job.fault_tolerance=2"], "fewer than the f+1=3 pipelines"),
    ],
    ids=["f-too-large", "batch-not-divisible", "too-few-microbatches"],
)
def test_bad_input_is_one_line(tmp_path, tiny_profile, overrides, message):
    result = run_plan(tmp_path, "profile.source=file", f"profile.path={tiny_profile}", *overrides)
    _one_line_error(result, message)


def test_one_microbatch_per_pipeline_plans(tmp_path, tiny_profile):
    # Issue 12: 5 nodes, f=0, global batch 2 (one microbatch) once raised "no combination ...".
    result = run_plan(
        tmp_path,
        "profile.source=file",
        f"profile.path={tiny_profile}",
        "cluster.nodes=5",
        "job.fault_tolerance=0",
        "job.global_batch_size=2",
    )
    assert result.returncode == 0, result.stderr
    plan = ExecutionPlan.from_dict(json.loads((tmp_path / "run" / "plan.json").read_text())["plan"])
    assert plan.nodes == (0, 1, 2, 3, 4) and sum(p.microbatches for p in plan.pipelines) == 1


def test_bad_profile_is_one_line(tmp_path):
    good = synthetic_profile(6, seed=0, model="gpt3_tiny", microbatch_size=2)
    data = good.to_dict()
    data["layers"][2]["forward_s"] = -1.0
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    result = run_plan(tmp_path, "profile.source=file", f"profile.path={path}")
    _one_line_error(result, "forward_s=-1.0 must be a positive number of seconds")


def test_the_template_search_says_how_far_it_has_come(tmp_path, tiny_profile):
    result = run_plan(
        tmp_path,
        "profile.source=file",
        f"profile.path={tiny_profile}",
        "cluster.nodes=5",
        "planner.progress_every_s=1e-9",  # every step of the search, for the test
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("planning: templates: ")]
    assert lines and all("node counts settled, candidate bottleneck" in line for line in lines), result.stderr

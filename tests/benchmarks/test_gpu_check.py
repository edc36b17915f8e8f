"""``benchmarks/gpu_check.py`` on a CPU: the report it writes, what it measures without CUDA, and the
comparisons its GPU figures rest on.

The script runs for real in a subprocess (quick mode, CUDA hidden so the CPU path runs on any
machine): every CUDA unit must be reported as skipped with its reason, and the units that are
meaningful on a CPU (the executor against the reference, the gloo generation lifecycle, executor
against plain-loop throughput) must carry real measurements.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from oobleck.models import load_model_config
from oobleck.profiling import analytic_profile, load_gpu_config, measure_profile
from oobleck.runtime.reference import train_reference
from testing import tiny_config

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
CUDA_UNITS = (
    "lifecycle.absent_peer_lazy_init",
    "lifecycle.absent_peer_eager_init",
    "lifecycle.absent_peer_nonblocking_init",
    "lifecycle.second_process_same_gpu",
)


@pytest.fixture(scope="module")
def gpu_check():
    """The script as a module (its dataclasses need it registered while it loads)."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["gpu_check"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "report.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the CPU path, also on a machine with a GPU
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"report: {out}" in done.stdout
    return json.loads(out.read_text())


def test_every_cuda_part_is_skipped_with_its_reason(report):
    assert report["meta"]["cuda_available"] is False and report["meta"]["settings"]["quick"] is True
    for entry in (report["exactness"], report["profile"], *(report["lifecycle"][u.split(".")[1]] for u in CUDA_UNITS)):
        assert entry["status"] == "skipped"
        assert entry["reason"].startswith("CUDA is not available here")


def test_the_executor_on_cpu_matches_the_reference_far_inside_the_gpu_tolerance(report):
    exact = report["exactness"]
    cpu = exact["cpu_executor"]
    assert cpu["within_tolerance"] is True
    # Only reduction order differs on the CPU: orders of magnitude below the GPU bounds.
    assert cpu["loss_max_rel_diff"] < exact["tolerance"]["loss_rtol"] / 100
    assert cpu["update_max_rel_diff"] < exact["tolerance"]["update_rtol"] / 100


def test_the_gloo_lifecycle_aborts_every_pending_op_and_leaks_nothing(report):
    loop = report["lifecycle"]["loop"]
    assert loop["status"] == "ok" and loop["backend"] == "gloo" and loop["cycles"] == 25
    assert loop["outcomes"] == {"aborted": 25}
    assert all(loop["checks"].values()) and loop["passed"] is True, loop["checks"]
    assert loop["threads"]["growth"] <= 0 and loop["fds"]["growth"] <= 0
    assert loop["parked_after_drain"] == 0
    assert len(loop["samples"]) == 25 and [s["generation"] for s in loop["samples"]] == list(range(1, 26))
    assert 0 < loop["abort_latency_s"]["max"] < loop["cycle_s"]["max"]


def test_throughput_compares_the_executor_with_the_plain_loop(report):
    tp = report["throughput"]
    assert tp["status"] == "ok" and tp["model"] == "gpt3_tiny"
    assert tp["executor_samples_per_s"] > 0 and tp["plain_samples_per_s"] > 0
    assert tp["ratio"] == pytest.approx(tp["executor_samples_per_s"] / tp["plain_samples_per_s"])


def test_the_update_tolerance_tells_a_dropped_microbatch_from_rounding(gpu_check):
    cfg = tiny_config(**{"job.steps": 3})
    reference = train_reference(cfg)
    initial = gpu_check.initial_state(cfg)
    same = gpu_check.differences(reference.losses, reference.layers, reference, initial)
    assert same["loss_max_rel_diff"] == 0 and same["update_max_rel_diff"] == 0 and same["within_tolerance"]
    # One microbatch of eight missing from every step: a bug the check must catch.
    short = train_reference(tiny_config(**{"job.steps": 3, "job.global_batch_size": 14}))
    bug = gpu_check.differences(short.losses, short.layers, reference, initial)
    assert not bug["within_tolerance"]
    assert bug["update_max_rel_diff"] > 10 * gpu_check.UPDATE_RTOL


def test_the_real_run_check_reads_a_run_dir_and_compares_it(gpu_check):
    """The check the GPU runs on ``python -m oobleck.run cluster.device=cuda``, here on the CPU."""
    run = gpu_check.oobleck_run_check(gpu_check.QUICK, "cpu")
    assert run["status"] == "ok", run
    assert run["steps"] == list(range(gpu_check.QUICK.exact_steps)) and run["strays_left"] == 0
    assert run["within_tolerance"] and run["loss_max_rel_diff"] < gpu_check.LOSS_RTOL / 100
    assert "cluster.device=cpu" in run["command"]


def test_the_implied_flop_fraction_reproduces_the_measured_time(gpu_check):
    model_cfg = load_model_config("gpt3_tiny")
    measured = measure_profile(model_cfg, 1, "cpu", warmup=0, repeats=1, seed=0, threads=1)
    h200 = load_gpu_config("h200")
    on_h200 = gpu_check.compare_profiles(model_cfg, h200, measured, analytic_profile(model_cfg, h200, 1))
    # gpt3_tiny is too narrow to be compute-bound on an H200: nothing to fit a FLOP fraction to.
    assert {row["analytic_bound"] for row in on_h200["layers"][1:]} == {"memory"}
    assert on_h200["implied_flop_fraction"] is None
    slow = load_gpu_config("h200")
    slow.peak_tflops = 0.01  # a GPU this slow makes every block and the head compute-bound
    table = gpu_check.compare_profiles(model_cfg, slow, measured, analytic_profile(model_cfg, slow, 1))
    rows = {row["layer"]: row for row in table["layers"]}
    assert list(rows) == ["embedding", "block0", "block1", "block2", "block3", "head"]
    assert rows["embedding"]["implied_flop_fraction"] is None
    fitted = [row for row in table["layers"] if row["analytic_bound"] == "compute"]
    assert [row["layer"] for row in fitted] == ["block0", "block1", "block2", "block3", "head"]
    for row in table["layers"]:
        assert row["ratio"] == pytest.approx(
            (row["measured_fwd_s"] + row["measured_bwd_s"]) / (row["analytic_fwd_s"] + row["analytic_bwd_s"])
        )
    for row in fitted:
        # With the implied fraction, the analytic compute time of the layer equals the measured time.
        assert row["implied_flop_fraction"] == pytest.approx(slow.achieved_flop_fraction / row["ratio"])
    assert table["implied_flop_fraction"] == pytest.approx(
        slow.achieved_flop_fraction
        * sum(r["analytic_fwd_s"] + r["analytic_bwd_s"] for r in fitted)
        / sum(r["measured_fwd_s"] + r["measured_bwd_s"] for r in fitted)
    )


def test_bad_arguments_are_one_clear_error(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--budget-s", "0", "--out", str(tmp_path / "r.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--budget-s=0.0 must be > 0" in done.stderr
    assert not (tmp_path / "r.json").exists()

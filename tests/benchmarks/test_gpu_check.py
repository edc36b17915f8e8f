"""``benchmarks/gpu_check.py`` rehearsed on a CPU: the report it writes, what it measures without CUDA,
the comparisons its GPU figures rest on, and ``gpu_report_to_conf.py`` on that report.

The script runs for real in a subprocess (quick mode, CUDA hidden so the CPU path runs on any
machine): every CUDA-only unit or part must be reported as skipped with its reason, and every unit
that runs on a CPU (the executor against the reference, a real recovery on gloo, per-layer
profiles, a restart's parts, the generation lifecycle, a peer's death, throughput) must carry real
measurements.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from oobleck.config import load_model_config
from oobleck.models import model_spec
from oobleck.profiling import analytic_profile, load_gpu_config, measure_profile
from oobleck.runtime.reference import train_reference
from testing import tiny_config

# The rehearsal runs every unit for real (processes, a recovery, restarts): minutes, not seconds.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
TO_CONF = REPO / "benchmarks" / "gpu_report_to_conf.py"
CUDA_UNITS = ("absent_peer_lazy_init", "absent_peer_eager_init", "absent_peer_nonblocking_init")
CPU = "CUDA is not available here"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses need it registered while it loads
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        yield _load("gpu_check", SCRIPT)
    finally:
        sys.modules.pop("gpu_check", None)
        sys.path.remove(str(SCRIPT.parent))


@pytest.fixture(scope="module")
def to_conf():
    try:
        yield _load("gpu_report_to_conf", TO_CONF)
    finally:
        sys.modules.pop("gpu_report_to_conf", None)


@pytest.fixture(scope="module")
def report_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "report.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the CPU path, also on a machine with a GPU
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"report: {out}" in done.stdout
    return out


@pytest.fixture(scope="module")
def report(report_path):
    return json.loads(report_path.read_text())


def test_every_cuda_part_is_skipped_with_its_reason(report):
    assert report["meta"]["cuda_available"] is False and report["meta"]["settings"]["quick"] is True
    for entry in (report["backends"], *(report["lifecycle"][unit] for unit in CUDA_UNITS)):
        assert entry["status"] == "skipped" and entry["reason"].startswith(CPU)
    for unit, parts in (
        ("exactness", {"cuda_executor", "cuda_plain_loop", "oobleck_run"}),
        ("restart", {"cuda_context_s", "group_init_s.nccl", "host_copy_gbps"}),
        ("profile", {"summary.achieved_flop_fraction_bf16_autocast"}),
    ):
        assert report[unit]["status"] == "ok" and set(report[unit]["skipped_parts"]) == parts
        assert all(CPU in reason for reason in report[unit]["skipped_parts"].values())


def test_the_executor_on_cpu_matches_the_reference_far_inside_the_gpu_tolerance(report):
    exact = report["exactness"]
    assert set(exact["models"]) == {"gpt3_tiny", "llama_tiny"}
    for entry in exact["models"].values():
        cpu = entry["cpu_executor"]
        assert cpu["within_tolerance"] is True
        # Only reduction order differs on the CPU: orders of magnitude below the GPU bounds.
        assert cpu["loss_max_rel_diff"] < exact["tolerance"]["loss_rtol"] / 100
        assert cpu["update_max_rel_diff"] < exact["tolerance"]["update_rtol"] / 100


def test_a_real_run_recovers_from_a_killed_node_and_matches_the_reference(report):
    recovery = report["recovery"]
    assert recovery["status"] == "ok" and recovery["passed"] is True
    assert recovery["device"] == "cpu" and recovery["backend"] == "gloo" and "CPU rehearsal" in recovery["backend_why"]
    run = recovery["run"]
    assert "model=llama_tiny" in run["command"] and "cluster.nodes=3" in run["command"]
    assert run["steps"] == list(range(6)) and run["strays_left"] == 0
    assert run["summary"]["recoveries"] == 1 and "reconfiguration" in run["events"]
    assert run["within_tolerance"] and run["loss_max_rel_diff"] < run["update_max_rel_diff"] + 1e-3


def test_per_layer_profiles_by_kind_pass_and_microbatch(report):
    profile = report["profile"]
    assert profile["status"] == "ok" and profile["peak_tflops"] > 0 and "CPU rehearsal" in profile["peak_source"]
    assert set(profile["models"]) == {"gpt3_tiny", "llama_tiny"} and profile["microbatch_sizes"] == [1, 2]
    for entry in profile["models"].values():
        assert entry["overrides"] == {"n_layer": 1}
        for b in ("1", "2"):
            table = entry["fp32"][b]
            assert [row["kind"] for row in table["layers"]] == ["embedding", "block", "head"]
            for row in table["layers"]:
                assert all(seconds >= 0 for seconds in row["measured_s"].values())
                assert row["measured_s"]["forward"] > 0 and row["measured_s"]["backward"] > 0
            embedding, block, head = table["layers"]
            assert embedding["measured_s"]["backward_input"] == 0  # token ids take no gradient
            for row in (block, head):
                assert all(row["fraction_of_peak"][p] > 0 for p in ("forward", "backward", "backward_input"))
            assert set(table["by_kind"]) == {"embedding", "block", "head"}
    assert profile["summary"]["achieved_flop_fraction_fp32"] > 0


def test_a_restarts_parts_are_measured(report):
    restart = report["restart"]
    assert restart["status"] == "ok" and restart["probes"] == 1  # one on a CPU (cpu_restart_probes)
    for key in ("process_start_s", "torch_import_s", "harness_import_s", "model_build_s"):
        assert restart[key] > 0, key
    assert restart["group_init_s"]["gloo"] > 0 and "nccl" not in restart["group_init_s"]
    arch = model_spec(load_model_config(restart["model"], **restart["overrides"]), 0).architecture
    assert restart["params"] == arch.total_params()
    # A shard per layer: its parameters (a tied weight in both layers that hold it) and two AdamW
    # moments in fp32, and a header of under 4 KiB.
    stored = sum(arch.params(i) for i in range(arch.num_layers))
    checkpoint = restart["checkpoint"]
    assert 12 * stored < checkpoint["bytes"] < 12 * stored + 4096 * arch.num_layers
    assert checkpoint["read_gbps"] > 0 and checkpoint["read_s"] > 0
    assert restart["model_init"]["s_per_gparam"] > 0
    first = restart["first_step"]
    assert first["first_s"] > 0 and first["steady_s"] > 0 and first["extra_s"] == first["first_s"] - first["steady_s"]


def test_the_gloo_lifecycle_aborts_every_pending_op_and_leaks_nothing(report):
    loop = report["lifecycle"]["loop"]
    assert loop["status"] == "ok" and loop["backend"] == "gloo" and loop["cycles"] == 25
    assert loop["outcomes"] == {"aborted": 25}
    assert all(loop["checks"].values()) and loop["passed"] is True, loop["checks"]
    assert loop["threads"]["growth"] <= 0 and loop["fds"]["growth"] <= 0
    assert loop["parked_after_drain"] == 0
    assert len(loop["samples"]) == 25 and [s["generation"] for s in loop["samples"]] == list(range(1, 26))
    assert 0 < loop["abort_latency_s"]["max"] < loop["cycle_s"]["max"]


def test_a_peers_death_to_a_usable_group(report):
    death = report["lifecycle"]["peer_death"]
    assert death["status"] == "ok" and death["passed"] is True and death["backend"] == "gloo"
    assert [r["rank"] for r in death["survivors"]] == [0, 1] and all(r["correct"] for r in death["survivors"])
    order = ("exit_seen", "abort_set", "survivors_aborted", "new_group_built", "usable_group")
    times = [death[f"kill_to_{stage}_s"] for stage in order]
    assert 0 < times[0] and times == sorted(times), dict(zip(order, times))


def test_throughput_compares_the_executor_with_the_plain_loop(report):
    tp = report["throughput"]
    assert tp["status"] == "ok" and tp["model"] == "gpt3_tiny"
    assert tp["executor_samples_per_s"] > 0 and tp["plain_samples_per_s"] > 0
    assert tp["ratio"] == pytest.approx(tp["executor_samples_per_s"] / tp["plain_samples_per_s"])


def test_the_update_tolerance_tells_a_dropped_microbatch_from_rounding(gpu_check):
    from gpu_check_units import common

    cfg = tiny_config(**{"job.steps": 3})
    reference = train_reference(cfg)
    initial = common.initial_state(cfg)
    same = common.differences(reference.losses, reference.layers, reference, initial)
    assert same["loss_max_rel_diff"] == 0 and same["update_max_rel_diff"] == 0 and same["within_tolerance"]
    # One microbatch of eight missing from every step: a bug the check must catch.
    short = train_reference(tiny_config(**{"job.steps": 3, "job.global_batch_size": 14}))
    bug = common.differences(short.losses, short.layers, reference, initial)
    assert not bug["within_tolerance"]
    assert bug["update_max_rel_diff"] > 10 * common.UPDATE_RTOL


@pytest.mark.parametrize("name", ["gpt3_tiny", "llama_tiny"])
def test_the_implied_flop_fraction_reproduces_the_measured_time(gpu_check, name):
    from gpu_check_units import layers

    model_cfg = load_model_config(name)
    measured = measure_profile(model_cfg, 1, "cpu", warmup=0, repeats=1, seed=0, threads=1)
    h200 = load_gpu_config("h200")
    peak = h200.peak_tflops * 1e12
    on_h200 = layers.compare(model_cfg, h200, peak, measured, analytic_profile(model_cfg, h200, 1))
    # The tiny models are too narrow to be compute-bound on an H200: nothing to fit a fraction to.
    assert {row["analytic_bound"] for row in on_h200["layers"]} == {"memory"}
    assert on_h200["implied_flop_fraction"] is None
    slow = load_gpu_config("h200")
    slow.peak_tflops = 0.01  # a GPU this slow makes every block and the head compute-bound
    peak = slow.peak_tflops * 1e12
    table = layers.compare(model_cfg, slow, peak, measured, analytic_profile(model_cfg, slow, 1))
    rows = {row["layer"]: row for row in table["layers"]}
    assert list(rows) == ["embedding", "block0", "block1", "block2", "block3", "head"]
    assert rows["embedding"]["implied_flop_fraction"] is None
    fitted = [row for row in table["layers"] if row["analytic_bound"] == "compute"]
    assert [row["layer"] for row in fitted] == ["block0", "block1", "block2", "block3", "head"]
    for row in fitted:
        # With the implied fraction, the analytic compute time of the layer equals the measured time.
        assert row["implied_flop_fraction"] == pytest.approx(slow.achieved_flop_fraction / row["ratio"])
    assert table["implied_flop_fraction"] == pytest.approx(
        slow.achieved_flop_fraction
        * sum(r["analytic_s"]["forward"] + r["analytic_s"]["backward"] for r in fitted)
        / sum(r["measured_s"]["forward"] + r["measured_s"]["backward"] for r in fitted)
    )


def test_the_report_goes_into_conf_as_measured_points(report_path, report, to_conf, tmp_path):
    refused = subprocess.run(
        [sys.executable, str(TO_CONF), str(report_path), "--out", str(tmp_path / "x.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "measured without CUDA" in refused.stderr and "--allow-cpu" in refused.stderr
    assert not (tmp_path / "x.yaml").exists()

    out = tmp_path / "cpu.yaml"
    done = subprocess.run(
        [sys.executable, str(TO_CONF), str(report_path), "--allow-cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    written = yaml.safe_load(out.read_text())
    assert written["source"]["device"] == "cpu (rehearsal)" and written["source"]["torch"] == report["meta"]["torch"]
    measured, missing = written["measured"], written["not_measured"]
    assert set(measured) | set(missing) == {row.key for row in to_conf.MAPPING}
    restart = report["restart"]
    assert measured["sim.costs.storage_read_gbps"]["value"] == restart["checkpoint"]["read_gbps"]
    assert measured["sim.costs.process_start_s"]["value"] == pytest.approx(
        restart["process_start_s"] + restart["torch_import_s"] + restart["harness_import_s"]
    )
    assert measured["sim.costs.restart_warmup_s"]["value"] == restart["first_step"]["extra_s"]
    reconfigure = report["lifecycle"]["peer_death"]["kill_to_usable_group_s"]
    assert measured["sim.costs.reconfigure_groups_s"]["value"] == reconfigure
    for key in ("cluster.gpu.achieved_flop_fraction", "sim.costs.cuda_context_s", "sim.costs.host_copy_gbps"):
        assert CPU in missing[key], missing[key]

    # A GPU's report (the rehearsal's, with what a GPU adds): every row is measured.
    gpu = copy.deepcopy(report)
    gpu["meta"].update(cuda_available=True, device="NVIDIA H200", driver="570.86.15", nccl="2.27.5")
    gpu["profile"]["summary"]["achieved_flop_fraction_bf16_autocast"] = 0.41
    gpu["restart"].update(cuda_context_s=0.3, host_copy_gbps=50.0)
    gpu["restart"]["group_init_s"]["nccl"] = 0.8
    for unit in ("restart", "profile"):
        del gpu[unit]["skipped_parts"]
    document = to_conf.measured_points(gpu, "gpu.json")
    assert document["not_measured"] == {} and document["source"]["driver"] == "570.86.15"
    assert document["measured"]["cluster.gpu.achieved_flop_fraction"]["value"] == 0.41
    assert to_conf.slug(document["source"]["device"]) == "nvidia_h200"
    # A unit that failed is named with its reason.
    gpu["restart"] = {"status": "timeout", "reason": "did not finish within its 150 s"}
    document = to_conf.measured_points(gpu, "gpu.json")
    assert "restart: timeout (did not finish within its 150 s)" in document["not_measured"]["sim.costs.host_copy_gbps"]


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

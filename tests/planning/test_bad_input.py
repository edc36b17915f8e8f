"""Bad planner input (issue 12): every case is one ConfigError/ProfileError naming the key or
field, the value and the fix, and through the CLI one line with exit status 2."""

from __future__ import annotations

import json

import pytest
from test_plan_cli import _one_line_error, run_plan

from oobleck.config import validate
from oobleck.errors import ConfigError, PlanningError, ProfileError
from oobleck.planning.inputs import ModelProfile
from oobleck.planning.instantiate import MAX_MICROBATCHES, instantiate
from oobleck.planning.synthetic import synthetic_profile

pytestmark = pytest.mark.slow  # starts processes


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            [f"job.global_batch_size={2**70}"],
            f"job.global_batch_size={2**70} / job.microbatch_size=2 = {2**69} microbatches per iteration, more than "
            f"the planner's {MAX_MICROBATCHES}; lower job.global_batch_size or raise job.microbatch_size",
        ),
        (
            ["cluster.intra_node_bandwidth_gbps=nan", "cluster.gpus_per_node=2"],
            "cluster.intra_node_bandwidth_gbps=nan must be a finite number of GB/s, at least 1e-09 (one byte per second)",
        ),
        (
            ["cluster.device_memory_gb=nan"],
            "cluster.device_memory_gb=nan must be a finite number of GB in (0, 9007199]",
        ),
        (
            ["cluster.device_memory_gb=1e30"],
            "cluster.device_memory_gb=1e+30 must be a finite number of GB in (0, 9007199]",
        ),
        (
            ["cluster.inter_node_bandwidth_gbps=1e-300"],
            "cluster.inter_node_bandwidth_gbps=1e-300 must be a finite number of GB/s, at least 1e-09 (one byte per second)",
        ),
        (["cluster.heartbeat_timeout_s=inf"], "cluster.heartbeat_timeout_s=inf must be a finite number > 0"),
        (["planner.replan_horizon_steps=-1"], "planner.replan_horizon_steps=-1 must be >= 0"),
    ],
    ids=["batch-2**70", "bandwidth-nan", "memory-nan", "memory-1e30", "bandwidth-1e-300", "timeout-inf", "horizon"],
)
def test_bad_values_are_one_clear_error(make_config, overrides, message):
    with pytest.raises(ConfigError) as error:
        validate(make_config(*overrides))
    assert str(error.value) == message


def test_the_horizon_default_is_the_configured_one(make_config):
    from oobleck.planning.reconfigure import DEFAULT_REPLAN_HORIZON_STEPS

    assert make_config().planner.replan_horizon_steps == DEFAULT_REPLAN_HORIZON_STEPS


def test_the_planner_refuses_more_microbatches_than_it_counts():
    from test_instantiate import hand_templates

    with pytest.raises(PlanningError, match="more than the planner's 536870912"):
        instantiate(hand_templates({1: [1.0]}), [0], 2**70, 1, 0)


def _profile_dict():
    return synthetic_profile(6, seed=0, model="gpt3_tiny", microbatch_size=2).to_dict()


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("forward_s", True, "layer 2 (block2): forward_s=True must be a positive number of seconds (at most 86400)"),
        (
            "backward_s",
            1e300,
            "layer 2 (block2): backward_s=1e+300 must be a positive number of seconds (at most 86400)",
        ),
        (
            "param_bytes",
            10**30,
            f"layer 2 (block2): param_bytes={10**30} must be a non-negative integer of at most 2**53 bytes",
        ),
        (
            "output_bytes",
            True,
            "layer 2 (block2): output_bytes=True must be a non-negative integer of at most 2**53 bytes",
        ),
        ("activation_bytes", 1.5, "layer 2 (block2): activation_bytes=1.5 must be a non-negative integer"),
    ],
    ids=["forward-true", "backward-1e300", "bytes-1e30", "bytes-true", "bytes-float"],
)
def test_bad_profile_values(tmp_path, field, value, message):
    data = _profile_dict()
    data["layers"][2][field] = value
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError) as error:
        ModelProfile.load(path)
    assert str(error.value).startswith(f"{path}: {message}")


def test_profile_files_that_are_not_profiles(tmp_path):
    with pytest.raises(ProfileError) as error:
        ModelProfile.load(tmp_path)
    assert (
        str(error.value)
        == f"profile path {tmp_path} is a directory; give the profile JSON file written by python -m oobleck.profile"
    )
    latin = tmp_path / "latin1.json"
    latin.write_bytes(json.dumps(_profile_dict()).replace("gpt3_tiny", "gpt3_tiny\u00e9").encode("latin-1"))
    with pytest.raises(ProfileError, match=r"latin1.json: not UTF-8 text \(byte \d+\), so not a profile JSON"):
        ModelProfile.load(latin)
    data = _profile_dict()
    data["microbatch_size"] = True
    boolean = tmp_path / "boolean.json"
    boolean.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="microbatch_size=True must be a positive integer"):
        ModelProfile.load(boolean)


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "job.fault_tolerance=1.5",
            "job.fault_tolerance=1.5: Value '1.5' of type 'float' could not be converted to Integer; "
            "set job.fault_tolerance=<int> (python -m oobleck.plan --cfg job shows every key)",
        ),
        (
            "cluster.nodes=abc",
            "cluster.nodes=abc: Value 'abc' of type 'str' could not be converted to Integer; "
            "set cluster.nodes=<int> (python -m oobleck.plan --cfg job shows every key)",
        ),
        (
            "model=nosuch",
            "Could not find 'model/nosuch'; Available options in 'model': bert_large, gpt2_medium, gpt2_small, gpt3_1_3b,",
        ),
    ],
    ids=["float-for-int", "text-for-int", "missing-option"],
)
def test_hydra_errors_are_one_line(tmp_path, override, message):
    _one_line_error(run_plan(tmp_path, override), message)


def test_non_utf8_profile_through_the_cli(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes(b"\xff\xfe{}")
    _one_line_error(
        run_plan(tmp_path, "profile.source=file", f"profile.path={path}"), f"{path}: not UTF-8 text (byte 0)"
    )

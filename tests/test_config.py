"""The config tree composes, types are enforced and bad values get one clear message."""

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from oobleck.config import from_container, to_container, validate
from oobleck.errors import ConfigError

MODELS = ["gpt3_tiny", "gpt2_small", "gpt3_medium", "gpt3_1_3b", "gpt3_2_7b", "gpt3_6_7b"]


@pytest.mark.parametrize("model", MODELS)
def test_every_model_composes_and_validates(make_config, model):
    cfg = make_config(f"model={model}")
    validate(cfg)
    assert cfg.model.name == model


@pytest.mark.parametrize("group", ["failures=none", "failures=explicit", "failures=poisson", "failures=trace", "cluster=slurm"])
def test_groups_compose(make_config, group):
    validate(make_config(group))


def test_round_trip_through_plain_dict(make_config):
    cfg = make_config("job.steps=7", "failures=explicit")
    again = from_container(to_container(cfg))
    assert again.job.steps == 7 and again.failures.events[0].action == "remove"


def test_unknown_key_and_wrong_type_are_rejected(make_config):
    with pytest.raises(ConfigCompositionException):
        make_config("job.stepz=3")
    with pytest.raises((ConfigCompositionException, ValidationError)):
        make_config("job.steps=many")


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["job.global_batch_size=30", "job.microbatch_size=4"], "not divisible by job.microbatch_size=4"),
        (["job.global_batch_size=4", "job.microbatch_size=2", "job.fault_tolerance=2"], "fewer than the f+1=3 pipelines"),
        (["cluster.device=tpu"], "cluster.device='tpu' is not one of cpu, cuda"),
        (["cluster.nodes=0"], "cluster.nodes=0 must be > 0"),
        (["model.n_head=5"], "not divisible by model.n_head=5"),
        (["job.fault_tolerance=-1"], "job.fault_tolerance=-1 must be >= 0"),
        (["profile.source=file"], "needs profile.path"),
        (["failures=explicit", "failures.events=[{action:remove,count:1}]"], "exactly one of step"),
        (["failures=explicit", "failures.events=[{action:explode,step:1,count:1}]"], "action='explode'"),
        (["logger.wandb.mode=sometimes"], "logger.wandb.mode"),
    ],
)
def test_bad_values_name_the_key(make_config, overrides, needle):
    with pytest.raises(ConfigError, match=None) as error:
        validate(make_config(*overrides))
    assert needle in str(error.value)

"""The checkpoint: config group, job.resume, and their validation; when a checkpoint is due."""

import pytest
from omegaconf import OmegaConf

from oobleck.checkpoint import checkpoint_due, checkpoint_root, checkpoints_enabled
from oobleck.config import validate
from oobleck.errors import ConfigError


def test_groups_compose(make_config):
    cfg = make_config()
    validate(cfg)
    assert cfg.checkpoint.every_steps == 10 and cfg.checkpoint.async_write and cfg.job.resume is None
    off = make_config("checkpoint=none", "job.resume=auto", "checkpoint.dir=/shared/ckpt")
    validate(off)
    assert not checkpoints_enabled(off.checkpoint) and off.job.resume == "auto"
    assert str(checkpoint_root(off.checkpoint.dir, "/run")) == "/shared/ckpt"
    assert str(checkpoint_root(cfg.checkpoint.dir, "/run")) == "/run/checkpoints"


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("checkpoint.every_steps=-1", "checkpoint.every_steps=-1 must be >= 0"),
        ("checkpoint.every_s=0", "checkpoint.every_s=0.0 must be > 0"),
        ("checkpoint.keep=0", "checkpoint.keep=0 must be >= 1"),
        ("checkpoint.io_threads=0", "checkpoint.io_threads=0 must be > 0"),
        ("checkpoint.max_pending=0", "checkpoint.max_pending=0 must be > 0"),
        ("checkpoint.write_timeout_s=0", "checkpoint.write_timeout_s=0.0 must be > 0"),
        ("checkpoint.dir=''", "checkpoint.dir='' is empty"),
        ("job.resume=''", "job.resume='' is empty"),
    ],
)
def test_bad_values_name_the_key(make_config, override, needle):
    with pytest.raises(ConfigError) as error:
        validate(make_config(override))
    assert needle in str(error.value)


def test_when_a_checkpoint_is_due():
    steps = OmegaConf.create({"every_steps": 10, "every_s": None})
    assert [s for s in range(0, 41) if checkpoint_due(steps, s, 0.0)] == [10, 20, 30, 40]
    timed = OmegaConf.create({"every_steps": 0, "every_s": 30.0})
    assert checkpoints_enabled(timed) and not checkpoint_due(timed, 3, 29.9) and checkpoint_due(timed, 3, 30.0)
    assert not checkpoint_due(timed, 0, 100.0)  # nothing committed yet: nothing to save

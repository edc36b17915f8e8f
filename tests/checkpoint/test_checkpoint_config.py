"""The checkpoint: config group, job.resume, and their validation; when a checkpoint is due."""

import pytest

from oobleck.checkpoint import checkpoint_root
from oobleck.config import validate
from oobleck.errors import ConfigError
from oobleck.strategy import checkpoint_every_steps


def test_groups_compose(make_config):
    cfg = make_config()
    validate(cfg)
    # By default each strategy checkpoints at its own interval; checkpoint.every_steps overrides it.
    assert cfg.checkpoint.every_steps is None and cfg.checkpoint.async_write and cfg.job.resume is None
    assert checkpoint_every_steps(cfg) == 0  # oobleck: in-place recovery needs none
    assert checkpoint_every_steps(make_config("strategy=varuna")) == 10
    assert checkpoint_every_steps(make_config("strategy=varuna", "checkpoint.every_steps=3")) == 3
    off = make_config("checkpoint=none", "job.resume=auto", "checkpoint.dir=/shared/ckpt")
    validate(off)
    assert checkpoint_every_steps(off) == 0 and off.job.resume == "auto"
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

"""job.resume picks the right checkpoint, and a checkpoint of a different setup is one clear error."""

import pytest
from ckpthelpers import save

from oobleck.checkpoint import check_fingerprint, fingerprint, resolve_resume, resume_checkpoint
from oobleck.errors import ConfigError
from testing import tiny_config


def test_fingerprint_names_every_difference_with_both_values_and_the_fix(cfg):
    other = tiny_config(**{"model.n_layer": 6, "job.global_batch_size": 32, "job.lr": 1e-3})
    with pytest.raises(ConfigError) as error:
        check_fingerprint(fingerprint(cfg), fingerprint(other), source="/runs/a/checkpoints/step-00000010")
    message = str(error.value)
    assert message.count("\n") == 0 and "cannot resume from /runs/a/checkpoints/step-00000010" in message
    for needle in (
        "model.n_layer=4 in the checkpoint, 6 now",
        "job.global_batch_size=16 in the checkpoint, 32 now",
        "job.lr=0.0003 in the checkpoint, 0.001 now",
    ):
        assert needle in message
    assert "Resume with the checkpoint's settings (job.global_batch_size=16 job.lr=0.0003 model.n_layer=4)" in message
    assert "job.resume=null" in message


def test_layout_settings_may_differ_and_data_is_identified(cfg, tmp_path):
    free = tiny_config(
        **{"job.microbatch_size": 4, "cluster.nodes": 7, "job.fault_tolerance": 2, "strategy.name": "varuna"}
    )
    check_fingerprint(fingerprint(cfg), fingerprint(free))  # no error
    assert fingerprint(cfg)["data.corpus_sha256"] and "job.synthetic_samples" not in fingerprint(cfg)
    synthetic = tiny_config(**{"job.dataset": "synthetic", "job.synthetic_samples": 64})
    assert fingerprint(synthetic)["job.synthetic_samples"] == 64 and "data.corpus" not in fingerprint(synthetic)
    changed = tmp_path / "python_reference.txt"
    changed.write_text("another corpus")
    with pytest.raises(
        ConfigError,
        match=r"data.corpus_bytes=.*data.corpus_sha256=.*\(data.\* identify the shipped corpus file, which changed\)",
    ):
        check_fingerprint(fingerprint(cfg), fingerprint(cfg, corpus_path=changed))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, cfg, layers):
    """A run dir with checkpoints at steps 2 and 4 in <run dir>/checkpoints, step 4 corrupt."""
    run = tmp_path_factory.mktemp("run")
    save(run / "checkpoints", 2, layers, cfg)
    newest = save(run / "checkpoints", 4, layers, cfg)
    (newest / "layer-0001.shard").write_bytes(b"torn")
    return run


def test_null_means_fresh_and_auto_finds_the_newest_valid(run_dir, tmp_path, cfg):
    assert resolve_resume(None, run_dir) is None
    found = resolve_resume("auto", run_dir)
    assert found.step == 2 and found.skipped[0].step_dir.name == "step-00000004"
    assert resolve_resume("auto", tmp_path) is None  # first launch of a requeueable job
    assert resolve_resume("auto", tmp_path, run_dir / "checkpoints").step == 2  # checkpoint.dir wins
    assert resume_checkpoint(tiny_config(**{"job.resume": "auto"}), run_dir).step == 2


def test_explicit_paths(run_dir, tmp_path):
    assert resolve_resume(str(run_dir / "checkpoints" / "step-00000002"), tmp_path).step == 2
    assert resolve_resume(str(run_dir / "checkpoints"), tmp_path).step == 2
    with pytest.raises(
        ConfigError,
        match=r"job.resume='.*step-00000004': .* is not a valid checkpoint: layer-0001.shard \(layer 1\) is 4 bytes",
    ):
        resolve_resume(str(run_dir / "checkpoints" / "step-00000004"), tmp_path)
    with pytest.raises(ConfigError, match=r"job.resume='.*nowhere': .*nowhere does not exist"):
        resolve_resume(str(tmp_path / "nowhere"), tmp_path)
    with pytest.raises(ConfigError, match="holds no valid checkpoint \\(it holds no step-NNNNNNNN directories\\)"):
        resolve_resume(str(tmp_path), tmp_path)


def test_a_checkpoint_of_another_setup_is_refused(run_dir):
    other = tiny_config(**{"job.resume": "auto", "job.seed": 5})
    with pytest.raises(ConfigError, match=r"cannot resume from .*step-00000002: .*job.seed=0 in the checkpoint, 5 now"):
        resume_checkpoint(other, run_dir)

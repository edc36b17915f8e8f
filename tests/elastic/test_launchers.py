"""Launchers chosen by ``cluster._target_``: which class a cluster names, the errors for a bad one,
and the answers the class gives about where nodes run (no processes start here)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from oobleck.config import from_container, to_container, validate
from oobleck.elastic.job import check_device
from oobleck.elastic.local import LocalLauncher
from oobleck.elastic.slurm import SlurmLauncher
from oobleck.errors import ConfigError, RunError
from oobleck.launcher import Launcher, launcher_class

pytestmark = pytest.mark.slow  # starts processes


@pytest.mark.parametrize(("group", "cls"), [("cluster=local", LocalLauncher), ("cluster=slurm", SlurmLauncher)])
def test_each_cluster_file_names_its_launcher(make_config, group, cls):
    cluster = make_config(group).cluster
    assert launcher_class(cluster) is cls and cls.kind == cluster.kind


def test_a_cluster_without_a_target_gets_the_launcher_of_its_kind(make_config):
    data = to_container(make_config("cluster=slurm"))
    del data["cluster"]["_target_"]  # a cluster file of the user's own, or an older run dir's config
    cfg = from_container(data)
    assert OmegaConf.is_missing(cfg.cluster, "_target_")
    assert launcher_class(cfg.cluster) is SlurmLauncher
    validate(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["cluster._target_=oobleck.elastic.local.Nowhere"],
            "cluster._target_=oobleck.elastic.local.Nowhere cannot be",
        ),
        (["cluster._target_=oobleck.strategy.Strategy"], "is not an oobleck.launcher.Launcher subclass"),
        (
            ["cluster.kind=slurm"],
            "cluster.kind=slurm but cluster._target_=oobleck.elastic.local.LocalLauncher launches local clusters",
        ),
        (["cluster=slurm", "cluster.fork_workers=true"], "cluster.fork_workers=true needs cluster.kind=local"),
    ],
)
def test_a_bad_launcher_is_one_clear_error(make_config, overrides, message):
    with pytest.raises(ConfigError) as error:
        validate(make_config(*overrides))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_kind_without_a_launcher_is_one_clear_error(make_config):
    data = to_container(make_config())
    del data["cluster"]["_target_"]
    data["cluster"]["kind"] = "k8s"
    with pytest.raises(ConfigError, match="cluster.kind='k8s' has no launcher: conf/cluster/<name>.yaml must name"):
        validate(from_container(data))


def test_the_launcher_answers_where_nodes_run(make_config):
    local = make_config().cluster
    assert LocalLauncher.single_machine and not SlurmLauncher.single_machine
    assert LocalLauncher.worker_address(local, 2) == local.master_addr
    spread = make_config("cluster.node_address_base=127.0.1.0").cluster
    assert LocalLauncher.worker_address(spread, 2) == "127.0.1.2"
    assert LocalLauncher.forks_workers(local) and not LocalLauncher.forks_workers(
        make_config("cluster.device=cuda").cluster
    )
    slurm = make_config("cluster=slurm").cluster
    assert SlurmLauncher.worker_address(slurm, 2) == "" and not SlurmLauncher.forks_workers(slurm)
    assert Launcher.forks_workers(slurm) is False


def test_cuda_is_refused_where_the_launcher_runs_the_controller(make_config):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RunError, match="CUDA is not available on this machine; use cluster.device=cpu"):
        check_device(make_config("cluster.device=cuda"))
    with pytest.raises(RunError, match="on this allocation's first node; request GPUs with sbatch --gpus-per-node"):
        check_device(make_config("cluster=slurm"))
    check_device(make_config())  # cpu: nothing to check


def test_a_slurm_launcher_outside_an_allocation_is_one_clear_error(make_config):
    cluster = make_config("cluster=slurm").cluster
    with pytest.raises(RunError, match="cluster=slurm must run inside a Slurm allocation") as error:
        SlurmLauncher(cluster, "127.0.0.1:1", "run", job_environ={})
    assert "sbatch slurm/run.sbatch" in str(error.value) and "cluster=local" in str(error.value)
    assert "cluster.kind" not in str(error.value)  # cluster=<name> is the override that chooses it
    with pytest.raises(RunError, match="inside a Slurm allocation"):
        SlurmLauncher.check_environment(cluster, {})

"""The config tree composes, types are enforced and bad values get one clear message."""

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from oobleck.config import compose_config, from_container, to_container, validate
from oobleck.errors import ConfigError

MODELS = ["gpt3_tiny", "gpt2_small", "gpt3_medium", "gpt3_1_3b", "gpt3_2_7b", "gpt3_6_7b"]


@pytest.mark.parametrize("model", MODELS)
def test_every_model_composes_and_validates(make_config, model):
    cfg = make_config(f"model={model}")
    validate(cfg)
    assert cfg.model.name == model


@pytest.mark.parametrize(
    "group", ["failures=none", "failures=demo", "failures=poisson", "failures=trace", "cluster=slurm"]
)
def test_groups_compose(make_config, group):
    validate(make_config(group))


def test_round_trip_through_plain_dict(make_config):
    cfg = make_config("job.steps=7", "failures=demo")
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
        (
            ["job.global_batch_size=4", "job.microbatch_size=2", "job.fault_tolerance=2"],
            "fewer than the f+1=3 pipelines",
        ),
        (["cluster.device=tpu"], "cluster.device='tpu' is not one of cpu, cuda"),
        (["cluster.backend=mpi"], "cluster.backend='mpi' is not one of auto, nccl, gloo"),
        (["cluster.backend=nccl"], "cluster.backend=nccl needs cluster.device=cuda (got cpu)"),
        (["model=llama_tiny", "model.n_kv_head=3"], "model.n_head=4 is not a multiple of model.n_kv_head=3"),
        (["cluster.nodes=0"], "cluster.nodes=0 must be > 0"),
        (["cluster.failure_settle_s=-1"], "cluster.failure_settle_s=-1.0 must be >= 0"),
        (["model.n_head=5"], "not divisible by model.n_head=5"),
        (["job.fault_tolerance=-1"], "job.fault_tolerance=-1 must be >= 0"),
        (["profile.source=file"], "needs profile.path"),
        (["profile.split_backward_max_ratio=0"], "profile.split_backward_max_ratio=0.0 must be > 0"),
        (["planner.replan_horizon=never"], "planner.replan_horizon='never' is not one of schedule, fixed"),
        (["runtime.bucket_mb=0"], "runtime.bucket_mb=0"),
        (["sim.trace_starts=0"], "sim.trace_starts=0 must be an integer >= 1"),
        (["gpu=a100_40gb", "cluster.gpu.achieved_flop_fraction=1.5"], "cluster.gpu.achieved_flop_fraction=1.5"),
        (["failures=explicit", "failures.events=[{action:remove,count:1}]"], "exactly one of step"),
        (["failures=explicit", "failures.events=[{action:explode,step:1,count:1}]"], "action='explode'"),
        (["logger.wandb.mode=sometimes"], "logger.wandb.mode"),
        (["cluster=slurm", "cluster.fork_workers=true"], "cluster.fork_workers=true needs cluster.kind=local"),
        (
            ["cluster=slurm", "cluster.node_address_base=127.0.1.0"],
            "cluster.node_address_base=127.0.1.0 needs cluster.kind=local",
        ),
        (["cluster.node_address_base=node-0"], "does not give node 0 an IPv4 address"),
        (["cluster.node_address_base=127.0.1.300"], "does not give node 0 an IPv4 address"),
    ],
)
def test_bad_values_name_the_key(make_config, overrides, needle):
    with pytest.raises(ConfigError, match=None) as error:
        validate(make_config(*overrides))
    assert needle in str(error.value)


# ---------------------------------------------------------------- one source of truth (issue 14)


def _schema_defaults(schema, prefix=""):
    """(key, default) of every field of a schema dataclass and its nested sections."""
    import dataclasses

    for f in dataclasses.fields(schema):
        if f.default_factory is not dataclasses.MISSING:
            nested = f.default_factory
            assert dataclasses.is_dataclass(nested), (
                f"{prefix}{f.name}: a default_factory must only type a nested section"
            )
            yield from _schema_defaults(nested, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f.default


def test_the_schema_holds_types_not_values():
    from omegaconf import MISSING

    from oobleck.config import Config

    valued = {key: value for key, value in _schema_defaults(Config) if value is not MISSING}
    assert valued == {}, f"schema defaults that belong in conf/: {valued}"


@pytest.mark.parametrize(
    "choices",
    [
        (),
        ("cluster=slurm",),
        ("failures=none",),
        ("failures=poisson",),
        ("failures=trace",),
        ("checkpoint=none",),
        ("experiment=paper_spot",),
        ("experiment=paper_failure_frequency",),
        ("gpu=h200", "strategy=bamboo"),
    ],
)
def test_the_yaml_gives_every_value(make_config, choices):
    from omegaconf import OmegaConf

    cfg = make_config(*choices)
    assert OmegaConf.missing_keys(cfg) == set()
    validate(cfg)


def test_outside_hydra_a_group_is_what_hydra_composes(make_config):
    from oobleck.config import load_model_config, model_names
    from oobleck.profiling import gpu_names, load_gpu_config

    for name in model_names():
        assert load_model_config(name) == make_config(f"model={name}").model
    for name in gpu_names():
        assert load_gpu_config(name) == make_config(f"gpu={name}").cluster.gpu


@pytest.mark.parametrize(
    ("gpu", "memory_gb"), [("a100_40gb", 40.0), ("a100_80gb", 80.0), ("h100_80gb", 80.0), ("h200", 141.0)]
)
def test_gpu_sets_the_device_memory_the_planner_uses(make_config, gpu, memory_gb):
    from oobleck.planning.inputs import ClusterSpec

    for cluster in ("cluster=local", "cluster=slurm"):
        cfg = make_config(cluster, f"gpu={gpu}")
        assert ClusterSpec.from_config(cfg.cluster).device_memory_bytes == memory_gb * 1e9
    assert (
        make_config(f"gpu={gpu}", "cluster.device_memory_gb=3").cluster.device_memory_gb == 3.0
    )  # a budget of one's own


def test_slurm_reads_gpus_per_node_from_the_allocation(make_config, monkeypatch):
    monkeypatch.delenv("SLURM_GPUS_ON_NODE", raising=False)
    assert make_config("cluster=slurm").cluster.gpus_per_node == 1
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    assert make_config("cluster=slurm").cluster.gpus_per_node == 4
    assert make_config("cluster=slurm", "cluster.gpus_per_node=2").cluster.gpus_per_node == 2


def test_caches_and_outputs_live_under_paths(make_config, monkeypatch, tmp_path):
    from omegaconf import OmegaConf

    monkeypatch.setenv("OOBLECK_CACHE_DIR", str(tmp_path / "cache"))
    assert make_config().profile.cache_dir == f"{tmp_path / 'cache'}/profiles"
    monkeypatch.delenv("OOBLECK_CACHE_DIR")
    assert make_config().profile.cache_dir == "~/.cache/oobleck/profiles"
    hydra = compose_config(
        f"paths.output_dir={tmp_path}/out", f"paths.multirun_dir={tmp_path}/multi", return_hydra_config=True
    ).hydra
    hydra = OmegaConf.to_container(hydra, resolve=False)  # ${now:...} resolves only in a running app
    assert hydra["run"]["dir"].startswith("${paths.output_dir}/") and hydra["sweep"]["dir"].startswith(
        "${paths.multirun_dir}/"
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+job.stpes=3"], "job.stpes is not a config key; did you mean job.steps?"),
        (["+job.foo=1"], "job.foo is not a config key; job has: fault_tolerance, global_batch_size"),
        (
            ["failures=demo", "+failures.events.0.phse=forward"],
            "failures.events[0].phse is not a config key; did you mean failures.events[0].phase?",
        ),
        (
            ["+strategy.checkpoint_every_step=3"],
            "strategy.checkpoint_every_step is not a config key; did you mean strategy.checkpoint_every_steps?",
        ),
        (
            ["+sim.params.varuna.morph_on_joins=false"],
            "sim.params.varuna.morph_on_joins is not a config key; did you mean sim.params.varuna.morph_on_join?",
        ),
        (
            ["+sim.params.bambo.failover_slowdown=1.5"],
            "sim.params.bambo is not a config key; did you mean sim.params.bamboo?",
        ),
    ],
)
def test_keys_the_schema_does_not_know_are_refused(make_config, overrides, message):
    with pytest.raises(ConfigError) as error:
        validate(make_config(*overrides))
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(("preset", "gpus"), [("slurm_cpu", None), ("slurm_gpu", 1)])
def test_slurm_launcher_presets_compose(preset, gpus):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[slurm]'")
    launcher = compose_config(f"hydra/launcher={preset}", return_hydra_config=True).hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.gpus_per_node == gpus
    assert launcher.timeout_min > 0 and launcher.nodes == 1


def test_a_worker_reads_its_config_without_importing_hydra():
    # Hydra is about 0.2 s of every worker's start: a worker rebuilds its config with
    # from_container, and only the entry points and compose_config register the schema.
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import oobleck.runtime.worker\n"
        "from oobleck.config import from_container\n"
        "assert from_container({'job': {'steps': 3}}).job.steps == 3\n"
        "hydra = sorted(m for m in sys.modules if m.split('.')[0] == 'hydra')\n"
        "assert not hydra, f'the worker imported {hydra}'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr

"""The experiment at today's scale: its trace at a published failure rate, its models, its wiring."""

from __future__ import annotations

import re

import pytest

from oobleck.faults.trace import load_trace, resolve_trace
from oobleck.sim.failure_model import LLAMA3_PER_GPU_HOUR, poisson_trace_text

TRACE = "synthetic/llama3_rate_1024x8_7d"


def test_the_shipped_trace_is_its_generator_at_the_llama3_rate():
    # 419 unexpected interruptions in 54 days on 16,384 H100s (Llama 3 report, Table 5).
    assert LLAMA3_PER_GPU_HOUR == pytest.approx(419 / (54 * 24 * 16384))
    text = resolve_trace(TRACE).read_text()
    found = dict(re.findall(r"(\w+)=([\d.]+)", "".join(line for line in text.splitlines() if line.startswith("#"))))
    regenerated = poisson_trace_text(
        int(found["nodes"]),
        int(found["gpus_per_node"]),
        float(found["duration_h"]),
        float(found["repair_h"]),
        int(found["seed"]),
    )
    assert text == regenerated
    trace = load_trace(TRACE)
    assert trace.max_nodes() == 1024 and (trace.end_ms - trace.start_ms) / 3.6e6 == pytest.approx(168, rel=0.05)
    # About one interruption every 6.2 h on 1,024 x 8 GPUs; every failed node comes back 2 h later
    # (unless the trace ends first).
    assert 15 <= trace.removals() <= 40
    removed = [(e.time_ms, e.node) for e in trace.events if e.kind.name == "REMOVE"]
    added = {(e.time_ms, e.node) for e in trace.events if e.kind.name == "JOIN" and e.time_ms > 0}
    assert all((t + 7_200_000, node) in added for t, node in removed if t + 7_200_000 < trace.end_ms)
    assert len(added) >= len(removed) - 1


def test_a_trace_is_deterministic_and_its_bad_arguments_are_named():
    assert poisson_trace_text(8, 8, 24, 1, seed=3) == poisson_trace_text(8, 8, 24, 1, seed=3)
    assert poisson_trace_text(8, 8, 24, 1, seed=3) != poisson_trace_text(8, 8, 24, 1, seed=4)
    with pytest.raises(ValueError, match="nodes=1 \\(>= 2\\)"):
        poisson_trace_text(1, 8, 24, 1, seed=0)


def test_todays_scale_composes_with_models_of_llama3_sizes(make_config):
    from oobleck.config import load_model_config, validate
    from oobleck.models import num_layers, parameter_count

    cfg = make_config("experiment=today_scale")
    validate(cfg)
    assert cfg.sim.strategies == ["oobleck", "varuna", "bamboo", "torchft"]
    assert (cfg.cluster.gpus_per_node, cfg.cluster.gpu.name, cfg.sim.testbed) == (8, "H100-80GB", "h100_cluster")
    assert load_trace(cfg.sim.traces[0]).max_nodes() == 1024
    for name, size in (("gpt_70b", 70.6e9), ("gpt_405b", 405e9)):
        model = load_model_config(name)
        unique = sum(parameter_count(model, i) for i in range(num_layers(model))) - model.vocab_size * model.n_embd
        assert unique == pytest.approx(size, rel=0.1), name


def test_todays_scale_runs_every_strategy(make_config, tmp_path):
    """The same experiment on a small trace and model (the 1,024-node planner run takes minutes
    until template generation is fast at that scale): every strategy gets its row, and torchft,
    one replica group of one GPU per node, says it does not run on nodes of 8 GPUs."""
    from oobleck.sim.experiment import run_experiment

    trace = tmp_path / "small.csv"
    trace.write_text(poisson_trace_text(12, 8, 48, 2, seed=0, per_gpu_hour=1e-3))
    cfg = make_config(
        "experiment=today_scale",
        "sim.models=[gpt3_1_3b]",
        f"sim.traces=[{trace}]",
        "sim.band_samples=1",
        "sim.duration_h=48",
    )
    result = run_experiment(cfg)
    assert set(result.summary["strategy"]) == {"oobleck", "varuna", "bamboo", "torchft"}
    ratios = result.ratios.set_index("baseline")
    assert ratios.loc["torchft", "note"] == "does not run" and ratios.loc["varuna", "ratio_median"] > 0
    assert result.summary.set_index("strategy").loc["oobleck", "n_failure"] == load_trace(str(trace)).removals()

"""Bamboo's redundancy modes in its policy: memory, time, plans, failover reports, rebalance.

A 12-layer synthetic model on 8 one-device nodes, depth 4 (two pipelines). Lazy (Bamboo's
default) keeps the successor's copy in host memory and runs no redundant forward; eager runs it
before each wait for gradients and keeps its outputs on the device; inline runs it on the
critical path. Real runs of each mode: tests/elastic/test_bamboo_modes.py.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from baselines.bamboo.config import FAILED
from baselines.bamboo.memory import failover_extra_seconds, stage_memory
from oobleck.config import CONF_DIR
from oobleck.errors import ConfigError
from oobleck.planning.inputs import ClusterSpec
from oobleck.planning.synthetic import synthetic_profile
from oobleck.strategy import Kind, RunState, StrategyContext, build_strategy

GB = 1e9


def _context(memory_gb: float = 2.0) -> StrategyContext:
    return StrategyContext(synthetic_profile(12, seed=1), ClusterSpec(8, 1, memory_gb * GB, 10 * GB, 1 * GB), 64, 1, 1)


def _bamboo(context: StrategyContext, **overrides):
    return build_strategy(OmegaConf.load(CONF_DIR / "strategy" / "bamboo.yaml"), context, overrides)


def _change(layout, removed):
    alive = tuple(n for n in range(8) if n not in removed)
    return RunState(layout, alive, tuple(removed), (), step=5)


def test_lazy_is_the_default_and_a_bad_mode_is_refused():
    assert _bamboo(_context()).config.redundancy == "lazy"
    with pytest.raises(ConfigError, match=r"strategy.redundancy='eagerly' must be one of inline, eager, lazy"):
        _bamboo(_context(), redundancy="eagerly")


def test_what_each_mode_keeps_on_the_device_and_in_host_memory():
    common = dict(
        own_state=160.0,
        own_activations=10.0,
        copy_param_bytes=20.0,
        copy_state=80.0,
        copy_activations=6.0,
        input_bytes=2.0,
        output_bytes=3.0,
        stage=1,
        stages=4,
        microbatches=8,
        gpus=2,
    )
    own, inputs = 160 + 10 * 3 / 2, 2 * 8 / 2  # 3 microbatches in flight; input gradients of all 8 in host memory
    assert stage_memory("inline", **common).device_bytes == own + 80 + 6 * 3 / 2
    assert stage_memory("eager", **common).device_bytes == own + 80 + 6 * 8 / 2  # every microbatch's output
    lazy = stage_memory("lazy", **common)
    assert lazy.device_bytes == own and lazy.host_bytes == inputs + 3 * 20 + 3 * 8 / 2
    assert stage_memory("eager", **common).host_bytes == stage_memory("inline", **common).host_bytes == inputs
    last = stage_memory("lazy", **{**common, "stage": 3})
    assert last.host_bytes == inputs + 3 * 20  # the last stage's output is the loss: nothing kept
    # A failover: lazy moves the copy to the device and redoes forwards and backwards; eager holds
    # the redundant outputs and redoes only backwards.
    extra = dict(
        lost_forward_s=1.0,
        lost_backward_s=2.0,
        done_forwards=3,
        done_backwards=1,
        copy_param_bytes=30.0,
        host_to_device_bytes_per_s=10.0,
    )
    assert failover_extra_seconds("eager", **extra) == 2.0
    assert failover_extra_seconds("inline", **extra) == 5.0
    assert failover_extra_seconds("lazy", **extra) == 5.0 + 9.0


def test_lazy_fits_where_a_copy_on_the_device_does_not():
    # 1 GB devices hold a stage but not its successor's copy as well.
    for mode in ("inline", "eager"):
        stop = _bamboo(_context(1.0), redundancy=mode).start(list(range(8)))
        assert stop.kind is Kind.STOP and stop.out_of_memory and f"({mode} redundancy)" in stop.reason
    layout = _bamboo(_context(1.0)).start(list(range(8))).layout
    assert "lazy redundancy" in layout.description and "GB host memory" in layout.description


def test_modes_in_plans_and_time():
    # 4 GB devices: eager keeps the redundant outputs of all 32 microbatches of a pipeline (3.4 GB).
    layouts = {
        mode: _bamboo(_context(4.0), redundancy=mode, pipeline_depth=4).start(list(range(8))).layout
        for mode in ("inline", "eager", "lazy")
    }
    for mode, layout in layouts.items():
        assert layout.plan.redundancy == mode and layout.plan.shadows  # every mode keeps the copies
    # Lazy runs no redundant forward: what remains redundant is the copies' share of the gradient
    # reduction (they join it to stay identical).
    assert 0 < layouts["lazy"].redundant_fraction < layouts["eager"].redundant_fraction
    assert layouts["lazy"].iteration_s < layouts["eager"].iteration_s < layouts["inline"].iteration_s
    strategy = _bamboo(_context(4.0), redundancy="eager", pipeline_depth=4)
    pipeline = layouts["eager"].plan.pipelines[0]
    extra = strategy.eager_extra_s(pipeline.template, pipeline.microbatches)
    assert layouts["eager"].iteration_s == pytest.approx(layouts["lazy"].iteration_s + extra) and extra > 0


def test_a_stage_taken_over_is_a_failover_and_rebalance_is_an_option():
    # Depth 2, four pipelines, no standby: a lost second stage is taken over by the first.
    faithful = _bamboo(_context(), pipeline_depth=2)
    layout = faithful.start(list(range(8))).layout
    lost = layout.state.pipelines[0][1]
    failover = faithful.on_change(_change(layout, [lost]))
    assert failover.kind is Kind.FAILOVER and failover.layout.state.pipelines[0] == (0, FAILED)
    assert failover.reason == "1 stage(s) taken over by their predecessor"
    # With rebalance (not real Bamboo's) the degraded pipeline is dissolved instead, the model
    # finding three whole pipelines faster than four with one failed over: no stage is taken over.
    rebalancing = _bamboo(_context(), pipeline_depth=2, rebalance=True)
    decision = rebalancing.on_change(_change(rebalancing.start(list(range(8))).layout, [lost]))
    assert decision.kind is Kind.RECONFIGURE and decision.layout.state.pipelines == ((2, 3), (4, 5), (6, 7))
    assert decision.reason == "pipeline 0 dissolved to repair the others (rebalance)"
    assert decision.layout.iteration_s < failover.layout.iteration_s

"""benchmarks/bench_strategies.py compares the five systems issue 26 names, each a valid run."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_strategies", REPO / "benchmarks" / "bench_strategies.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("fault", ["crash", "hang", "none"])
def test_the_five_strategies_run_under_one_schedule(fault):
    from oobleck.config import validate

    bench = _bench()
    protocol = importlib.import_module("protocol")  # bench_strategies put benchmarks/ on the path
    assert sorted(bench.STRATEGIES) == ["bamboo", "oobleck", "recycle", "torchft", "varuna"]
    assert bench.STRATEGIES[0] == "oobleck"  # the reference every ratio is paired with
    assert set(bench.VALIDATED) <= set(bench.STRATEGIES)
    events = protocol.fault_events(fault, (9,), 0.0)
    for name in bench.STRATEGIES:
        cfg = protocol.tiny_run_config(
            protocol.Variant(name, name), events, steps=24, nodes=4, heartbeat_timeout_s=5.0, profiles=Path("p")
        )
        validate(cfg)
        assert cfg.strategy.name == name and len(cfg.failures.events) == len(events)

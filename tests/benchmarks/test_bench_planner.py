"""``benchmarks/realistic_profile.json`` is what ``bench_planner.realistic_profile()`` makes (the
profile the planner's README figures are measured on), and it is the profile its docstring says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from oobleck.planning.inputs import ModelProfile

REPO = Path(__file__).resolve().parents[2]


def test_the_committed_realistic_profile_is_its_generators():
    spec = importlib.util.spec_from_file_location("bench_planner", REPO / "benchmarks" / "bench_planner.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    made = module.realistic_profile()
    assert ModelProfile.load(REPO / "benchmarks" / "realistic_profile.json") == made
    layers = made.layers
    assert len(layers) == 100
    assert all(0.008 <= layer.forward_s <= 0.012 and layer.backward_s == 2 * layer.forward_s for layer in layers)
    assert all(40e6 <= layer.param_bytes <= 60e6 for layer in layers)

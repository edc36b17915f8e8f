"""Trace-driven simulation of resilience strategies (DESIGN section 6).

``engine.simulate(strategy, trace)`` replays a node trace for one ``oobleck.strategy.Strategy``;
``policies.OobleckStrategy`` is Oobleck's policy (real planner), the baselines live in
``baselines/``; ``experiment.run_experiment(cfg)`` runs a grid into pandas tables;
``validate.validate_run(run_dir)`` compares the simulator with a real run.
"""

from oobleck.sim.engine import SimResult, simulate

__all__ = ["SimResult", "simulate"]

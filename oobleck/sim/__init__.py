"""Trace-driven simulation of resilience strategies (DESIGN section 6).

``engine.simulate(strategy, trace)`` replays a node trace for one ``oobleck.strategy.Strategy``:
the strategy decides (the same decisions the real runtime executes) and ``costs`` charges each
decision by its kind; ``experiment.run_experiment(cfg)`` runs a grid of models x traces x
strategies into pandas tables; ``validate.validate_run(run_dir)`` compares the simulator with a
real run. (No imports here: ``oobleck.recovery_costs`` is imported by the strategy interface itself.)
"""

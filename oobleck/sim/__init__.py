"""Trace-driven simulation of resilience strategies (DESIGN section 6).

``engine.simulate(strategy, trace)`` replays a node trace for one ``oobleck.strategy.Strategy``: the
strategy decides (the same decisions the real runtime executes) and ``charges`` costs each decision
by its kind (``oobleck.recovery_costs`` holds the cost model: restarts from components, storage
shared by every node at once), ``progress`` keeps the run's work on its way to durable, ``arrivals``
delays the trace's nodes by instance creation and ``results`` makes the rows and the summary;
``experiment.run_experiment(cfg)`` runs a grid of models x traces x shifted starts (``replay``) x
strategies into pandas tables, at the testbed's nominal constants and at every band sample of the
constants declared uncertain (``oobleck.uncertainty``), and ``ratios`` turns them into Oobleck's
speedups with their bands and cliffs. ``testbed`` compares the presets with what the Oobleck
artifact measured, ``failure_model`` writes traces at published failure rates,
``validate.validate_run(run_dir)`` compares the simulator with a real run and ``holdout`` scores the
pre-registered held-out runs apart. (No imports here: ``oobleck.recovery_costs`` is imported by the
strategy interface itself.)
"""

"""Baseline resilience strategies on the shared ``oobleck.strategy.Strategy`` interface:
``varuna`` (checkpoint, restart, job morphing) and ``bamboo`` (redundant computation, failover).
Each is chosen by ``_target_`` in ``conf/strategy/<name>.yaml``; ``oobleck`` never imports them."""

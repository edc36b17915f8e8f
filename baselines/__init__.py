"""Baseline resilience strategies on the shared ``oobleck.strategy.Strategy`` interface:
``varuna`` (checkpoint, restart, job morphing) and ``bamboo`` (redundant computation, failover)."""

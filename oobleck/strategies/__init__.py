"""Oobleck's own resilience strategies on the ``oobleck.strategy.Strategy`` interface.

- ``oobleck``: instantiate pipeline templates, reconfigure in place (``strategy=oobleck``).

The baselines (Varuna, Bamboo, torchft) live in ``baselines/``; nothing here imports them.
"""

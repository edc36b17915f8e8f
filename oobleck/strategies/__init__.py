"""Oobleck's own resilience strategies on the ``oobleck.strategy.Strategy`` interface.

- ``oobleck``: instantiate pipeline templates, reconfigure in place (``strategy=oobleck``);
- ``oobleck_sosp23``: the same start, the paper's reconfiguration (shrink, borrow, merge; one
  source per copy; ``strategy=oobleck_sosp23``).

The baselines (Varuna, Bamboo, torchft) live in ``baselines/``; nothing here imports them.
"""

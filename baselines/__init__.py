"""Baseline resilience strategies on the shared ``oobleck.strategy.Strategy`` interface:
``varuna`` (checkpoint, restart, job morphing), ``bamboo`` (redundant computation, failover) and
``torchft`` (PyTorch's fault-tolerance library as an external peer, the ``[peers]`` extra).
Each is chosen by ``_target_`` in ``conf/strategy/<name>.yaml``; ``oobleck`` never imports them."""

"""Oobleck harness: resilient pipeline-template training, baselines, simulator and figures.

Packages by concept (one-way imports): ``planning`` (pure Python, no torch.distributed) <-
``runtime`` / ``sim``; ``elastic`` drives ``runtime``; ``faults`` schedules failures; ``metrics``
writes run outputs; ``models``, ``data`` and ``profiling`` feed the planner and the runtime.
"""

__version__ = "0.1.0"

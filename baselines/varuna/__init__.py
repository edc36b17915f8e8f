"""Varuna-style strategy (checkpoint every k iterations, restart and morph on change): see ``policy``."""

from baselines.varuna.policy import VarunaStrategy, best_homogeneous

__all__ = ["VarunaStrategy", "best_homogeneous"]

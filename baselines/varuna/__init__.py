"""Varuna-style strategy (checkpoint every k steps, restart and morph on change): see ``policy``."""

from baselines.varuna.policy import Varuna, VarunaConfig

__all__ = ["Varuna", "VarunaConfig"]

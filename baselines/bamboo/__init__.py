"""Bamboo-style strategy (redundant successor stage, failover, restart on adjacent failures): see ``policy``."""

from baselines.bamboo.policy import BambooState, BambooStrategy

__all__ = ["BambooState", "BambooStrategy"]

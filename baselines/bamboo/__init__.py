"""Bamboo-style strategy (redundant successor stage, failover, restart on adjacent failures): see ``policy``."""

from baselines.bamboo.policy import Bamboo, BambooConfig, BambooState

__all__ = ["Bamboo", "BambooConfig", "BambooState"]

"""Bamboo-style strategy (redundant successor stage, failover, restart on adjacent failures): see
``policy``; what each redundancy mode keeps on the device and in host memory, and what Bamboo's
own failover redoes: ``memory``."""

from baselines.bamboo.config import BambooConfig, BambooState
from baselines.bamboo.memory import StageMemory, failover_extra_seconds, stage_memory
from baselines.bamboo.policy import Bamboo

__all__ = ["Bamboo", "BambooConfig", "BambooState", "StageMemory", "failover_extra_seconds", "stage_memory"]

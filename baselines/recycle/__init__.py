"""ReCycle-style strategy (re-route a lost stage's microbatches through peer pipelines, no state
copy; checkpoint restart when every copy of a stage is lost): see ``policy``."""

from baselines.recycle.policy import ReCycle, ReCycleConfig, ReCycleState

__all__ = ["ReCycle", "ReCycleConfig", "ReCycleState"]

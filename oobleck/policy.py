"""Deprecated location of Oobleck's strategy: use ``oobleck.strategies.oobleck``.

Configs written before the move name ``_target_: oobleck.policy.Oobleck``; they keep working, with
a warning, until the next minor release.
"""

import warnings

from oobleck.strategies.oobleck import Oobleck, OobleckConfig

warnings.warn(
    "oobleck.policy is deprecated: name oobleck.strategies.oobleck.Oobleck in _target_",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["Oobleck", "OobleckConfig"]

"""The value checks every config section's validation uses, each raising ``ConfigError`` with a
message that names the key, the value and what it must be. A leaf: sections beside their
components (``oobleck.checkpoint.settings``) and the central ``oobleck.config.validate`` import
it without importing each other."""

from __future__ import annotations

import math
from typing import Any

from oobleck.errors import ConfigError


def choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}; set {key}=<one of them>")


def positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    bound = ">= 0" if allow_zero else "> 0"
    if value is None or (isinstance(value, float) and not math.isfinite(value)):  # NaN passes every comparison below
        raise ConfigError(f"{key}={value} must be a finite number {bound}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {bound}")

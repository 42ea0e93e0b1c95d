"""Checks of single configuration values, shared by the schema (``disteval.config``) and the tasks' options
(``disteval.options``): each raises ConfigError naming the key."""
from __future__ import annotations

import math
from typing import Any

from disteval.errors import ConfigError


def finite_positive(key: str, value: Any, nullable: bool = False, most: float | None = None) -> None:
    """``value`` is a finite number > 0 (and <= ``most`` when given; None allowed when ``nullable``)."""
    if value is None and nullable:
        return
    if value is None or not math.isfinite(float(value)) or float(value) <= 0:
        raise ConfigError(key, f"must be a finite number > 0{' or null' if nullable else ''}, got {value}")
    if most is not None and float(value) > most:
        raise ConfigError(key, f"must be at most {most:g}, got {value}")


def at_least(key: str, value: Any, low: int, nullable: bool = False) -> None:
    """``value`` is an integer >= ``low`` (None allowed when ``nullable``)."""
    if (value is None and not nullable) or (value is not None and value < low):
        raise ConfigError(key, f"must be an integer >= {low}{' or null' if nullable else ''}, got {value}")

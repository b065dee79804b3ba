"""Config validation helpers: every message names the field, what it got and what it expects."""

from __future__ import annotations

import math


class ConfigError(ValueError):
    """A cache configuration value is invalid; raised before sampling starts."""


def check_int(owner: str, name: str, value, *, minimum: int = 0, allow_none: bool = False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{owner}.{name} must be an integer >= {minimum}"
                          f"{' or None' if allow_none else ''}, got {value!r}")


def check_float(owner: str, name: str, value, *, minimum: float = 0.0, below: float | None = None):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and value >= minimum and (below is None or value < below)
    if not ok:
        upper = f" and < {below}" if below is not None else ""
        raise ConfigError(f"{owner}.{name} must be a finite number >= {minimum}{upper}, got {value!r}")


def check_choice(owner: str, name: str, value, choices):
    if value not in choices:
        raise ConfigError(f"{owner}.{name} must be one of {', '.join(map(repr, choices))}, "
                          f"got {value!r}")

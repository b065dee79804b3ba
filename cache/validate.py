"""Config validation helpers: every message names the field, what it got and what it expects."""

from __future__ import annotations

import math


class ConfigError(ValueError):
    """A cache configuration value is invalid; raised before sampling starts.

    `field` ("TeaCacheConfig.threshold"), `value` and `expected` are set where one field is at
    fault, so the command line can name the flag that set it instead of the dataclass field."""

    def __init__(self, message: str, *, field: str | None = None, value=None,
                 expected: str | None = None):
        super().__init__(message)
        self.field, self.value, self.expected = field, value, expected


def _refuse(owner: str, name: str, value, expected: str):
    raise ConfigError(f"{owner}.{name} must be {expected}, got {value!r}", field=f"{owner}.{name}",
                      value=value, expected=expected)


def check_int(owner: str, name: str, value, *, minimum: int = 0, allow_none: bool = False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _refuse(owner, name, value, f"an integer >= {minimum}{' or None' if allow_none else ''}")


def check_float(owner: str, name: str, value, *, minimum: float = 0.0, below: float | None = None):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and value >= minimum and (below is None or value < below)
    if not ok:
        upper = f" and < {below}" if below is not None else ""
        _refuse(owner, name, value, f"a finite number >= {minimum}{upper}")


def check_choice(owner: str, name: str, value, choices):
    if value not in choices:
        _refuse(owner, name, value, f"one of {', '.join(map(repr, choices))}")

"""Validation helpers for configs and for the data files the gate reads (calibrated profiles):
every message names the field, what it got and what it expects."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping


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


def present(expected: Mapping, given: Mapping) -> Iterator[tuple]:
    """(key, expected[key], given[key]) for each key of `expected` that `given` holds, in
    `expected`'s order: what a check of `given` against a table of expected entries reads."""
    return ((key, entry, given[key]) for key, entry in expected.items() if key in given)


# --- values read from data files (calibrated profiles) -------------------------------------------

class FieldError(ValueError):
    """A data file (a calibrated profile) cannot be read as JSON, or one of its values is missing,
    of the wrong type or out of range. One line: where the value sits in the file
    (`budget.candidates[3].rel_l2[0]`), what it holds and what was expected; the loader puts the
    file in front and raises its own error."""


MISSING = object()  # the value of a key the file does not have


def read_json(path: str):
    """The JSON value of the file at `path`; FieldError (one line) when it cannot be read, is not
    UTF-8, is not JSON or is nested too deeply for the parser."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise FieldError(f"cannot read it ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FieldError(f"is not UTF-8 text (byte {exc.start}: {exc.reason}); expected JSON")\
            from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise FieldError(f"is not valid JSON ({exc})") from None
    except RecursionError:
        raise FieldError("is JSON nested too deeply to read") from None
    except ValueError as exc:  # e.g. an integer past the interpreter's digit limit
        raise FieldError(f"is not JSON that can be read ({_first_line(exc)})") from None


def _first_line(exc) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def json_type(value) -> str:
    """The JSON name of a parsed value's type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def at_key(where: str, key: str) -> str:
    """The path of `key` inside the object at `where` ("" is the file's top level)."""
    if key.isidentifier():
        return f"{where}.{key}" if where else key
    return f"{where}[{json.dumps(key)[:60]}]"


def _held(value) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    text = json.dumps(value, default=repr) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def refuse_field(where: str, value, expected: str):
    """Raise the FieldError for the value at `where` (MISSING: the key is absent)."""
    if value is MISSING:
        raise FieldError(f"{where} is missing: expected {expected}")
    raise FieldError(f"{where} {_held(value)}: expected {expected}")


def json_int(value, where: str, *, minimum: int | None = None) -> int:
    """A JSON integer (not a boolean, a float or a string) >= minimum."""
    if isinstance(value, int) and not isinstance(value, bool) and \
            (minimum is None or value >= minimum):
        return value
    refuse_field(where, value, "an integer" + (f" >= {minimum}" if minimum is not None else ""))


def json_number(value, where: str, *, minimum: float | None = None,
                maximum: float | None = None, above: float | None = None,
                expected: str | None = None) -> float:
    """A finite JSON number (not a boolean or a string) within the bounds given."""
    bounds = ([f">= {minimum:g}"] if minimum is not None else []) + \
        ([f"> {above:g}"] if above is not None else []) + \
        ([f"<= {maximum:g}"] if maximum is not None else [])
    ok = isinstance(value, int | float) and not isinstance(value, bool) and \
        math.isfinite(value) and (minimum is None or value >= minimum) and \
        (maximum is None or value <= maximum) and (above is None or value > above)
    if not ok:
        refuse_field(where, value, expected or " ".join(["a finite number", " and ".join(bounds)])
                     .strip())
    return float(value)


def json_str(value, where: str, *, choices=None) -> str:
    """A non-empty JSON string, one of `choices` where given."""
    if choices is not None:
        if isinstance(value, str) and value in choices:
            return value
        refuse_field(where, value, f"one of {', '.join(map(repr, choices))}")
    if isinstance(value, str) and value:
        return value
    refuse_field(where, value, "a non-empty string")


def json_object(value, where: str, expected: str) -> dict:
    if not isinstance(value, dict):
        refuse_field(where, value, expected)
    return value


def json_list(value, where: str, expected: str, *, length: int | None = None,
              min_length: int = 0) -> list:
    """A JSON array of `length` items (at least `min_length`); `expected` says what it holds."""
    if not isinstance(value, list) or (length is not None and len(value) != length) or \
            len(value) < min_length:
        refuse_field(where, value, expected)
    return value

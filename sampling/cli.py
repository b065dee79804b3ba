"""The shape every command shares: parse, run, one error line and exit 2 on a known error (nothing
written), one line and 128 + the signal's number on SIGINT/SIGTERM, else the summary from the rank
that speaks for the run. Plus the checks of numeric flags the commands share."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Callable

from .interrupt import Interrupted, handled


class UsageError(ValueError):
    """A flag or input the run cannot use; reported before any model or device work."""


def launch_rank() -> int:
    """This process's rank under torchrun (RANK), 0 otherwise: rank 0 speaks for the launch."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


# How long a rank other than 0 waits before it exits on a refusal: torchrun stops every rank once
# one has exited, so a rank that refused first would silence rank 0's line. Rank 0 refuses alike
# (same flags, same checks) and the launcher ends the waiting ranks as soon as it exits.
QUIET_RANK_GRACE_S = 20.0


def _let_rank_0_speak() -> None:
    try:
        time.sleep(QUIET_RANK_GRACE_S)
    except (Interrupted, KeyboardInterrupt):
        pass


def command(build_parser: Callable, run: Callable[..., dict], format_summary: Callable[[dict], str],
            errors: tuple[type[BaseException], ...],
            speaks: Callable[[dict], bool] = lambda report: True) -> Callable[..., int]:
    def main(argv: list[str] | None = None) -> int:
        parser = build_parser()
        args = parser.parse_args(argv)
        with handled():
            try:
                report = run(args)
            except errors as exc:
                if launch_rank() == 0:  # every rank refuses alike; one says so
                    print(f"{parser.prog}: error: {exc}", file=sys.stderr)
                else:
                    _let_rank_0_speak()
                return 2
            except MemoryError:
                if launch_rank() == 0:
                    print(f"{parser.prog}: error: out of host memory; expected a smaller size "
                          "(--height/--width/--video_length) or fewer steps; nothing was written",
                          file=sys.stderr)
                return 2
            except (Interrupted, KeyboardInterrupt) as exc:
                signum = exc.signum if isinstance(exc, Interrupted) else 2
                name = exc.name if isinstance(exc, Interrupted) else "SIGINT"
                if launch_rank() == 0:
                    print(f"{parser.prog}: interrupted by {name}; no partial output was left "
                          "(files of earlier runs are as they were)", file=sys.stderr)
                return 128 + signum
        if speaks(report):
            print(format_summary(report))
        return 0
    return main


# --- numeric flags -------------------------------------------------------------------------------

def _shown(value) -> str:
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else repr(value)


def as_int(label: str, value, *, minimum: int | None = None, maximum: int | None = None,
           expected: str | None = None) -> int:
    """`value` (a flag's or a config file's) as an int within [minimum, maximum], else UsageError
    naming `label` ("--height"), the value and what is expected."""
    if minimum is not None and maximum is not None:
        want = expected or f"an integer in [{minimum}, {maximum}]"
    elif minimum is not None:
        want = expected or f"an integer >= {minimum}"
    else:
        want = expected or "an integer"
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            pass
    if number is None or (minimum is not None and number < minimum) or \
            (maximum is not None and number > maximum):
        raise UsageError(f"{label} {_shown(value)}: expected {want}")
    return number


def as_number(label: str, value, *, minimum: float | None = None, above: float | None = None,
              maximum: float | None = None, expected: str | None = None) -> float:
    """`value` as a finite float, >= minimum, > above and <= maximum where given, else
    UsageError."""
    bounds = ([f">= {minimum:g}"] if minimum is not None else []) + \
        ([f"> {above:g}"] if above is not None else []) + \
        ([f"<= {maximum:g}"] if maximum is not None else [])
    want = expected or ("a finite number" + (" " + " and ".join(bounds) if bounds else ""))
    number = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None or not math.isfinite(number) or \
            (minimum is not None and number < minimum) or (above is not None and number <= above) \
            or (maximum is not None and number > maximum):
        raise UsageError(f"{label} {_shown(value)}: expected {want}")
    return number

"""Progress of the phases that last (loading, compiling, denoising, calibrating, decoding): tqdm
bars on stderr when stderr is a terminal, nothing when it is not (logs, pipes, CI) or under
`--quiet`. The summary goes to stdout either way, so a script that reads it sees no bar.

Every bar is made here, so the commands decide once (`configure`) and the rooms below only ask
for a bar (`bar`, `steps`) or tick the active phase (`tick`).
"""

from __future__ import annotations

import contextlib
import logging
import sys

from tqdm import tqdm

_state = {"quiet": False, "phase": None}


def configure(quiet: bool = False, verbose: int = 0) -> None:
    """Once per command: bars off under --quiet; diagnostics through `logging` at WARNING, INFO
    with -v, DEBUG with -vv, ERROR with --quiet."""
    _state["quiet"] = quiet
    level = logging.ERROR if quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr,
                        force=True)


def shown() -> bool:
    """Bars are drawn: not quiet, and stderr is a terminal."""
    stream = sys.stderr
    return not _state["quiet"] and hasattr(stream, "isatty") and stream.isatty()


def bar(total: int | None, desc: str, unit: str = "it"):
    """A tqdm bar on stderr (a disabled one when bars are not shown)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not shown(),
                dynamic_ncols=True, leave=True)


class Steps:
    """The denoise loop's callback (done, total, computed) on one bar over every step of every
    clip of a run: the postfix counts the steps the gate reused."""

    def __init__(self, total: int, desc: str = "denoise"):
        self.bar = bar(total, desc, unit="step")
        self.reused = 0

    def __call__(self, done: int, total: int, computed: bool) -> None:
        self.reused += not computed
        self.bar.set_postfix_str(f"reused {self.reused}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def steps(total: int, desc: str = "denoise") -> Steps | None:
    """A Steps bar, or None (the loop then reports nothing) when bars are not shown."""
    return Steps(total, desc) if shown() else None


@contextlib.contextmanager
def phase(desc: str, unit: str = "call"):
    """A counting bar for a phase of unknown length (warm-up compiles): `tick(name)` from below
    advances it and names what ran last."""
    b = bar(None, desc, unit)
    previous, _state["phase"] = _state["phase"], b
    try:
        yield b
    finally:
        _state["phase"] = previous
        b.close()


def tick(name: str) -> None:
    """Advance the active phase's bar, if any (one None check otherwise: safe on hot paths)."""
    b = _state["phase"]
    if b is not None:
        b.set_postfix_str(name, refresh=False)
        b.update(1)

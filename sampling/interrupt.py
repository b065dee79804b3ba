"""SIGINT and SIGTERM as one exception the commands can report in a line, held back while a pair
of output files is being renamed in, so an interruption never splits a pair.

`Interrupted` is a BaseException, as KeyboardInterrupt is: the gate's fail-safes catch Exception
and must not swallow a request to stop.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_pending: list[int] | None = None  # signals held back by `deferred`, None outside it


class Interrupted(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def _handler(signum, frame):
    if _pending is not None:
        _pending.append(signum)
        return
    raise Interrupted(signum)


@contextmanager
def handled():
    """SIGINT/SIGTERM raise Interrupted inside the block (main thread only: elsewhere Python
    cannot install handlers, and the defaults stay)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextmanager
def deferred():
    """Hold SIGINT/SIGTERM until the block ends, then raise for the first one that came."""
    global _pending
    if _pending is not None:  # nested: the outer block raises
        yield
        return
    _pending = []
    try:
        yield
    finally:
        held, _pending = _pending, None
    if held:
        raise Interrupted(held[0])

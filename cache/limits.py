"""Skip limits (seed 002, cache-dit): cap how much a branch may reuse, to bound drift.

max_cached      skips allowed per branch in one run (or expert phase); None = no cap
max_continuous  skips allowed in a row; None = no cap
alternating     only every other skip-eligible step may skip (1st skips, 2nd computes, ...)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .decision import Reason
from .validate import check_int


@dataclass(frozen=True, kw_only=True)
class LimitsConfig:
    max_cached: int | None = None
    max_continuous: int | None = None
    alternating: bool = False

    def __post_init__(self):
        check_int("LimitsConfig", "max_cached", self.max_cached, allow_none=True)
        check_int("LimitsConfig", "max_continuous", self.max_continuous, allow_none=True)


@dataclass(frozen=True)
class LimitsState:
    skipped: int = 0
    in_a_row: int = 0
    eligible: int = 0


def check(config: LimitsConfig, state: LimitsState) -> Reason | None:
    """For a skip-eligible call: the reason it must compute instead, or None if it may skip."""
    if config.max_cached is not None and state.skipped >= config.max_cached:
        return Reason.MAX_CACHED
    if config.max_continuous is not None and state.in_a_row >= config.max_continuous:
        return Reason.MAX_CONTINUOUS
    if config.alternating and state.eligible % 2 == 1:
        return Reason.ALTERNATING
    return None


def count_eligible(state: LimitsState) -> LimitsState:
    return replace(state, eligible=state.eligible + 1)


def record(state: LimitsState, *, skipped: bool) -> LimitsState:
    return replace(state, skipped=state.skipped + skipped,
                   in_a_row=state.in_a_row + 1 if skipped else 0)


def unrecord_skip(state: LimitsState) -> LimitsState:
    """A recorded skip turned into a compute after all."""
    return replace(state, skipped=state.skipped - 1, in_a_row=0)

"""DeepCache schedule (seed 003): reuse the cached deep features on a fixed step pattern.

Steps before `start` and from `end` on compute; inside [start, end) every `interval`-th step
(start, start + interval, ...) refreshes the cache and the others reuse it. The whole plan is
known before the loop, so it needs no signal and no device read per step. HunyuanVideo-1.5's
11/45/4 over 50 steps computes 25 steps: 0-10, 11, 15, ..., 43, 45-49.

`steps` names the computed steps outright instead (a schedule chosen offline, such as budgeted
mode's calibrated static schedules, sampling/budget_space.py); start, end and interval are then unused.
"""

from __future__ import annotations

from dataclasses import dataclass

from .decision import Reason, Vote
from .validate import ConfigError, check_int

MODE = "dc"
SIGNAL_FIELD = None  # no signal


@dataclass(frozen=True, kw_only=True)
class DeepCacheConfig:
    start: int = 11
    end: int = 45
    interval: int = 4
    steps: tuple[int, ...] = ()  # the computed steps; empty = the start/end/interval pattern

    def __post_init__(self):
        steps = self.steps
        if isinstance(steps, (str, bytes)) or not hasattr(steps, "__iter__"):
            raise ConfigError(f"DeepCacheConfig.steps must list the computed steps, got {steps!r}",
                              field="DeepCacheConfig.steps", value=steps,
                              expected="distinct step indices >= 0")
        steps = tuple(steps)
        if len(set(steps)) != len(steps) or not all(
                type(step) is int and step >= 0 for step in steps):
            raise ConfigError(f"DeepCacheConfig.steps must be distinct step indices >= 0, got "
                              f"{steps}", field="DeepCacheConfig.steps", value=steps,
                              expected="distinct step indices >= 0")
        object.__setattr__(self, "steps", tuple(sorted(steps)))
        check_int("DeepCacheConfig", "start", self.start)
        check_int("DeepCacheConfig", "end", self.end)
        check_int("DeepCacheConfig", "interval", self.interval, minimum=1)
        if self.end < self.start:
            raise ConfigError(f"DeepCacheConfig.end ({self.end}) must be >= start ({self.start})",
                              field="DeepCacheConfig.end", value=self.end,
                              expected=f"a step >= the start step {self.start}")

    def reuses(self, step: int) -> bool:
        if self.steps:
            return step not in self.steps
        return self.start <= step < self.end and (step - self.start) % self.interval != 0


@dataclass(frozen=True)
class DeepCacheState:
    pass


State = DeepCacheState


def schedule(config: DeepCacheConfig, num_steps: int) -> list[bool]:
    """Per step, True where the step computes the full stack."""
    return [not config.reuses(step) for step in range(num_steps)]


def measure(config, state, value):
    return None, state, False


def judge(config: DeepCacheConfig, state: DeepCacheState, rel, ctx):
    if config.reuses(ctx.step):
        return Vote(True, Reason.SCHEDULE_SKIP), state
    return Vote(False, Reason.SCHEDULE_COMPUTE), state


def refresh(state: DeepCacheState) -> DeepCacheState:
    return state

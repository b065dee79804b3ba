"""MagCache (Ma et al. 2025, Zehong-Ma/MagCache; diffusers' MagCacheConfig; maxdiffusion's TPU
port): skip on a plan read from magnitude ratios calibrated once per model.

A branch's ratio at step i is the mean over tokens of |o_i| / |o_{i-1}|, its output's norm over
the channels at step i over the step before, measured on uncached runs by the calibrate command
(`calibrate.py ... --out P`, the profile's `magcache` block). While a branch reuses, the drift
the ratios predict adds up: acc_ratio *= ratio_i, acc_err += |1 - acc_ratio|, and the branch
reuses while acc_err < threshold and it has reused at most `max_skip` steps in a row; a compute
resets all three. The first `retention` of the steps always compute (the official default
keeps 20%). Nothing is read from the device: like DeepCache, the whole plan follows from the
ratios, so a step costs no sync and no probe blocks.

Where we differ from the official code: the ratios are of the model output (the velocity the
scheduler steps with), which every backend already returns, not of the block stack's residual;
the calibrate command measures them from the same uncached runs that fit TeaCache. A run of
another step count reads the ratios at the nearest calibrated step (the official
`nearest_interp`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from .decision import Reason, Vote
from .validate import ConfigError, check_float, check_int

MODE = "mc"
SIGNAL_FIELD = None  # the plan needs no signal
PROFILE_KEY = "magcache"  # the block of a calibration profile that holds the ratios


@dataclass(frozen=True, kw_only=True)
class MagCacheConfig:
    """Args:
        ratios: the cond branch's magnitude ratio per calibrated step (step 0's is 1).
        uncond_ratios: the uncond branch's; empty = the cond ones (diffusers takes one list).
        threshold: the accumulated drift a reuse run may reach; diffusers' default.
        max_skip: steps reused in a row at most (K); diffusers' default.
        retention: the fraction of the steps, from the start, that always compute.
        profile: the calibration profile the ratios were read from, if any (for the summary).
    """

    ratios: tuple[float, ...] = ()
    uncond_ratios: tuple[float, ...] = ()
    threshold: float = 0.06
    max_skip: int = 3
    retention: float = 0.2
    profile: str | None = None

    def __post_init__(self):
        for name in ("ratios", "uncond_ratios"):
            values = getattr(self, name)
            if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
                raise ConfigError(f"MagCacheConfig.{name} must be a list of ratios, got {values!r:.60}",
                                  field=f"MagCacheConfig.{name}", value=values,
                                  expected="a list of positive finite numbers, one per step")
            values = tuple(values)
            bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int | float)
                   or not math.isfinite(v) or v <= 0]
            if bad:
                raise ConfigError(f"MagCacheConfig.{name} holds {bad[0]!r}; a magnitude ratio is a "
                                  "positive finite number", field=f"MagCacheConfig.{name}",
                                  value=bad[0], expected="positive finite numbers")
            object.__setattr__(self, name, tuple(float(v) for v in values))
        if not self.ratios:
            raise ConfigError("MagCache needs the magnitude ratios of the model: calibrate them "
                              "(python calibrate.py --model M --out P) and pass "
                              "--magcache_profile P", field="MagCacheConfig.ratios", value=(),
                              expected="a calibration profile with a magcache block")
        if self.uncond_ratios and len(self.uncond_ratios) != len(self.ratios):
            raise ConfigError(f"MagCacheConfig: {len(self.ratios)} cond ratios but "
                              f"{len(self.uncond_ratios)} uncond ones; expected one per step each",
                              field="MagCacheConfig.uncond_ratios", value=len(self.uncond_ratios),
                              expected=f"{len(self.ratios)} ratios")
        check_float("MagCacheConfig", "threshold", self.threshold)
        check_int("MagCacheConfig", "max_skip", self.max_skip, minimum=1)
        check_float("MagCacheConfig", "retention", self.retention)
        if self.retention > 1.0:
            raise ConfigError(f"MagCacheConfig.retention is a fraction of the steps in [0, 1], "
                              f"got {self.retention!r}", field="MagCacheConfig.retention",
                              value=self.retention, expected="a fraction of the steps in [0, 1]")

    def ratio_at(self, branch: str, step: int, num_steps: int) -> float:
        """The branch's ratio for `step` of a run of `num_steps` (nearest calibrated step)."""
        ratios = self.uncond_ratios if branch == "uncond" and self.uncond_ratios else self.ratios
        n = len(ratios)
        index = step if n == num_steps else round(step * (n - 1) / max(num_steps - 1, 1))
        return ratios[min(max(index, 0), n - 1)]


@dataclass(frozen=True)
class MagCacheState:
    acc_ratio: float = 1.0
    acc_steps: int = 0
    acc_err: float = 0.0


State = MagCacheState


def load_profile(path: str) -> dict:
    """The `magcache` block of a calibration profile: {"cond": [...], "uncond": [...], ...};
    ConfigError saying what is wrong with the file and what was expected."""
    expected = "expected a profile written by python calibrate.py --out"
    try:
        with open(path) as f:
            profile = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"the file does not exist; {expected}",
                          field="MagCacheConfig.profile", value=path) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"not a JSON profile ({exc}); {expected}",
                          field="MagCacheConfig.profile", value=path) from None
    block = profile.get(PROFILE_KEY) if isinstance(profile, dict) else None
    if not isinstance(block, dict) or not isinstance(block.get("cond"), list):
        raise ConfigError(f"no {PROFILE_KEY!r} block with a 'cond' list of ratios; {expected} "
                          "(it writes the ratios)", field="MagCacheConfig.profile", value=path)
    return block


def make(**fields) -> MagCacheConfig:
    """The config of the given fields, the ratios read from `profile` when it names a file and
    none are given (the flags and presets name a profile, not the ratios)."""
    path = fields.get("profile")
    if path is not None and not fields.get("ratios"):
        block = load_profile(path)
        fields = {**fields, "ratios": block["cond"], "uncond_ratios": block.get("uncond") or ()}
    return MagCacheConfig(**fields)


def measure(config, state, value):
    return None, state, False


def judge(config: MagCacheConfig, state: MagCacheState, rel, ctx):
    # the official `cnt >= int(num_steps * retention_ratio)`
    if ctx.step < int(ctx.num_steps * config.retention):
        return Vote(False, Reason.WARMUP), state
    ratio = config.ratio_at(ctx.branch, ctx.step, ctx.num_steps)
    acc_ratio = state.acc_ratio * ratio
    acc_err = state.acc_err + abs(1.0 - acc_ratio)
    steps = state.acc_steps + 1
    threshold = config.threshold * ctx.threshold_scale
    skip = acc_err < threshold and steps <= config.max_skip
    vote = Vote(skip, Reason.BELOW_THRESHOLD if skip else Reason.ABOVE_THRESHOLD, ratio,
                abs(1.0 - acc_ratio), acc_err, (), threshold)
    return vote, MagCacheState(acc_ratio, steps, acc_err)


def refresh(state: MagCacheState) -> MagCacheState:
    return MagCacheState()

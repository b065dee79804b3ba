"""TeaCache (seed 000): skip the block stack while the accumulated change of a cheap signature
stays under a threshold.

signature = mean |block-0 modulated input| (reduced over the sequence group by the backend);
rel = |sig - prev| / (|prev| + eps); rescaled = max(policy(rel), 0); accum += rescaled;
skip while accum < threshold; every compute resets accum (the residual is fresh again).

With `relative`, the threshold is in units of the signal's own scale: multiples of the mean
rescaled change measured so far in the phase (every call since the run or the expert began,
skipped or not), so skip while accum < threshold * mean. A model whose signature moves 100x
slower per step then takes the same decisions at the same setting (rel and its mean scale
alike), which absolute thresholds cannot: what 0.08 means depends on the model. The presets use
it. A signal that never moved (mean 0) computes every step: there is no scale to judge by.

The rescaled change estimates how much the model output changed: a magnitude, never negative.
A `poly:` profile evaluated outside the rel range it was fitted on can return a negative value
(its polynomial extrapolates); accumulated, that would make the accumulator fall step after
step and the gate reuse until the last step whatever the threshold. So it is clamped at zero,
and the gate counts the clamps and the evaluations outside the fitted range (Note.*).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Callable

from .decision import Note, Reason, SignatureState, Vote, is_finite, signature_change, smooth, threshold_vote
from .teacache_profiles import MODULATED_INPUT, PROFILES, SIGNALS, ProfileError, resolve_profile
from .validate import ConfigError, check_choice, check_float, check_int

MODE = "tc"
SIGNAL_FIELD = "teacache"  # the Signals field this technique reads
EPS = 1e-8


def _identity(rel: float, expert: str | None = None) -> float:
    return rel


LINEAR_THRESHOLD = 0.08  # the threshold of the identity rescaling when none is given


@dataclass(frozen=True, kw_only=True)
class TeaCacheConfig:
    """Args:
        threshold: accumulator threshold; larger skips more; <= 0 never skips. None (the
            default): the profile's own threshold (the one it was calibrated or published
            with) under a `poly:` policy, else LINEAR_THRESHOLD.
        policy: `linear` (identity) or `poly:<profile>` (see teacache_profiles.PROFILES).
        signal: what the signature summarises; defaults to the profile's signal, else the
            block-0 modulated input.
        ema: exponential smoothing of rel (seed 002); 0 turns it off.
        relative: the threshold counts multiples of the mean rescaled change so far in the
            phase instead of absolute units (see the module docstring).
    """

    threshold: float | None = None
    policy: str = "linear"
    signal: str | None = None
    ema: float = 0.0  # smooths rel before rescaling: ema * previous + (1 - ema) * rel; 0 = off
    downsample: int = 1  # token stride of the modulated-input signature (seed 002's diff stride)
    relative: bool = False

    def __post_init__(self):
        if self.threshold is not None:
            check_float("TeaCacheConfig", "threshold", self.threshold)
        check_int("TeaCacheConfig", "downsample", self.downsample, minimum=1)
        check_float("TeaCacheConfig", "ema", self.ema, below=1.0)
        if not isinstance(self.relative, bool):
            raise ConfigError(f"TeaCacheConfig.relative must be True or False, got {self.relative!r}",
                              field="TeaCacheConfig.relative", value=self.relative,
                              expected="true or false")
        if not isinstance(self.policy, str):
            raise ConfigError(f"TeaCacheConfig.policy must be 'linear' or 'poly:<profile>', got "
                              f"{self.policy!r}", field="TeaCacheConfig.policy", value=self.policy,
                              expected="linear, or poly: and a profile")
        if self.policy != "linear":
            name = self.policy.removeprefix("poly:")
            try:
                found = resolve_profile(name) if self.policy.startswith("poly:") else None
            except ProfileError as exc:
                raise ConfigError(str(exc), field="TeaCacheConfig.policy",
                                  value=self.policy) from None
            if found is None:
                raise ConfigError(
                    f"TeaCacheConfig.policy must be 'linear' or 'poly:<profile>' with a profile "
                    f"among {', '.join(sorted(PROFILES))} or a calibrated profile file "
                    f"(.json); got {self.policy!r}", field="TeaCacheConfig.policy",
                    value=self.policy, expected="linear, or poly: and a profile among "
                    f"{', '.join(sorted(PROFILES))} or a calibrated profile file (.json)")
        if self.signal is not None:
            check_choice("TeaCacheConfig", "signal", self.signal, SIGNALS)
            profile = self.profile
            if profile is not None and profile.signal != self.signal:
                raise ConfigError(
                    f"TeaCache profile {self.policy!r} was fitted on the {profile.signal} signal, "
                    f"but signal={self.signal!r} was asked for; drop the signal setting or pick a "
                    f"profile fitted on {self.signal}", field="TeaCacheConfig.signal",
                    value=self.signal)
        if self.threshold is None:  # a calibrated profile's threshold goes with its curve
            profile = self.profile
            object.__setattr__(self, "threshold",
                               profile.threshold if profile is not None else LINEAR_THRESHOLD)

    @cached_property
    def profile(self):
        return resolve_profile(self.policy.removeprefix("poly:")) if self.policy != "linear" else None

    @property
    def signature_of(self) -> str:
        """The tensor whose mean |.| the backend must report as Signals.teacache."""
        if self.signal is not None:
            return self.signal
        profile = self.profile
        return profile.signal if profile is not None else MODULATED_INPUT

    @property
    def rescale(self) -> Callable[..., float]:
        return self.profile or _identity


@dataclass(frozen=True)
class TeaCacheState(SignatureState):
    seen_sum: float = 0.0  # rescaled changes measured in this phase, and how many (relative mode)
    seen: int = 0


State = TeaCacheState


def measure(config: TeaCacheConfig, state: TeaCacheState, signature: float | None):
    """Signature -> (rel or None when there is no previous signature, new state, invalid)."""
    return signature_change(state, signature, EPS)


def judge(config: TeaCacheConfig, state: TeaCacheState, rel: float | None, ctx):
    """rel -> (Vote, new state). A None rel means there is nothing to compare with yet."""
    if rel is None:
        return Vote(False, Reason.NO_REFERENCE), state
    rel = smooth(rel, state.ema_rel, config.ema)
    raw = config.rescale(rel, ctx.expert)
    if not is_finite(raw):
        return None, TeaCacheState()
    notes = ()
    profile = config.profile
    if profile is not None:
        side = profile.outside(rel, ctx.expert)
        notes = {None: (), "below": (Note.PROFILE_BELOW_RANGE,),
                 "above": (Note.PROFILE_ABOVE_RANGE,)}[side]
    if raw < 0:  # a magnitude: see the module docstring
        notes += (Note.RESCALE_CLAMPED,)
    rescaled = max(raw, 0.0)
    accum = state.accum + rescaled
    seen_sum, seen = state.seen_sum + rescaled, state.seen + 1
    threshold = config.threshold * ctx.threshold_scale
    if config.relative:
        threshold *= seen_sum / seen
    return (threshold_vote(threshold, accum, rel, rescaled, notes),
            replace(state, accum=accum, ema_rel=rel, seen_sum=seen_sum, seen=seen))


def refresh(state: TeaCacheState) -> TeaCacheState:
    """The block stack ran: the cached residual is current again."""
    return replace(state, accum=0.0)

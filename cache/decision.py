"""What the gate reads (Signals) and what it hands back (Decision), and the reasons it gives.

Everything here is plain Python: the backend reduces its device tensors to floats before the
gate sees them, so the same decisions come out on JAX, torch and every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import NamedTuple, TypeVar

COMPUTE = "compute"
SKIP = "skip"

# The branch name of a fused-CFG call (cond and uncond batched in one model call).
PAIR = "pair"


class FailSafe(StrEnum):
    """Why the gate fell back to compute on its own: each has its own counter in the summary."""

    INVALID_METRIC = "invalid_metric"  # NaN/Inf or missing signal, or NaN/Inf after rescaling
    REDUCE_ERROR = "reduce_error"  # the backend's sequence-parallel reduction failed or disagreed
    SHAPE_MISMATCH = "shape_mismatch"  # cached residual shape differs from the current input
    DTYPE_MISMATCH = "dtype_mismatch"  # cached residual dtype cannot be cast to the input's
    MISSING_RESIDUAL = "missing_residual"  # skip chosen but no residual is stored
    OOM_ON_MOVE = "oom_on_move"  # moving a residual between devices ran out of memory
    LIFECYCLE_GUARD = "lifecycle_guard"  # API used out of order (no attach, no begin_step, ...)
    PAIR_DIVERGENCE = "pair_divergence"  # a follower branch could not follow its leader's skip
    INTERNAL_ERROR = "internal_error"  # any other exception inside the gate or the tensor ops


class Reason(StrEnum):
    """Why an action was taken when no fail-safe fired."""

    BELOW_THRESHOLD = "below_threshold"  # skip: the accumulated change stayed under the threshold
    ABOVE_THRESHOLD = "above_threshold"  # compute: it reached the threshold
    NO_REFERENCE = "no_reference"  # compute: nothing to compare with yet (first call, after reset)
    SCHEDULE_SKIP = "schedule_skip"  # skip: a static schedule (DeepCache) says reuse
    SCHEDULE_COMPUTE = "schedule_compute"  # compute: a static schedule says refresh
    WARMUP = "warmup"  # compute: first executed steps of a run or an expert phase
    LAST_STEPS = "last_steps"  # compute: last executed steps of the run
    MAX_CACHED = "max_cached"  # compute: the branch already skipped max_cached times
    MAX_CONTINUOUS = "max_continuous"  # compute: max_continuous skips in a row reached
    ALTERNATING = "alternating"  # compute: only every other skip-eligible step may skip
    FOLLOW_LEADER = "follow_leader"  # either: the follower branch takes its leader's action
    NO_MODE = "no_mode"  # compute: no caching technique is enabled
    DRY_RUN = "dry_run"  # compute: the gate would have skipped, but the run is a dry run
    SCENE_CHANGE = "scene_change"  # compute: the latent jumped more than scene_guard since last step
    CONTROL_CHANGE = "control_change"  # compute: the conditioning changed more than ctrl_guard


@dataclass(frozen=True)
class Signals:
    """Scalars one model call produced, already reduced over the sequence-parallel group.

    Args:
        teacache: TeaCache signature, mean |block-0 modulated input| (or the time signal a
            coefficient profile was calibrated on).
        fbcache: FBCache value: a signature for the signature metrics, or the relative L1 change
            itself for `residual_tensor_rel_l1` (None there when the backend had no reference).
        latent_delta: relative L1 change of the latent since the previous step (None at the
            first step), read by the scene-change guard.
        control_delta: relative L1 change of the branch's conditioning since its previous call
            (None or 0 when it did not change), read by the control guard.
        reduce_error: the backend's reduction failed; the values are the local ones.
        reduced_over: how many shards the backend reduced over (checked against sp_world_size).
    """

    teacache: float | None = None
    fbcache: float | None = None
    latent_delta: float | None = None  # mean |x_t - x_prev| / mean |x_prev| (scene guard)
    control_delta: float | None = None  # mean |c - c_prev| / mean |c_prev| (control guard)
    reduce_error: bool = False
    reduced_over: int | None = None


class Note(StrEnum):
    """Something worth counting about a call's signal that changes no decision by itself."""

    PROFILE_BELOW_RANGE = "profile_below_range"  # a poly: profile evaluated below its fitted rel range
    PROFILE_ABOVE_RANGE = "profile_above_range"  # ... above it
    RESCALE_CLAMPED = "rescale_clamped"  # the rescaled change came out negative and was set to 0


class Vote(NamedTuple):
    """One technique's opinion on one call."""

    skip: bool
    reason: Reason
    rel: float | None = None
    rescaled: float | None = None
    accum: float | None = None
    notes: tuple[Note, ...] = ()
    threshold: float | None = None  # the one the accumulator was held against, all factors in


@dataclass(frozen=True)
class Decision:
    """The gate's answer for one model call.

    `resume_from_block` is where the middle blocks start when computing: the probe already ran
    blocks [0, resume_from_block) to produce its signal.
    """

    action: str
    reason: str
    branch: str
    step: int
    expert: str | None = None
    mode: str | None = None
    resume_from_block: int = 0
    rel: float | None = None
    rel_rescaled: float | None = None
    failsafe: FailSafe | None = None
    run: int = 0  # the CacheManager run it belongs to (a decision from an earlier run is stale)

    @property
    def skip(self) -> bool:
        return self.action == SKIP


class Applied(NamedTuple):
    """Result of CacheManager.apply: the tensor to continue with and the final decision.

    The seed's apply returns (x, resume_from_block); the decision is added because a guard may
    turn a skip into a compute, and the caller must then run the middle blocks.
    """

    x: object
    resume_from_block: int
    decision: Decision
    tail: tuple = ()  # on a skip with bn_ids: one residual per reused tail run, in order


def is_finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def threshold_vote(threshold: float, accum: float, rel: float, rescaled: float,
                   notes: tuple[Note, ...] = ()) -> Vote:
    """Skip while the accumulated change stays under the threshold; a threshold <= 0 never skips
    (an accumulator of 0, a signal that did not move, would otherwise skip)."""
    skip = threshold > 0 and accum < threshold
    return Vote(skip, Reason.BELOW_THRESHOLD if skip else Reason.ABOVE_THRESHOLD, rel, rescaled,
                accum, notes, threshold)


def relative_change(current: float, previous: float, eps: float) -> float:
    """|current - previous| / (|previous| + eps): the relative L1 change of a scalar signature."""
    return abs(current - previous) / (abs(previous) + eps)


@dataclass(frozen=True)
class SignatureState:
    """What a gate on a scalar signature keeps between calls (TeaCache, FBCache)."""

    prev_sig: float | None = None
    accum: float = 0.0
    ema_rel: float | None = None


StateT = TypeVar("StateT", bound=SignatureState)


def signature_change(state: StateT, signature: float | None,
                     eps: float) -> tuple[float | None, StateT, bool]:
    """Signature -> (rel or None when there is no previous signature, new state, invalid); a
    non-finite signature invalidates the state (a fresh one)."""
    if not is_finite(signature):
        return None, type(state)(), True
    if state.prev_sig is None:
        return None, replace(state, prev_sig=signature), False
    return relative_change(signature, state.prev_sig, eps), replace(state, prev_sig=signature), False


def smooth(rel: float, previous: float | None, ema: float) -> float:
    """Exponential smoothing of rel against the previous smoothed value (ema 0 = off)."""
    if previous is not None and ema > 0:
        return ema * previous + (1.0 - ema) * rel
    return rel

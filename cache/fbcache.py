"""FBCache (seed 001, plus First-Block-Cache's tensor metric): gate on how much an early,
cheap quantity changed between steps.

Metrics (the backend computes the on-device part and reduces it to one scalar):
  hidden_rel_l1           signature mean |mod_inp[::downsample]|, relative change, accumulated
  hidden_rel_l2           signature sqrt(mean mod_inp[::downsample]^2), relative change, accumulated
  residual_rel_l1         signature mean |(block0(x) - x)[::downsample]|, relative change, accumulated
  residual_tensor_rel_l1  mean |r1 - r1_ref| / mean |r1_ref| with r1 = block0(x) - x and r1_ref
                          the one stored at the last computed step (First-Block-Cache, cache-dit);
                          already a distance from the last refresh, so it is not accumulated
                          (unless `accumulate`: with forecast_gate it is one step's forecast error)
EMA (0 = off) smooths rel before the threshold: rel = ema * prev_rel + (1 - ema) * rel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .decision import Reason, SignatureState, Vote, is_finite, signature_change, smooth, threshold_vote
from .validate import ConfigError, check_choice, check_float, check_int

MODE = "fb"
SIGNAL_FIELD = "fbcache"
EPS = 1e-8

SIGNATURE_METRICS = ("hidden_rel_l1", "hidden_rel_l2", "residual_rel_l1")
TENSOR_METRICS = ("residual_tensor_rel_l1",)
METRICS = SIGNATURE_METRICS + TENSOR_METRICS
# Metrics that need block 0 run by the probe (so the stack resumes from block 1).
RESIDUAL_METRICS = ("residual_rel_l1", "residual_tensor_rel_l1")


@dataclass(frozen=True, kw_only=True)
class FBCacheConfig:
    threshold: float = 0.08
    metric: str = "hidden_rel_l1"
    downsample: int = 1
    ema: float = 0.0
    # Token saliency (seed 002): the tensor metric averages only over tokens whose own relative
    # change exceeds this, so a small moving region is not diluted by a static background (the
    # full mean when no token exceeds it); 0 = every token.
    saliency: float = 0.0
    # Sum the tensor metric over the reuse run instead of holding each value alone against the
    # threshold (issue 17): with forecast_gate each value is one reused step's forecast error,
    # and what the run adds to the final latent grows with their sum, not with the last one.
    accumulate: bool = False

    def __post_init__(self):
        check_float("FBCacheConfig", "threshold", self.threshold)
        check_choice("FBCacheConfig", "metric", self.metric, METRICS)
        check_int("FBCacheConfig", "downsample", self.downsample, minimum=1)
        check_float("FBCacheConfig", "ema", self.ema, below=1.0)
        check_float("FBCacheConfig", "saliency", self.saliency)
        if not isinstance(self.accumulate, bool):
            raise ConfigError(f"FBCacheConfig.accumulate must be True or False, got "
                              f"{self.accumulate!r}", field="FBCacheConfig.accumulate",
                              value=self.accumulate, expected="True or False")
        if self.saliency > 0 and self.metric not in TENSOR_METRICS:
            raise ConfigError(f"FBCacheConfig.saliency weights tokens of a tensor metric "
                              f"({', '.join(TENSOR_METRICS)}); metric {self.metric!r} is a scalar "
                              f"signature", field="FBCacheConfig.saliency", value=self.saliency)

    @property
    def needs_block0(self) -> bool:
        return self.metric in RESIDUAL_METRICS


@dataclass(frozen=True)
class FBCacheState(SignatureState):
    """Nothing beyond what every signature gate keeps."""


State = FBCacheState


def measure(config: FBCacheConfig, state: FBCacheState, value: float | None):
    """Signal -> (rel or None when there is no reference yet, new state, invalid)."""
    if config.metric in TENSOR_METRICS:
        if value is None:  # the backend had no reference residual to compare with
            return None, state, False
        return (value, state, False) if is_finite(value) and value >= 0 else (None, FBCacheState(), True)
    return signature_change(state, value, EPS)


def judge(config: FBCacheConfig, state: FBCacheState, rel: float | None, ctx):
    """rel -> (Vote, new state); (None, reset state) when the value is not finite."""
    if rel is None:
        return Vote(False, Reason.NO_REFERENCE), state
    rel = smooth(rel, state.ema_rel, config.ema)
    if not is_finite(rel):
        return None, FBCacheState()
    # CMConfig.step_weight: the step's size over the mean step (1 when off, x * 1.0 == x)
    weighted = rel * ctx.step_weight
    accum = weighted if config.metric in TENSOR_METRICS and not config.accumulate \
        else state.accum + weighted
    return (threshold_vote(config.threshold * ctx.threshold_scale, accum, rel, weighted),
            replace(state, accum=accum, ema_rel=rel))


def refresh(state: FBCacheState) -> FBCacheState:
    return replace(state, accum=0.0)

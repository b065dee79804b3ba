"""CMConfig: the one validated, immutable configuration of the gate for a run.

Every default lives in a dataclass here or in a technique's config; the CLI and presets only map
onto these fields. A technique is enabled by giving its config (None = off).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

from . import deepcache, fbcache, magcache, noise_adapt, teacache
from .decision import PAIR
from .deepcache import DeepCacheConfig
from .fbcache import FBCacheConfig
from .limits import LimitsConfig
from .magcache import MagCacheConfig
from .teacache import TeaCacheConfig
from .validate import ConfigError, check_choice, check_float, check_int

# mode name -> (technique module, CMConfig field, config class)
TECHNIQUES = {
    fbcache.MODE: (fbcache, "fbcache", FBCacheConfig),
    teacache.MODE: (teacache, "teacache", TeaCacheConfig),
    magcache.MODE: (magcache, "magcache", MagCacheConfig),
    deepcache.MODE: (deepcache, "deepcache", DeepCacheConfig),
}

# How the two CFG branches of a step relate:
#   cond_authoritative  the follower (uncond) takes the leader's (cond) action of the same step;
#                       with cfg_sep_diff it still measures its own signal (seed 001 default)
#   separate            each branch decides from its own signal and state (seed 002)
#   shared_diff         each branch decides with its own accumulator, fed the leader's rel
#   fused               cond and uncond arrive in one call; their rels are combined by pair_reduce
CFG_MODES = ("cond_authoritative", "separate", "shared_diff", "fused")
PAIR_REDUCE = ("max", "mean")
# Where cached residuals live: on the compute device, on the host, or on the device until its
# memory use passes offload_watermark, then on the host for the rest of the run.
OFFLOAD = ("gpu", "cpu", "auto")


@dataclass(frozen=True, kw_only=True)
class CMConfig:
    teacache: TeaCacheConfig | None = None
    fbcache: FBCacheConfig | None = None
    deepcache: DeepCacheConfig | None = None
    magcache: MagCacheConfig | None = None
    evaluation_order: tuple[str, ...] = ("fb", "tc", "mc", "dc")  # first skip-eligible mode wins
    warmup: int = 1  # executed steps that always compute, at the start of the run and of each expert
    last_steps: int = 1  # executed steps that always compute at the end of the run
    cfg_mode: str = "cond_authoritative"
    cfg_sep_diff: bool = False
    cfg_compute_first: bool = False  # uncond runs first in each step and leads the pair
    pair_reduce: str = "max"
    # Probe blocks (Fn) run before the decision; None = what the metric needs (1 for residual
    # metrics, else 0). Tail blocks (Bn) run on every call; None = 1 with DeepCache (seed 003), else 0.
    fn_blocks: int | None = None
    bn_blocks: int | None = None
    # Of the Bn tail blocks, the ones (indices in [0, Bn)) that run on reuse steps; each run of
    # the others adds its own residual stored at the last compute (seed 002 bn_ids, as cache-dit's
    # Bn_compute_blocks_ids). Empty = every tail block runs.
    bn_ids: tuple[int, ...] = ()
    # Control guard (seed 002): compute whenever a branch's conditioning changed by more than this
    # relative L1 since its last call (a new image latent mid-run); 0 = off.
    ctrl_guard: float = 0.0
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    offload: str = "auto"
    offload_watermark: float = 0.9  # fraction of device memory in use that sends caches to the host
    noise_adapt: str = "none"  # threshold factor over the schedule: none, linear, table:<name>
    # On reuse, forecast the residual from the last forecast + 1 computed ones (1 linear,
    # 2 quadratic, Taylor-style); 0 reuses the last one as is. Pair with limits.max_continuous.
    forecast: int = 0
    # Forecast-aware reuse (issue 17): the FBCache tensor metric compares block 0's residual with
    # its own forecast (the same order and weights as the reused residual's) instead of the last
    # computed one, so reuse goes on while the forecast's error stays under the threshold, not
    # while the raw change does. Needs forecast >= 1 and metric residual_tensor_rel_l1.
    forecast_gate: bool = False
    # Order 2 only while the gap since the last compute is at most this many times the spacing of
    # the last two computes (longer gaps forecast linearly); None = always the highest order.
    forecast_reach: float | None = None
    # Remodulated reuse: the middle's residual is kept as the part no time gate scales and, per
    # time gate its blocks share, the sum of the outputs that gate scales; a reuse step rebuilds
    # it with its own step's gates (forecasting each part as `forecast` says). What a per-module
    # TaylorSeer gets by caching every block's sub-layers, at 3 tensors a branch instead of 3 a
    # block. Needs a model whose blocks share one time term in their gates (the Wan2.2 family).
    remodulate: bool = False
    # Step-size weighting (issue 17): FBCache's metric of each call is multiplied by
    # (|sigma_i - sigma_i+1| / mean step)^step_weight before the threshold (and the run's sum,
    # with accumulate). An output error made on step i moves the latent by about the step's
    # size, and with a shifted schedule late steps are ~20x the early ones, so an equal forecast
    # error weighs far more late. Needs the schedule (CacheManager.set_schedule, which the
    # sampling loop calls); without one every weight is 1. 0 = off.
    step_weight: float = 0.0
    dry_run: bool = False  # decide and record, but always compute (calibration, seed 002)
    # Scene-change guard (seed 002): compute whenever the latent moved more than this relative L1
    # since the previous step (a cut, a new condition); 0 = off.
    scene_guard: float = 0.0

    def __post_init__(self):
        for _, name, cls in TECHNIQUES.values():
            value = getattr(self, name)
            if value is not None and not isinstance(value, cls):
                raise ConfigError(f"CMConfig.{name} must be a {cls.__name__} or None, "
                                  f"got {type(value).__name__}")
        if not isinstance(self.limits, LimitsConfig):
            raise ConfigError(f"CMConfig.limits must be a LimitsConfig, "
                              f"got {type(self.limits).__name__}")
        if not isinstance(self.evaluation_order, list | tuple):
            raise ConfigError(f"CMConfig.evaluation_order must list distinct modes among "
                              f"{', '.join(TECHNIQUES)}, got {self.evaluation_order!r}")
        order = tuple(self.evaluation_order)
        object.__setattr__(self, "evaluation_order", order)
        unknown = [m for m in order if m not in TECHNIQUES]
        if unknown or len(set(order)) != len(order):
            raise ConfigError(f"CMConfig.evaluation_order must list distinct modes among "
                              f"{', '.join(TECHNIQUES)}, got {order!r}")
        missing = [m for m, (_, name, _) in TECHNIQUES.items()
                   if getattr(self, name) is not None and m not in order]
        if missing:
            raise ConfigError(f"CMConfig.evaluation_order {order!r} leaves out enabled mode(s) "
                              f"{missing}; add them")
        check_int("CMConfig", "warmup", self.warmup)
        check_int("CMConfig", "last_steps", self.last_steps)
        check_choice("CMConfig", "cfg_mode", self.cfg_mode, CFG_MODES)
        check_choice("CMConfig", "pair_reduce", self.pair_reduce, PAIR_REDUCE)
        check_choice("CMConfig", "offload", self.offload, OFFLOAD)
        check_float("CMConfig", "offload_watermark", self.offload_watermark)
        if self.offload_watermark > 1.0:
            raise ConfigError(f"CMConfig.offload_watermark is a fraction of device memory in "
                              f"[0, 1], got {self.offload_watermark!r}",
                              field="CMConfig.offload_watermark", value=self.offload_watermark,
                              expected="a fraction of device memory in [0, 1]")
        check_int("CMConfig", "fn_blocks", self.fn_blocks, allow_none=True)
        check_int("CMConfig", "bn_blocks", self.bn_blocks, allow_none=True)
        if self.fn_blocks == 0 and self.fbcache is not None and self.fbcache.needs_block0:
            raise ConfigError(f"FBCache metric {self.fbcache.metric!r} needs block 0 in the probe; "
                              f"set fn_blocks >= 1 or leave it unset", field="CMConfig.fn_blocks",
                              value=0, expected=f">= 1 (the {self.fbcache.metric} metric reads "
                              "block 0) or unset")
        self._check_bn_ids()
        try:
            noise_adapt.check(self.noise_adapt)
        except ConfigError as exc:
            raise ConfigError(str(exc), field="CMConfig.noise_adapt", value=self.noise_adapt) from None
        check_float("CMConfig", "scene_guard", self.scene_guard)
        check_float("CMConfig", "ctrl_guard", self.ctrl_guard)
        check_int("CMConfig", "forecast", self.forecast)
        if self.forecast > 2:
            raise ConfigError(f"CMConfig.forecast is the forecasting order 0, 1 or 2; got {self.forecast}")
        if self.forecast_reach is not None:
            check_float("CMConfig", "forecast_reach", self.forecast_reach)
        check_float("CMConfig", "step_weight", self.step_weight)
        if self.step_weight > 0 and self.fbcache is None:
            raise ConfigError("CMConfig.step_weight weights FBCache's metric by the step size; "
                              "it needs FBCache enabled", field="CMConfig.step_weight",
                              value=self.step_weight, expected="0, or FBCache enabled")
        for name in ("cfg_sep_diff", "cfg_compute_first", "dry_run", "forecast_gate", "remodulate"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"CMConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.forecast_gate and (self.forecast < 1 or self.fbcache is None
                                   or self.fbcache.metric not in fbcache.TENSOR_METRICS):
            raise ConfigError(
                "CMConfig.forecast_gate compares block 0's residual with its forecast: it needs "
                f"forecast >= 1 (got {self.forecast}) and FBCache with metric "
                f"{fbcache.TENSOR_METRICS[0]} (got "
                f"{None if self.fbcache is None else self.fbcache.metric!r})",
                field="CMConfig.forecast_gate", value=True,
                expected=f"--forecast 1 or 2 with --fb_metric {fbcache.TENSOR_METRICS[0]}")

    def _check_bn_ids(self) -> None:
        ids = self.bn_ids
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise ConfigError(f"CMConfig.bn_ids must be a sequence of tail-block indices, got {ids!r}")
        ids = tuple(ids)
        for i in ids:
            check_int("CMConfig", "bn_ids entry", i)
        bn = self.tail_blocks
        if ids and bn == 0:
            raise ConfigError(f"CMConfig.bn_ids {ids} selects tail blocks but there are none; "
                              f"set bn_blocks >= {max(ids) + 1}", field="CMConfig.bn_ids",
                              value=ids, expected=f"no tail-block ids, or bn_blocks >= {max(ids) + 1}")
        bad = [i for i in ids if i >= bn]
        if bad or len(set(ids)) != len(ids):
            raise ConfigError(f"CMConfig.bn_ids must be distinct indices in [0, {bn}) of the tail "
                              f"window (bn_blocks={bn}), got {ids}", field="CMConfig.bn_ids",
                              value=ids, expected=f"distinct indices in [0, {bn}) (bn_blocks {bn})")
        object.__setattr__(self, "bn_ids", tuple(sorted(ids)))

    @cached_property
    def tail_runs(self) -> tuple[tuple[int, int], ...]:
        """Runs [start, stop) of tail-window indices that reuse their own residual on a reuse
        step (empty without bn_ids). The gate keeps one residual per run."""
        if not self.bn_ids:
            return ()
        runs, start = [], None
        for i in range(self.tail_blocks + 1):
            reused = i < self.tail_blocks and i not in self.bn_ids
            if reused and start is None:
                start = i
            elif not reused and start is not None:
                runs.append((start, i))
                start = None
        return tuple(runs)

    @cached_property
    def modes(self) -> tuple[str, ...]:
        """Enabled modes in evaluation order."""
        return tuple(m for m in self.evaluation_order if getattr(self, TECHNIQUES[m][1]) is not None)

    @cached_property
    def enabled(self) -> bool:
        return bool(self.modes)

    def technique(self, mode: str):
        """(module, config) of an enabled mode."""
        module, name, _ = TECHNIQUES[mode]
        return module, getattr(self, name)

    @cached_property
    def probe_blocks(self) -> int:
        """Blocks the probe runs before the decision (Fn); the stack resumes after them."""
        if self.fn_blocks is not None:
            return self.fn_blocks
        return 1 if self.fbcache is not None and self.fbcache.needs_block0 else 0

    @cached_property
    def tail_blocks(self) -> int:
        """Blocks (Bn) that run after the cached middle on every call, before the head."""
        if self.bn_blocks is not None:
            return self.bn_blocks
        return 1 if self.deepcache is not None else 0

    @cached_property
    def needs_signals(self) -> tuple[str, ...]:
        """Signals fields the backend must fill on every call; empty for schedule-only configs."""
        fields = tuple(TECHNIQUES[m][0].SIGNAL_FIELD for m in self.modes
                       if TECHNIQUES[m][0].SIGNAL_FIELD is not None)
        return fields + (("latent_delta",) if self.scene_guard > 0 and self.enabled else ())

    @cached_property
    def leader(self) -> str:
        if self.cfg_mode == "fused":
            return PAIR
        return "uncond" if self.cfg_compute_first else "cond"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

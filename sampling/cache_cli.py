"""The gate's flags on the command line: the parser's arguments, and the typed `CacheFlags` a
command builds from what they parsed (the one place a Namespace becomes the gate's settings;
`cache/flags.py` maps those onto CMConfig)."""

from __future__ import annotations

import argparse
import dataclasses

from cache import CMConfig
from cache.config import CFG_MODES, OFFLOAD, PAIR_REDUCE, TECHNIQUES
from cache.deepcache import DeepCacheConfig
from cache.fbcache import METRICS, FBCacheConfig
from cache.flags import CACHE_TYPES, CacheFlags
from cache.magcache import MagCacheConfig
from cache.preset import PRESETS
from cache.teacache import LINEAR_THRESHOLD, TeaCacheConfig
from cache.teacache_profiles import PROFILES, SIGNALS

from .cli import typed


def cache_flags(args: argparse.Namespace) -> CacheFlags:
    """The cache flags of a parsed command line (every parser that took add_cache_arguments);
    appended aliases as tuples."""
    return typed(CacheFlags, args)


def _default(cls, name):
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _order(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _limits(text: str) -> dict[str, int]:
    """Seed 002's --teacache_limits 'max_cached=N,max_continuous=M'."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in ("max_cached", "max_continuous") or not value.strip().lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(
                f"expected max_cached=<int>,max_continuous=<int>, got {text!r}")
        out[key] = int(value)
    return out


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    def d(cls, name):
        return f"(default {_default(cls, name)})"

    g = parser.add_argument_group("caching: technique selection")
    g.add_argument("--preset", choices=PRESETS, help="a named starting point (cache/presets/*.json); "
                   "explicit flags override its fields")
    g.add_argument("--enable_cache", action="store_true",
                   help="enable caching with --cache_type")
    g.add_argument("--cache_type", choices=CACHE_TYPES, default=None,
                   help="technique for --enable_cache (default deepcache)")
    g.add_argument("--teacache", action="store_true", help="enable TeaCache")
    g.add_argument("--fbcache", action="store_true", help="enable FBCache")
    g.add_argument("--deepcache", action="store_true", help="enable the DeepCache schedule")
    g.add_argument("--magcache", action="store_true",
                   help="enable MagCache (needs --magcache_profile)")

    g = parser.add_argument_group("caching: DeepCache schedule")
    g.add_argument("--cache_start_step", type=int, help=d(DeepCacheConfig, "start"))
    g.add_argument("--cache_end_step", type=int, help=d(DeepCacheConfig, "end"))
    g.add_argument("--cache_step_interval", type=int, help=d(DeepCacheConfig, "interval"))
    g.add_argument("--cache_steps", type=_ids,
                   help="comma-separated steps that compute (a schedule chosen offline, such as "
                        "budgeted mode's static schedules); replaces start, end and interval")

    g = parser.add_argument_group("caching: TeaCache")
    g.add_argument("--teacache_thresh", type=float, help="(default: a poly profile's own threshold, "
                   f"else {LINEAR_THRESHOLD})")
    g.add_argument("--teacache_policy", help="linear or poly:<profile>; profiles: "
                   + ", ".join(sorted(PROFILES)))
    g.add_argument("--teacache_signal", choices=SIGNALS,
                   help="what the signature summarises (default: the profile's, else modulated_input)")
    g.add_argument("--teacache_ema", type=float, help=d(TeaCacheConfig, "ema") + "; smooths rel")
    g.add_argument("--teacache_relative", type=_bool,
                   help="true: --teacache_thresh counts multiples of the mean change the signal "
                        "showed so far (its own scale; the presets' unit), false: absolute units "
                        + d(TeaCacheConfig, "relative"))

    g = parser.add_argument_group("caching: FBCache")
    g.add_argument("--fb_thresh", type=float, help=d(FBCacheConfig, "threshold"))
    g.add_argument("--fb_metric", choices=METRICS, help=d(FBCacheConfig, "metric"))
    g.add_argument("--fb_downsample", type=int, help=d(FBCacheConfig, "downsample"))
    g.add_argument("--fb_ema", type=float, help=d(FBCacheConfig, "ema"))
    g.add_argument("--fb_saliency", "--teacache_saliency", dest="fb_saliency", type=float,
                   help="average the residual_tensor_rel_l1 metric over tokens whose own relative "
                        "change exceeds this " + d(FBCacheConfig, "saliency"))
    g.add_argument("--fb_accumulate", type=_bool,
                   help="true: sum the residual_tensor_rel_l1 metric over a reuse run (with "
                        "--forecast_gate, the forecast errors of the run's steps) "
                        + d(FBCacheConfig, "accumulate"))

    g = parser.add_argument_group("caching: MagCache")
    g.add_argument("--magcache_profile", help="a profile of python calibrate.py --out, whose "
                   "magcache block holds the model's magnitude ratios")
    g.add_argument("--mag_thresh", type=float, help=d(MagCacheConfig, "threshold")
                   + "; the drift the ratios predict that a reuse run may accumulate")
    g.add_argument("--mag_max_skip", type=int, help=d(MagCacheConfig, "max_skip")
                   + "; steps reused in a row at most (K)")
    g.add_argument("--mag_retention", type=float, help=d(MagCacheConfig, "retention")
                   + "; the fraction of the steps, from the start, that always compute")

    g = parser.add_argument_group("caching: lifecycle, CFG pairs, limits, structure, offload")
    g.add_argument("--cache_warmup", "--teacache_warmup", "--fb_warmup", dest="cache_warmup",
                   type=int, action="append", help=d(CMConfig, "warmup"))
    g.add_argument("--cache_last_steps", "--teacache_last_steps", "--fb_last_steps",
                   dest="cache_last_steps", type=int, action="append", help=d(CMConfig, "last_steps"))
    g.add_argument("--cfg_mode", "--teacache_cfg_mode", dest="cfg_mode", choices=CFG_MODES,
                   help=d(CMConfig, "cfg_mode"))
    g.add_argument("--cfg_sep_diff", "--teacache_cfg_sep_diff", "--fb_cfg_sep_diff",
                   dest="cfg_sep_diff", type=_bool, action="append", help=d(CMConfig, "cfg_sep_diff"))
    g.add_argument("--cfg_compute_first", "--teacache_cfg_first", dest="cfg_compute_first",
                   type=_bool, help=d(CMConfig, "cfg_compute_first"))
    g.add_argument("--pair_reduce", choices=PAIR_REDUCE, help=d(CMConfig, "pair_reduce"))
    g.add_argument("--evaluation_order", type=_order, help="comma-separated modes among "
                   + ",".join(TECHNIQUES) + f" {d(CMConfig, 'evaluation_order')}")
    g.add_argument("--max_cached", type=int, help="skips allowed per branch; negative = no cap (default)")
    g.add_argument("--max_continuous", type=int, help="skips allowed in a row; negative = no cap (default)")
    g.add_argument("--teacache_limits", type=_limits, help="max_cached=N,max_continuous=M")
    g.add_argument("--alternating", "--teacache_alternating", dest="alternating",
                   action="store_true", default=None, help="only every other eligible step may skip")
    g.add_argument("--fn_blocks", type=int, help="probe blocks (default: what the metric needs)")
    g.add_argument("--bn_blocks", "--teacache_bn", dest="bn_blocks", type=int,
                   help="tail blocks run on every step (default 1 with DeepCache, else 0)")
    g.add_argument("--bn_ids", "--teacache_bn_ids", dest="bn_ids", type=_ids,
                   help="comma-separated tail blocks (indices in [0, Bn)) that run on reuse steps; "
                        "the others reuse their own residual (default: all run)")
    g.add_argument("--ctrl_guard", "--teacache_ctrl_guard", dest="ctrl_guard", type=float,
                   help="compute when a branch's conditioning changed by more than this relative "
                        "L1 since its last call " + d(CMConfig, "ctrl_guard") + "; 0 = off")
    g.add_argument("--cache_offload", "--teacache_offload", dest="cache_offload", choices=OFFLOAD,
                   help=d(CMConfig, "offload"))
    g.add_argument("--offload_watermark", type=float, help=d(CMConfig, "offload_watermark"))
    g.add_argument("--noise_adapt", "--teacache_noise_adapt", dest="noise_adapt",
                   help="threshold factor over the schedule: none, linear (1.5 -> 0.5) or "
                        "table:<name> " + d(CMConfig, "noise_adapt"))
    g.add_argument("--forecast", "--teacache_forecast", dest="forecast", type=int, choices=(0, 1, 2),
                   help="on reuse, extrapolate the residual from the last 2 (1) or 3 (2) computed "
                        "ones " + d(CMConfig, "forecast"))
    def field_flag(name: str, kind, text: str) -> None:
        """--<name> sets CMConfig.<name>; its help ends with the field's default."""
        g.add_argument(f"--{name}", type=kind, help=f"{text} {d(CMConfig, name)}")

    field_flag("forecast_gate", _bool, "with --forecast and --fb_metric residual_tensor_rel_l1: compare "
               "block 0's residual with its forecast, so reuse goes on while the forecast's error "
               "stays under --fb_thresh")
    field_flag("forecast_reach", float, "forecast with order 2 only while the gap since the last compute "
               "is at most this many times the spacing of the last two, else linearly")
    field_flag("remodulate", _bool, "keep the middle's residual split by the time gates its blocks share "
               "and rebuild it on reuse with the step's own gates (Wan2.2 family; 3 tensors a branch "
               "instead of 1)")
    field_flag("step_weight", float, "weigh FBCache's metric of each step by (step size / mean step size) "
               "to this power, so a late (large) step's error counts more; 0 = off")
    g.add_argument("--scene_guard", "--teacache_scene_guard", dest="scene_guard", type=float,
                   help="compute when the latent's relative L1 change since the last step exceeds "
                        "this " + d(CMConfig, "scene_guard") + "; 0 = off")
    g.add_argument("--dry_run", "--teacache_dry_run", dest="dry_run", action="store_true",
                   default=None, help="decide and record every call but always compute "
                   "(prospective decisions, for calibration)")

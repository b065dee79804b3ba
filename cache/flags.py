"""Command-line flags of the gate, mapped onto CMConfig.

Flag names follow the seeds (000: --teacache*, 001: --fbcache/--fb_*, 002: CFG and limits,
003: --enable_cache/--cache_*_step). Every flag defaults to None, so an unset flag leaves the
dataclass default in force: the defaults live in the config classes and nowhere else.
"""

from __future__ import annotations

import argparse
import dataclasses

from .config import CFG_MODES, OFFLOAD, PAIR_REDUCE, TECHNIQUES, CMConfig
from .deepcache import DeepCacheConfig
from .fbcache import METRICS, FBCacheConfig
from .limits import LimitsConfig
from .magcache import MagCacheConfig
from .magcache import make as make_magcache
from .preset import PRESETS, TECHNIQUE_KEYS, load_preset
from .teacache import LINEAR_THRESHOLD, TeaCacheConfig
from .teacache_profiles import PROFILES, SIGNALS
from .validate import ConfigError, present

CACHE_TYPES = ("deepcache", "teacache", "fbcache", "magcache")


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


def _limits(text: str) -> dict:
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


# config field -> (flag, argparse dest) of the flag that sets it: a refused value is reported
# under the flag the user typed, not the dataclass field.
FIELD_FLAGS = {
    "DeepCacheConfig.start": ("--cache_start_step", "cache_start_step"),
    "DeepCacheConfig.end": ("--cache_end_step", "cache_end_step"),
    "DeepCacheConfig.interval": ("--cache_step_interval", "cache_step_interval"),
    "DeepCacheConfig.steps": ("--cache_steps", "cache_steps"),
    "TeaCacheConfig.threshold": ("--teacache_thresh", "teacache_thresh"),
    "TeaCacheConfig.policy": ("--teacache_policy", "teacache_policy"),
    "TeaCacheConfig.signal": ("--teacache_signal", "teacache_signal"),
    "TeaCacheConfig.ema": ("--teacache_ema", "teacache_ema"),
    "TeaCacheConfig.relative": ("--teacache_relative", "teacache_relative"),
    "FBCacheConfig.threshold": ("--fb_thresh", "fb_thresh"),
    "FBCacheConfig.metric": ("--fb_metric", "fb_metric"),
    "FBCacheConfig.downsample": ("--fb_downsample", "fb_downsample"),
    "FBCacheConfig.ema": ("--fb_ema", "fb_ema"),
    "FBCacheConfig.saliency": ("--fb_saliency", "fb_saliency"),
    "FBCacheConfig.accumulate": ("--fb_accumulate", "fb_accumulate"),
    "MagCacheConfig.profile": ("--magcache_profile", "magcache_profile"),
    "MagCacheConfig.threshold": ("--mag_thresh", "mag_thresh"),
    "MagCacheConfig.max_skip": ("--mag_max_skip", "mag_max_skip"),
    "MagCacheConfig.retention": ("--mag_retention", "mag_retention"),
    "CMConfig.warmup": ("--cache_warmup", "cache_warmup"),
    "CMConfig.last_steps": ("--cache_last_steps", "cache_last_steps"),
    "CMConfig.evaluation_order": ("--evaluation_order", "evaluation_order"),
    "CMConfig.fn_blocks": ("--fn_blocks", "fn_blocks"),
    "CMConfig.bn_blocks": ("--bn_blocks", "bn_blocks"),
    "CMConfig.bn_ids": ("--bn_ids", "bn_ids"),
    "CMConfig.ctrl_guard": ("--ctrl_guard", "ctrl_guard"),
    "CMConfig.offload_watermark": ("--offload_watermark", "offload_watermark"),
    "CMConfig.noise_adapt": ("--noise_adapt", "noise_adapt"),
    "CMConfig.forecast": ("--forecast", "forecast"),
    "CMConfig.forecast_gate": ("--forecast_gate", "forecast_gate"),
    "CMConfig.forecast_reach": ("--forecast_reach", "forecast_reach"),
    "CMConfig.remodulate": ("--remodulate", "remodulate"),
    "CMConfig.step_weight": ("--step_weight", "step_weight"),
    "CMConfig.scene_guard": ("--scene_guard", "scene_guard"),
}
TECHNIQUE_CLASSES = {"deepcache": "DeepCacheConfig", "teacache": "TeaCacheConfig",
                     "fbcache": "FBCacheConfig", "magcache": "MagCacheConfig"}


def _flag_value(args, dest):
    value = getattr(args, dest, None)
    return value[0] if isinstance(value, list) and value else value


def _as_flag_error(exc: ConfigError, args) -> ConfigError:
    """The same refusal, named after the flag that set the value (when a flag did)."""
    flag, dest = FIELD_FLAGS.get(exc.field, (None, None))
    value = _flag_value(args, dest) if dest else None
    if flag is None or value is None:
        return exc
    shown = ",".join(map(str, value)) if isinstance(value, tuple) else value
    if exc.expected is not None:
        return ConfigError(f"{flag} {shown}: expected {exc.expected} ({exc.field})",
                           field=exc.field, value=value, expected=exc.expected)
    return ConfigError(f"{flag} {shown}: {exc}", field=exc.field, value=value)


def _single(args, name: str, flag: str):
    """Aliases append to one list; they must agree."""
    values = getattr(args, name)
    if not values:
        return None
    if len(set(values)) > 1:
        raise ConfigError(f"{flag} and its aliases were given different values {values}; give one")
    return values[0]


def _given(**kwargs) -> dict:
    return {k: v for k, v in kwargs.items() if v is not None}


def config_from_args(args: argparse.Namespace, fields: dict | None = None) -> CMConfig:
    """Build the CMConfig the flags describe; ConfigError names the offending flag. `fields`, a
    partial CMConfig in the presets' format (budgeted mode's choice), stands where a preset
    would: explicit flags override it field by field."""
    try:
        return _config_from_args(args, fields)
    except ConfigError as exc:
        raise _as_flag_error(exc, args) from None


def config_from_fields(fields: dict) -> CMConfig:
    """The CMConfig of a partial configuration in the presets' format, with no flags given;
    ConfigError naming the key when its shape is not that format (the configs check values)."""
    _check_shape(fields)
    parser = argparse.ArgumentParser(add_help=False)
    add_cache_arguments(parser)
    return _config_from_args(parser.parse_args([]), fields)


SECTIONS = {"deepcache": DeepCacheConfig, "teacache": TeaCacheConfig, "fbcache": FBCacheConfig,
            "magcache": MagCacheConfig, "limits": LimitsConfig}


def _check_shape(fields) -> None:
    """A partial CMConfig is an object; its technique and limits entries objects of their
    config's fields (top-level names are checked where the CMConfig is built)."""
    if not isinstance(fields, dict):
        raise ConfigError(f"a configuration is an object of CMConfig fields, got "
                          f"{type(fields).__name__} {fields!r:.60}")
    for key, cls, value in present(SECTIONS, fields):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} {value!r:.60}: expected an object of {cls.__name__} fields")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in value if k not in known)
        if unknown:
            raise ConfigError(f"{key} sets unknown fields {unknown!r:.80}; expected fields of "
                              f"{cls.__name__}: {', '.join(sorted(known))}")


def _config_from_args(args: argparse.Namespace, fields: dict | None = None) -> CMConfig:
    if fields is not None:
        preset = fields
    else:
        preset = load_preset(args.preset) if getattr(args, "preset", None) else {}
    cache_type = args.cache_type or ("deepcache" if args.enable_cache and not preset else None)
    if args.cache_type is not None and not args.enable_cache:
        raise ConfigError("--cache_type needs --enable_cache")
    on = {
        "deepcache": args.deepcache or cache_type == "deepcache" or "deepcache" in preset,
        "teacache": args.teacache or cache_type == "teacache" or "teacache" in preset,
        "fbcache": args.fbcache or cache_type == "fbcache" or "fbcache" in preset,
        "magcache": args.magcache or cache_type == "magcache" or "magcache" in preset,
    }
    specific = {  # technique -> {config field: (flag, value)}
        name: {field.split(".")[1]: (flag, getattr(args, dest))
               for field, (flag, dest) in FIELD_FLAGS.items() if field.startswith(cls + ".")}
        for name, cls in TECHNIQUE_CLASSES.items()}
    classes = {"deepcache": DeepCacheConfig, "teacache": TeaCacheConfig, "fbcache": FBCacheConfig,
               "magcache": make_magcache}  # MagCache reads its ratios from the profile file
    techniques = {}
    for name, fields in specific.items():
        given = {k: v for k, (_, v) in fields.items() if v is not None}
        pattern = sorted(k for k in ("start", "end", "interval") if k in given)
        if "steps" in given and pattern:
            raise ConfigError(f"--cache_steps names the computed steps; "
                              f"{', '.join(fields[k][0] for k in pattern)} would be ignored: "
                              "give one or the other")
        if given and not on[name]:
            flags = ", ".join(fields[k][0] for k in given)
            raise ConfigError(f"{flags} given but {name} is not enabled; add --{name} "
                              f"(or --enable_cache --cache_type {name})")
        techniques[name] = classes[name](**{**preset.get(name, {}), **given}) if on[name] else None

    limit_values = dict(preset.get("limits", {}))
    limit_values.update(args.teacache_limits or {})
    limit_values.update(_given(max_cached=args.max_cached, max_continuous=args.max_continuous))
    # cache-dit's convention, which users bring along: a negative cap means no cap.
    limit_values = {k: (None if isinstance(v, int) and not isinstance(v, bool) and v < 0 else v)
                    for k, v in limit_values.items()}
    limit_values.update(_given(alternating=args.alternating))
    top = {k: v for k, v in preset.items() if k not in (*TECHNIQUE_KEYS, "limits")}
    unknown = sorted(set(top) - {f.name for f in dataclasses.fields(CMConfig)})
    if unknown:
        source = f"preset {args.preset!r}" if fields is None else "the configuration"
        raise ConfigError(f"{source} sets unknown fields {unknown}")
    return CMConfig(
        **techniques,
        limits=LimitsConfig(**limit_values),
        **{**top, **_given(
            warmup=_single(args, "cache_warmup", "--cache_warmup"),
            last_steps=_single(args, "cache_last_steps", "--cache_last_steps"),
            cfg_mode=args.cfg_mode,
            cfg_sep_diff=_single(args, "cfg_sep_diff", "--cfg_sep_diff"),
            cfg_compute_first=args.cfg_compute_first,
            pair_reduce=args.pair_reduce,
            evaluation_order=args.evaluation_order,
            fn_blocks=args.fn_blocks,
            bn_blocks=args.bn_blocks,
            offload=args.cache_offload,
            offload_watermark=args.offload_watermark,
            noise_adapt=args.noise_adapt,
            dry_run=args.dry_run,
            forecast=args.forecast,
            forecast_gate=args.forecast_gate,
            forecast_reach=args.forecast_reach,
            remodulate=args.remodulate,
            step_weight=args.step_weight,
            scene_guard=args.scene_guard,
            bn_ids=args.bn_ids,
            ctrl_guard=args.ctrl_guard,
        )},
    )

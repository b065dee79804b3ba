"""The gate's settings as the command line names them, mapped onto CMConfig.

Flag names follow the seeds (000: --teacache*, 001: --fbcache/--fb_*, 002: CFG and limits,
003: --enable_cache/--cache_*_step). `CacheFlags` holds what the flags gave, typed and frozen
(the command line's parser, `sampling/cache_cli.py`, builds one at the edge; the gate never sees
argparse). Every field defaults to None, so an unset flag leaves the dataclass default in force:
the defaults live in the config classes and nowhere else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .config import CMConfig
from .deepcache import DeepCacheConfig
from .fbcache import FBCacheConfig
from .limits import LimitsConfig
from .magcache import MagCacheConfig
from .magcache import make as make_magcache
from .preset import TECHNIQUE_KEYS, load_preset
from .teacache import TeaCacheConfig
from .validate import ConfigError, present

CACHE_TYPES = ("deepcache", "teacache", "fbcache", "magcache")


@dataclass(frozen=True, kw_only=True)
class CacheFlags:
    """The cache flags as given: one field per flag (its argparse dest), None where not given.
    Aliases that append (`--cache_warmup`/`--teacache_warmup`/`--fb_warmup`, ...) hold every
    value given, which must agree."""

    preset: str | None = None
    enable_cache: bool = False
    cache_type: str | None = None
    teacache: bool = False
    fbcache: bool = False
    deepcache: bool = False
    magcache: bool = False
    cache_start_step: int | None = None
    cache_end_step: int | None = None
    cache_step_interval: int | None = None
    cache_steps: tuple[int, ...] | None = None
    teacache_thresh: float | None = None
    teacache_policy: str | None = None
    teacache_signal: str | None = None
    teacache_ema: float | None = None
    teacache_relative: bool | None = None
    fb_thresh: float | None = None
    fb_metric: str | None = None
    fb_downsample: int | None = None
    fb_ema: float | None = None
    fb_saliency: float | None = None
    fb_accumulate: bool | None = None
    magcache_profile: str | None = None
    mag_thresh: float | None = None
    mag_max_skip: int | None = None
    mag_retention: float | None = None
    cache_warmup: tuple[int, ...] | None = None
    cache_last_steps: tuple[int, ...] | None = None
    cfg_mode: str | None = None
    cfg_sep_diff: tuple[bool, ...] | None = None
    cfg_compute_first: bool | None = None
    pair_reduce: str | None = None
    evaluation_order: tuple[str, ...] | None = None
    max_cached: int | None = None
    max_continuous: int | None = None
    # {max_cached, max_continuous: cap}; a dict, as a batch's request ids have always hashed it
    teacache_limits: dict[str, int] | None = None
    alternating: bool | None = None
    fn_blocks: int | None = None
    bn_blocks: int | None = None
    bn_ids: tuple[int, ...] | None = None
    ctrl_guard: float | None = None
    cache_offload: str | None = None
    offload_watermark: float | None = None
    noise_adapt: str | None = None
    forecast: int | None = None
    forecast_gate: bool | None = None
    forecast_reach: float | None = None
    remodulate: bool | None = None
    step_weight: float | None = None
    scene_guard: float | None = None
    dry_run: bool | None = None


# flags whose aliases append to one tuple (every value given)
APPENDED = ("cache_warmup", "cache_last_steps", "cfg_sep_diff")


# config field -> (flag, CacheFlags field) of the flag that sets it: a refused value is reported
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


def _flag_value(flags: CacheFlags, dest):
    value = getattr(flags, dest)
    return value[0] if dest in APPENDED and value else value


def _as_flag_error(exc: ConfigError, flags: CacheFlags) -> ConfigError:
    """The same refusal, named after the flag that set the value (when a flag did)."""
    flag, dest = FIELD_FLAGS.get(exc.field, (None, None))
    value = _flag_value(flags, dest) if dest else None
    if flag is None or value is None:
        return exc
    shown = ",".join(map(str, value)) if isinstance(value, tuple) else value
    if exc.expected is not None:
        return ConfigError(f"{flag} {shown}: expected {exc.expected} ({exc.field})",
                           field=exc.field, value=value, expected=exc.expected)
    return ConfigError(f"{flag} {shown}: {exc}", field=exc.field, value=value)


def _single(flags: CacheFlags, name: str, flag: str):
    """Aliases append to one tuple; they must agree."""
    values = getattr(flags, name)
    if not values:
        return None
    if len(set(values)) > 1:
        raise ConfigError(f"{flag} and its aliases were given different values {values}; give one")
    return values[0]


def _given(**kwargs) -> dict:
    return {k: v for k, v in kwargs.items() if v is not None}


def config_of(flags: CacheFlags, fields: dict | None = None) -> CMConfig:
    """Build the CMConfig the flags describe; ConfigError names the offending flag. `fields`, a
    partial CMConfig in the presets' format (budgeted mode's choice), stands where a preset
    would: explicit flags override it field by field."""
    try:
        return _config_of(flags, fields)
    except ConfigError as exc:
        raise _as_flag_error(exc, flags) from None


def config_from_fields(fields: dict) -> CMConfig:
    """The CMConfig of a partial configuration in the presets' format, with no flags given;
    ConfigError naming the key when its shape is not that format (the configs check values)."""
    _check_shape(fields)
    return _config_of(CacheFlags(), fields)


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


def _config_of(flags: CacheFlags, fields: dict | None = None) -> CMConfig:
    if fields is not None:
        preset = fields
    else:
        preset = load_preset(flags.preset) if flags.preset else {}
    cache_type = flags.cache_type or ("deepcache" if flags.enable_cache and not preset else None)
    if flags.cache_type is not None and not flags.enable_cache:
        raise ConfigError("--cache_type needs --enable_cache")
    on = {
        "deepcache": flags.deepcache or cache_type == "deepcache" or "deepcache" in preset,
        "teacache": flags.teacache or cache_type == "teacache" or "teacache" in preset,
        "fbcache": flags.fbcache or cache_type == "fbcache" or "fbcache" in preset,
        "magcache": flags.magcache or cache_type == "magcache" or "magcache" in preset,
    }
    specific = {  # technique -> {config field: (flag, value)}
        name: {field.split(".")[1]: (flag, getattr(flags, dest))
               for field, (flag, dest) in FIELD_FLAGS.items() if field.startswith(cls + ".")}
        for name, cls in TECHNIQUE_CLASSES.items()}
    classes = {"deepcache": DeepCacheConfig, "teacache": TeaCacheConfig, "fbcache": FBCacheConfig,
               "magcache": make_magcache}  # MagCache reads its ratios from the profile file
    techniques = {}
    for name, named in specific.items():
        given = {k: v for k, (_, v) in named.items() if v is not None}
        pattern = sorted(k for k in ("start", "end", "interval") if k in given)
        if "steps" in given and pattern:
            raise ConfigError(f"--cache_steps names the computed steps; "
                              f"{', '.join(named[k][0] for k in pattern)} would be ignored: "
                              "give one or the other")
        if given and not on[name]:
            shown = ", ".join(named[k][0] for k in given)
            raise ConfigError(f"{shown} given but {name} is not enabled; add --{name} "
                              f"(or --enable_cache --cache_type {name})")
        techniques[name] = classes[name](**{**preset.get(name, {}), **given}) if on[name] else None

    limit_values = dict(preset.get("limits", {}))
    limit_values.update(flags.teacache_limits or {})
    limit_values.update(_given(max_cached=flags.max_cached, max_continuous=flags.max_continuous))
    # cache-dit's convention, which users bring along: a negative cap means no cap.
    limit_values = {k: (None if isinstance(v, int) and not isinstance(v, bool) and v < 0 else v)
                    for k, v in limit_values.items()}
    limit_values.update(_given(alternating=flags.alternating))
    top = {k: v for k, v in preset.items() if k not in (*TECHNIQUE_KEYS, "limits")}
    unknown = sorted(set(top) - {f.name for f in dataclasses.fields(CMConfig)})
    if unknown:
        source = f"preset {flags.preset!r}" if fields is None else "the configuration"
        raise ConfigError(f"{source} sets unknown fields {unknown}")
    return CMConfig(
        **techniques,
        limits=LimitsConfig(**limit_values),
        **{**top, **_given(
            warmup=_single(flags, "cache_warmup", "--cache_warmup"),
            last_steps=_single(flags, "cache_last_steps", "--cache_last_steps"),
            cfg_mode=flags.cfg_mode,
            cfg_sep_diff=_single(flags, "cfg_sep_diff", "--cfg_sep_diff"),
            cfg_compute_first=flags.cfg_compute_first,
            pair_reduce=flags.pair_reduce,
            evaluation_order=flags.evaluation_order,
            fn_blocks=flags.fn_blocks,
            bn_blocks=flags.bn_blocks,
            offload=flags.cache_offload,
            offload_watermark=flags.offload_watermark,
            noise_adapt=flags.noise_adapt,
            dry_run=flags.dry_run,
            forecast=flags.forecast,
            forecast_gate=flags.forecast_gate,
            forecast_reach=flags.forecast_reach,
            remodulate=flags.remodulate,
            step_weight=flags.step_weight,
            scene_guard=flags.scene_guard,
            bn_ids=flags.bn_ids,
            ctrl_guard=flags.ctrl_guard,
        )},
    )

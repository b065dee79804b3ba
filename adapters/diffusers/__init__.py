"""Our cache gate inside a diffusers pipeline, in one call:

    from adapters.diffusers import enable_cache, disable_cache, cache_report
    enable_cache(pipe, preset="balanced")            # or teacache=True, teacache_thresh=0.2, ...
    video = pipe(prompt, ...).frames[0]
    print(cache_report(pipe)["text"])
    disable_cache(pipe)                              # the pipeline as it was

The settings are our command-line flags without their dashes (docs/cli.md): presets,
TeaCache / FBCache / DeepCache / MagCache, forecasts, limits, and budgeted mode
(`budget_rel_err=0.03` or `budget_speedup=2.0` with `budget_profile=`). The pipeline keeps its
scheduler, CFG, callbacks and offloading: the gate runs inside its transformer's forward (a
diffusers hook), on the transformer's own layers, and decides as our torch backend decides on
the same weights (tests/test_diffusers_adapter.py). Wan2.2 T2V / TI2V / I2V A14B (both experts
share one gate: its steps are counted once over the switch) and HunyuanVideo-1.5 T2V / I2V.
`compile=True` compiles the gate's three stages (probe, middle, tail) with static shapes: no
recompile after the first step. A transformer compiled as a whole is refused (it would retrace at
the gate's decisions).
"""

from __future__ import annotations

import warnings
import weakref

from cache import CMConfig
from sampling.calibration import profile_files, recorded_weights

from .families import FAMILIES, family_of, our_models, weights_fingerprint
from .gate import Gate, install, installed, remove
from .report import format_report
from .settings import CacheSettingsError, resolve

__all__ = ["CacheSettingsError", "cache_report", "disable_cache", "enable_cache"]

_GATES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # pipeline -> its Gate


def transformers_of(pipe) -> dict:
    """expert -> transformer of the pipeline (Wan2.2 A14B: "high" and "low")."""
    first = getattr(pipe, "transformer", None)
    if first is None:
        raise CacheSettingsError(
            f"{type(pipe).__name__} has no transformer; expected a diffusers video pipeline with "
            f"one of {', '.join(sorted(FAMILIES))}")
    second = getattr(pipe, "transformer_2", None)
    return {None: first} if second is None else {"high": first, "low": second}


def enable_cache(pipe, *, config: CMConfig | None = None, compile: bool = False,
                 accept_profile: bool = False, **settings):
    """Put the gate on `pipe`'s transformer(s); returns the gate's CMConfig. Settings are our
    cache flags without dashes, or `config` a CMConfig. CacheSettingsError (the pipeline left as
    it was) for an unsupported pipeline or transformer, unknown or contradicting settings, a
    profile calibrated for another model or on other weights (accept_profile=True takes the
    latter anyway, as --accept_profile does)."""
    transformers = transformers_of(pipe)
    families = {e: family_of(t) for e, t in transformers.items()}
    if len(set(families.values())) != 1:
        raise CacheSettingsError("the pipeline's two transformers are of different families; "
                                 "expected two experts of one model")
    family = next(iter(families.values()))
    for t in transformers.values():
        if installed(t) is not None or pipe in _GATES:
            raise CacheSettingsError("the gate is already on this pipeline; call "
                                     "disable_cache(pipe) before enabling it again")
        if getattr(t, "is_cache_enabled", False):
            raise CacheSettingsError("diffusers' own cache is enabled on the transformer; call "
                                     "pipe.transformer.disable_cache() first (one cache at a time)")
        if getattr(t, "_compiled_call_impl", None) is not None or hasattr(t, "_orig_mod"):
            raise CacheSettingsError(
                "the transformer is compiled as a whole (torch.compile): it would retrace at the "
                "gate's decisions; enable the gate on the uncompiled transformer with "
                "compile=True, which compiles the gate's three stages (no recompile after the "
                "first step)")
    models = our_models(transformers[next(iter(transformers))], family)
    if config is not None and settings:
        raise CacheSettingsError(f"give config= or settings ({', '.join(sorted(settings))}), "
                                 "not both")
    if config is not None and not isinstance(config, CMConfig):
        raise CacheSettingsError(f"config {type(config).__name__}: expected a cache.CMConfig")
    resolved = resolve(settings, models) if config is None else None
    config = config if resolved is None else resolved.config
    staged = {e: family.staged(t) for e, t in transformers.items()}
    blocks = next(iter(staged.values())).num_blocks
    if config.enabled and config.probe_blocks + config.tail_blocks > blocks:
        raise CacheSettingsError(f"probe blocks ({config.probe_blocks}) + tail blocks "
                                 f"({config.tail_blocks}) exceed the transformer's {blocks} "
                                 f"blocks; expected fn_blocks + bn_blocks <= {blocks}")
    if config.remodulate:
        raise CacheSettingsError("remodulate recombines the residual with our Wan blocks' time "
                                 "gates, which the adapter does not split out: leave it off")
    _check_profiles(transformers, family, profile_files(settings.get("budget_profile"), config),
                    accept_profile)
    gate = Gate(pipe, staged, config, compile=compile,
                budget=resolved.budget if resolved is not None else None)
    for expert, t in transformers.items():
        install(t, gate, expert, family.staged.conds)
    _GATES[pipe] = gate
    return config


def _check_profiles(transformers: dict, family, files, accept: bool) -> None:
    """Refuse a calibrated profile measured on other weights than the pipeline's (the same
    fingerprint our checkpoints give them, so a profile of our calibrate command holds here)."""
    if not files:
        return
    fingerprints = {e: weights_fingerprint(t, family) for e, t in transformers.items()}
    if None in fingerprints.values():
        return  # offloaded weights: nothing to compare
    for flag, path, recorded in recorded_weights(files, fingerprints):
        name = flag.removeprefix("--")
        if recorded is None:
            warnings.warn(f"{name} {path} records no weights fingerprint (calibrated before "
                          "profiles did); it is used as if measured on these weights",
                          stacklevel=3)
        elif not accept:
            raise CacheSettingsError(
                f"{name} {path} was calibrated on other weights (fingerprint {recorded}, this "
                f"pipeline's are {fingerprints}); calibrate on these weights "
                "(adapters.diffusers.calibration.calibrate), or pass accept_profile=True to use it anyway")


def disable_cache(pipe) -> dict | None:
    """Take the gate off `pipe`: its transformers' forward is theirs again (a run after this is
    bit-identical to one of a pipeline that never had it). Returns the last run's report."""
    gate = _GATES.pop(pipe, None)
    for t in transformers_of(pipe).values():
        remove(t)
    return cache_report(gate) if gate is not None else None


def gate_of(pipe) -> Gate | None:
    """The gate enable_cache put on `pipe`, None when there is none."""
    return _GATES.get(pipe)


def cache_report(pipe_or_gate) -> dict | None:
    """The last pipeline call's figures: steps, calls computed and reused, the computed
    fraction, the block-count ideal speedup, the seconds spent in the transformer, the
    per-step trace, and `text`, the summary as our commands print it. None before any call."""
    gate = pipe_or_gate if isinstance(pipe_or_gate, Gate) else _GATES.get(pipe_or_gate)
    if gate is None or gate.run is None:
        return None
    report = gate.report()
    report["text"] = format_report(report)
    return report

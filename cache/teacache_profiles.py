"""TeaCache rescale polynomials, by model, as the peers ship them (../shared/reference/peers.md).

Each profile maps the raw relative L1 change of a signature to an estimate of the relative change
of the model output. A polynomial only means something over the rel values it was fitted on: a
calibrated profile carries that range (`rel_range`), the gate counts evaluations outside it, and
the gate clamps the rescaled change at zero (teacache.judge). A profile is only meaningful for
the signal it was fitted on: the official
Wan2.1 ones were fitted on the time embedding `e` or the time projection `e0`, the HunyuanVideo
ones on the modulated input of double_blocks[0]. `TeaCacheConfig` refuses a mismatched pair.
Coefficients are copied exactly, highest power first (numpy.poly1d order).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

from .validate import (
    MISSING,
    FieldError,
    at_key,
    json_int,
    json_list,
    json_number,
    json_object,
    json_str,
    json_type,
    read_json,
    refuse_field,
)

# What a TeaCache signature is the mean absolute value of.
MODULATED_INPUT = "modulated_input"  # block 0's LayerNorm(x) * (1 + scale) + shift (seed 000)
TIME_EMBEDDING = "time_embedding"  # Wan `e` (TeaCache use_ret_steps=False)
TIME_PROJECTION = "time_projection"  # Wan `e0` (TeaCache use_ret_steps=True)
SIGNALS = (MODULATED_INPUT, TIME_EMBEDDING, TIME_PROJECTION)


@dataclass(frozen=True)
class PolyProfile:
    coefficients: tuple[float, ...]
    signal: str
    threshold: float  # the threshold its source recommends
    warmup: int  # executed steps its source always computes first
    source: str
    experts: dict = field(default_factory=dict)  # expert -> coefficients (Wan2.2 A14B fits)
    # (min, max) of the rel values the fit saw, overall and per expert; None: not known (the
    # peers' published profiles do not say)
    rel_range: tuple[float, float] | None = None
    expert_ranges: dict = field(default_factory=dict)

    def __call__(self, rel: float, expert: str | None = None) -> float:
        value = 0.0
        for c in self.experts.get(expert, self.coefficients):  # Horner
            value = value * rel + c
        return value

    def outside(self, rel: float, expert: str | None = None) -> str | None:
        """'below' or 'above' the fitted rel range of this expert's polynomial; None inside it
        or when the range is not known."""
        fitted = self.expert_ranges.get(expert, self.rel_range) if expert in self.experts \
            else self.rel_range
        if fitted is None:
            return None
        return "below" if rel < fitted[0] else "above" if rel > fitted[1] else None


class ProfileError(ValueError):
    """A profile file is missing or malformed."""


@functools.lru_cache(maxsize=32)
def load_profile_file(path: str) -> PolyProfile:
    """A calibrated profile written by `python -m commands.calibrate` (JSON), checked field by
    field (check_profile); ProfileError, one line naming the file and the field, otherwise."""
    try:
        return check_profile(read_json(path), path)
    except FieldError as exc:
        raise ProfileError(f"TeaCache profile {path}: {exc}") from None


_POLY = "a non-empty array of finite numbers (polynomial coefficients, highest power first)"
_EXPERTS = "an object mapping each expert's name to its coefficients"


def check_profile(d, path: str) -> PolyProfile:
    """The PolyProfile of a parsed profile file, every field checked as
    `python -m commands.calibrate` writes it: coefficients and signal are required; threshold,
    warmup, source, the fitted rel ranges (null: not known) and the per-expert fits may be left
    out; r2, points and experts_r2 (what the fit reported) are checked where present. Other keys
    (the `budget` block of a budget profile) are not this format's. FieldError otherwise."""
    if not isinstance(d, dict):
        raise FieldError(f"holds a JSON {json_type(d)}; expected an object, as "
                         "`python -m commands.calibrate` writes it")
    coefficients = _coefficients(d.get("coefficients", MISSING), "coefficients")
    signal = json_str(d.get("signal", MISSING), "signal", choices=SIGNALS)
    threshold = json_number(d.get("threshold", 0.15), "threshold", minimum=0.0)
    warmup = json_int(d.get("warmup", 1), "warmup", minimum=0)
    source = json_str(d.get("source", path), "source")
    experts = {name: _coefficients(value, at_key("experts", name)) for name, value in
               _named(d.get("experts", {}), "experts", _EXPERTS).items()}
    # profiles written before the fitted range was recorded load without one
    rel_range = _range(d["rel_range"], "rel_range") if d.get("rel_range") is not None else None
    expert_ranges = {}
    for name, value in _named(d.get("experts_rel_range", {}), "experts_rel_range",
                              "an object mapping each expert's name to its fitted rel range"
                              ).items():
        where = at_key("experts_rel_range", name)
        if name not in experts:
            refuse_field(where, value, f"a range only for an expert with coefficients under "
                                       f"experts (has: {', '.join(map(repr, experts)) or 'none'})")
        expert_ranges[name] = _range(value, where)
    if "r2" in d:
        json_number(d["r2"], "r2")
    if "points" in d:
        json_int(d["points"], "points", minimum=1)
    for name, value in _named(d.get("experts_r2", {}), "experts_r2",
                              "an object mapping each expert's name to its fit's R^2").items():
        json_number(value, at_key("experts_r2", name))
    return PolyProfile(coefficients, signal, threshold, warmup, source, experts, rel_range,
                       expert_ranges)


def _coefficients(value, where: str) -> tuple[float, ...]:
    return tuple(json_number(c, f"{where}[{i}]")
                 for i, c in enumerate(json_list(value, where, _POLY, min_length=1)))


def _named(value, where: str, expected: str) -> dict:
    """An object keyed by expert names (non-empty strings)."""
    for name in json_object(value, where, expected):
        if not name:
            refuse_field(at_key(where, name), value[name], "a non-empty expert name as its key")
    return value


def _range(value, where: str) -> tuple[float, float]:
    """A fitted range [low, high] of rel values: 0 <= low <= high, both finite."""
    expected = "[low, high], the rel values the fit saw: finite, 0 <= low <= high"
    low, high = (json_number(v, f"{where}[{i}]", minimum=0.0, expected=expected)
                 for i, v in enumerate(json_list(value, where, expected, length=2)))
    if not low <= high:
        refuse_field(where, value, expected)
    return low, high


def resolve_profile(name: str) -> PolyProfile | None:
    """A named profile, or a profile file (a path ending in .json); None if neither."""
    if name in PROFILES:
        return PROFILES[name]
    if name.endswith(".json") and os.path.isfile(name):
        return load_profile_file(os.path.abspath(name))
    return None


_TEA = "ali-vilab/TeaCache TeaCache4Wan2.1/teacache_generate.py"
_LX = "ModelTC/LightX2V configs"


def _tea_wan21(model: str, threshold: float, e0: tuple[float, ...],
               e: tuple[float, ...]) -> dict[str, PolyProfile]:
    """TeaCache4Wan2.1 fits each model twice at one threshold: on `e0` (use_ret_steps, which
    computes the first 5 steps) and on `e`."""
    return {f"wan2.1-{model}-e0": PolyProfile(e0, TIME_PROJECTION, threshold, 5, _TEA),
            f"wan2.1-{model}-e": PolyProfile(e, TIME_EMBEDDING, threshold, 1, _TEA)}


PROFILES: dict[str, PolyProfile] = {
    **_tea_wan21("t2v-1.3b", 0.08,
                 (-5.21862437e04, 9.23041404e03, -5.28275948e02, 1.36987616e01, -4.99875664e-02),
                 (2.39676752e03, -1.31110545e03, 2.01331979e02, -8.29855975e00, 1.37887774e-01)),
    **_tea_wan21("t2v-14b", 0.2,
                 (-3.03318725e05, 4.90537029e04, -2.65530556e03, 5.87365115e01, -3.15583525e-01),
                 (-5784.54975374, 5449.50911966, -1811.16591783, 256.27178429, -13.02252404)),
    **_tea_wan21("i2v-14b-480p", 0.26,
                 (2.57151496e05, -3.54229917e04, 1.40286849e03, -1.35890334e01, 1.32517977e-01),
                 (-3.02331670e02, 2.23948934e02, -5.25463970e01, 5.87348440e00, -2.01973289e-01)),
    **_tea_wan21("i2v-14b-720p", 0.3,
                 (8.10705460e03, 2.13393892e03, -3.72934672e02, 1.66203073e01, -4.17769401e-02),
                 (-114.36346466, 65.26524496, -18.82220707, 4.91518089, -0.23412683)),
    "wan2.2-ti2v-5b-720p-e": PolyProfile(
        (1.57472669e05, -1.15702395e05, 3.10761669e04, -3.83116651e03, 2.21608777e02,
         -4.81179567e00),
        TIME_EMBEDDING, 0.26, 1, _LX),
    "hunyuanvideo": PolyProfile(
        (7.33226126e02, -4.01131952e02, 6.75869174e01, -3.14987800e00, 9.61237896e-02),
        MODULATED_INPUT, 0.15, 1, "ali-vilab/TeaCache TeaCache4HunyuanVideo"),
    "hunyuanvideo1.5-480p-t2v": PolyProfile(
        (-2.97190924e04, 2.22834983e04, -4.37418360e03, 3.39340251e02, -1.01365855e01,
         1.29101768e-01),
        MODULATED_INPUT, 0.15, 1, _LX),
    "hunyuanvideo1.5-720p-t2v": PolyProfile(
        (-3.08907507e04, 1.67786188e04, -3.19178643e03, 2.60740519e02, -8.19205881e00,
         1.07913775e-01),
        MODULATED_INPUT, 0.15, 1, _LX),
    "hunyuanvideo1.5-480p-i2v": PolyProfile(
        (8.08528429e03, -2.44607178e03, 2.49489589e02, -9.10697865e00, 1.20261379e-01),
        MODULATED_INPUT, 0.15, 1, _LX),
    "hunyuanvideo1.5-720p-i2v": PolyProfile(
        (3.84300014e03, -1.39247433e03, 1.69167679e02, -7.07679232e00, 1.02419011e-01),
        MODULATED_INPUT, 0.15, 1, _LX),
}

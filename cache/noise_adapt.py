"""Noise-phase adaptivity (seed 002): scale the skip threshold with the place in the schedule,
looser at high noise (early steps change the picture's coarse layout, which later steps redo)
and stricter at low noise (late steps lay down the detail users see).

    none            factor 1 everywhere
    linear          1.5 at the first step, falling linearly to 0.5 at the last
    table:<name>    piecewise-linear in progress p = step / (num_steps - 1), from TABLES

The factor multiplies the TeaCache and FBCache thresholds of each call.
"""

from __future__ import annotations

from .validate import ConfigError

# progress -> factor knots, progress ascending from 0 to 1 (two knots at one progress: a step)
TABLES: dict[str, tuple[tuple[float, float], ...]] = {
    "linear": ((0.0, 1.5), (1.0, 0.5)),
    # flat through the middle, where cache methods do most of their skipping, strict at the end
    "plateau": ((0.0, 1.25), (0.2, 1.0), (0.8, 1.0), (1.0, 0.5)),
    # the threshold as is, then 0 (every call computes) over the last N percent of the schedule:
    # a reuse costs the most there (on bench/workload.py's models, one reuse at step 46 of 50
    # loses about 40 dB more PSNR than one at step 1), so the presets differ first in how much
    # of it they protect
    "last40": ((0.0, 1.0), (0.6, 1.0), (0.6, 0.0), (1.0, 0.0)),
    "last20": ((0.0, 1.0), (0.8, 1.0), (0.8, 0.0), (1.0, 0.0)),
    "last5": ((0.0, 1.0), (0.95, 1.0), (0.95, 0.0), (1.0, 0.0)),
}


def check(spec: str) -> None:
    if isinstance(spec, str) and (spec in ("none", "linear") or
                                  (spec.startswith("table:") and spec[6:] in TABLES)):
        return
    raise ConfigError(f"noise_adapt must be none, linear or table:<name> with a name among "
                      f"{', '.join(sorted(TABLES))}; got {spec!r}")


def factor(spec: str, step: int, num_steps: int) -> float:
    """Threshold factor for an executed step of a run of num_steps."""
    if spec == "none":
        return 1.0
    knots = TABLES["linear" if spec == "linear" else spec[6:]]
    p = step / (num_steps - 1) if num_steps > 1 else 0.0
    for (p0, f0), (p1, f1) in zip(knots, knots[1:], strict=False):
        if p <= p1:
            return f0 + (f1 - f0) * (p - p0) / (p1 - p0)
    return knots[-1][1]

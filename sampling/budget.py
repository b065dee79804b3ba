"""Budgeted mode: a target instead of a setting.

`python -m sampling.calibrate --budget` runs every configuration of SPACE (the techniques,
forecast orders, thresholds and limits we ship) on a few calibration draws, each against the
uncached run of the same draw, and stores per configuration the final-latent relative L2 error
and the computed fraction of block evaluations of every draw. A run then asks for a target:

  --budget_rel_err e   the configuration computing the least whose error bound is within e
  --budget_speedup s   the configuration with the least error bound among those computing at
                       most 1/s of the blocks on every calibration draw

A configuration's error bound is a one-sided 95% prediction bound for one more draw, learned from
the calibration spread: errors are taken as log-normal across draws, with the configuration's own
spread of log errors or, where that is smaller, the spread pooled over every configuration (a few
draws that happen to agree say little), and Student's t for the few draws measured:

    bound = exp(mean log e + t(0.95, n - 1) * max(s, s_pooled) * sqrt(1 + 1/n)), at least max e

With 3 draws t is 2.92, so a configuration whose errors spread by a factor 1.5 promises about
2.6x its geometric mean; 2 draws (t 6.31) promise little, 5 (t 2.13) more.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

FORMAT = 2  # the profile's "budget" block; 1 was the TeaCache-only threshold curve


class BudgetError(ValueError):
    """The profile has no budget, or the request cannot be read or met."""


def _fb(threshold, *, forecast=0, gated=False, bn=0):
    fields = {"fbcache": {"threshold": threshold, "metric": "residual_tensor_rel_l1"},
              "forecast": forecast}
    if gated:  # reuse while block 0's summed forecast error stays under the threshold (issue 17)
        fields["fbcache"]["accumulate"] = True
        fields["forecast_gate"] = True
    if bn:
        fields["bn_blocks"] = bn
    return fields


def _tc(threshold, *, forecast=0):
    # relative thresholds: multiples of the run's own mean change, so they transfer (issue 16)
    fields = {"teacache": {"threshold": threshold, "relative": True}}
    if forecast:
        fields.update(forecast=forecast, limits={"max_continuous": 3})
    return fields


def _space():
    out = [(f"FBCache +forecast2 gated {t:g}", _fb(t, forecast=2, gated=True))
           for t in (0.005, 0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.3, 0.6)]
    out += [(f"FBCache +forecast1 gated {t:g}", _fb(t, forecast=1, gated=True))
            for t in (0.2, 0.4, 0.8)]
    # the cheap end (issue 17): linear forecast, forecast error weighted by the step's size, no
    # forced last compute
    out += [(f"FBCache +forecast1 gated step-weighted {t:g}",
             {**_fb(t, forecast=1, gated=True), "step_weight": 1.0, "last_steps": 0})
            for t in (0.05, 0.1, 0.3, 0.7, 1.2, 2.1)]
    out += [(f"FBCache +forecast2 {t:g}", _fb(t, forecast=2)) for t in (0.03, 0.05, 0.1, 0.2)]
    out += [(f"FBCache F1B2 +forecast1 {t:g}", _fb(t, forecast=1, bn=2)) for t in (0.1, 0.2)]
    out += [(f"FBCache {t:g}", _fb(t)) for t in (0.02, 0.05)]
    out += [(f"TeaCache relative {t:g}", _tc(t)) for t in (1.5, 3.0, 5.0)]
    out += [(f"TeaCache relative {t:g} +forecast2", _tc(t, forecast=2)) for t in (1.5, 3.0, 5.0)]
    return tuple(out)


# (label, partial CMConfig in the presets' format): what budgeted mode chooses from
SPACE = _space()


@dataclass(frozen=True)
class Choice:
    label: str
    fields: dict  # partial CMConfig, as a preset
    bound: float  # the error the choice promises for a draw it has not seen
    computed: float  # mean computed fraction of block evaluations on the calibration draws
    computed_max: float  # the most it computed on one of them


# one-sided 95% quantiles of Student's t by degrees of freedom (beyond the table: the normal's)
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833,
       10: 1.812, 12: 1.782, 15: 1.753, 20: 1.725, 30: 1.697}


def t95(dof: int) -> float:
    if dof < 1:
        raise BudgetError("a prediction bound needs at least 2 draws")
    below = [k for k in T95 if k <= dof]
    return T95[max(below)] if dof <= 30 else 1.645


def _log_stats(errors):
    logs = [math.log(e) for e in errors]
    mean = sum(logs) / len(logs)
    if len(logs) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))


def pooled_spread(candidates) -> float:
    """The spread of log errors between draws, pooled over the configurations that reused on
    every draw (one that reused nothing on a draw has no log error there)."""
    variances = [_log_stats(c["rel_l2"])[1] ** 2 for c in candidates
                 if len(c["rel_l2"]) > 1 and min(c["rel_l2"]) > 0]
    return math.sqrt(sum(variances) / len(variances)) if variances else 0.0


def bounds(candidates) -> list[float]:
    """Each configuration's error bound for a draw it has not seen (see the module's text). The
    draws on which a configuration reused nothing (no error) are left out of its statistics."""
    pooled = pooled_spread(candidates)
    out = []
    for c in candidates:
        errors = [e for e in c["rel_l2"] if e > 0.0]
        if not errors:  # never reused on any draw
            out.append(0.0)
            continue
        n = len(errors)
        mean, spread = _log_stats(errors)
        out.append(max(max(errors), math.exp(mean + t95(max(n - 1, 1)) * max(spread, pooled)
                                             * math.sqrt(1.0 + 1.0 / n))))
    return out


def load(profile_path: str) -> dict:
    """The profile's budget block, checked."""
    try:
        with open(profile_path) as f:
            profile = json.load(f)
    except (OSError, ValueError) as exc:
        raise BudgetError(f"--budget_profile {profile_path}: cannot read it ({exc})") from None
    budget = profile.get("budget") if isinstance(profile, dict) else None
    if not isinstance(budget, dict) or budget.get("format") != FORMAT:
        older = isinstance(profile, dict) and "budget_curve" in profile
        raise BudgetError(
            f"--budget_profile {profile_path}: expected a budget measured by `python -m "
            f"sampling.calibrate --budget` (format {FORMAT})"
            + ("; this one holds the older TeaCache-only threshold curve, calibrate again"
               if older else ""))
    candidates = budget.get("candidates") or []
    draws = len(budget.get("seeds") or [])
    for c in candidates:
        if len(c.get("rel_l2", ())) != draws or len(c.get("computed", ())) != draws:
            raise BudgetError(f"--budget_profile {profile_path}: configuration {c.get('label')!r}"
                              f" has {len(c.get('rel_l2', ()))} errors for {draws} draws")
    if not candidates or draws < 2:
        raise BudgetError(f"--budget_profile {profile_path}: expected at least one configuration "
                          f"measured on at least 2 draws (the bound needs a spread), got "
                          f"{len(candidates)} on {draws}")
    return budget


def choose(budget: dict, *, rel_err: float | None = None,
           speedup: float | None = None) -> Choice | None:
    """The configuration for one target, or None when caching cannot promise it (run uncached)."""
    if (rel_err is None) == (speedup is None):
        raise BudgetError("give one target: a relative-error budget or a speedup")
    measured = [c for c in budget["candidates"] if all(math.isfinite(e) for e in c["rel_l2"])]
    choices = [Choice(c["label"], c["config"], bound, sum(c["computed"]) / len(c["computed"]),
                      max(c["computed"]))
               for c, bound in zip(measured, bounds(measured), strict=True)]
    if rel_err is not None:
        within = [c for c in choices if c.bound <= rel_err]
        return min(within, key=lambda c: (c.computed, c.bound), default=None)
    fast = [c for c in choices if c.computed_max <= 1.0 / speedup]
    return min(fast, key=lambda c: (c.bound, c.computed), default=None)

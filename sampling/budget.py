"""Budgeted mode: a target instead of a threshold. The calibration sweep measured, on its
samples, the final-latent error and the computed fraction at each threshold; the budget picks
the threshold from that curve (a quality budget: the largest threshold within the error; a speed
target: the least threshold that computes at most 1/speedup of the calls)."""

from __future__ import annotations

import json


class BudgetError(ValueError):
    """The profile has no curve, or the request cannot be read."""


def load_curve(profile_path: str) -> tuple[list, int | None]:
    try:
        with open(profile_path) as f:
            profile = json.load(f)
    except (OSError, ValueError) as exc:
        raise BudgetError(f"budgeted mode reads {profile_path}: {exc}") from None
    curve = profile.get("budget_curve")
    if not curve:
        raise BudgetError(f"{profile_path} has no budget_curve; calibrate with --sweep N first")
    return sorted(curve), profile.get("budget_steps")


def threshold_for(curve, *, rel_err: float | None = None, speedup: float | None = None):
    """(threshold, predicted rel L2, predicted computed fraction) for one target."""
    if (rel_err is None) == (speedup is None):
        raise BudgetError("give one target: a relative-error budget or a speedup")
    if rel_err is not None:
        within = [point for point in curve if point[1] <= rel_err]
        return tuple(within[-1]) if within else (0.0, 0.0, 1.0)  # 0: never skip
    fast = [point for point in curve if point[2] <= 1.0 / speedup]
    return tuple(fast[0]) if fast else tuple(curve[-1])

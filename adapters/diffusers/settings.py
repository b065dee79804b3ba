"""The gate's settings as keyword arguments, read by the very flag parser the commands use:
`teacache=True, teacache_thresh=0.2` is `--teacache --teacache_thresh 0.2`, with the same
checks and messages; `preset="balanced"` is `--preset balanced`; `budget_rel_err` /
`budget_speedup` with `budget_profile` choose from a calibrated profile as stage 2 does."""

from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass

from cache import CMConfig
from cache.flags import config_of
from cache.validate import ConfigError
from sampling.budget import BudgetError
from sampling.budget import choose as budget_choose
from sampling.budget_profile import load as budget_load
from sampling.cache_cli import add_cache_arguments, cache_flags

BUDGET = ("budget_rel_err", "budget_speedup", "budget_profile")


class CacheSettingsError(ValueError):
    """A setting of enable_cache is unknown, malformed or contradicts another; nothing was
    changed on the pipeline."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # the message, not an exit: enable_cache is a library call
        raise CacheSettingsError(message)


def _parser() -> _Parser:
    parser = _Parser(add_help=False, exit_on_error=False, prog="enable_cache")
    add_cache_arguments(parser)
    return parser


def names() -> tuple[str, ...]:
    """Every keyword a setting can have."""
    return tuple(sorted({a.dest for a in _parser()._actions} | set(BUDGET)))


def _argv(parser: _Parser, settings: dict) -> list[str]:
    actions = {a.dest: a for a in parser._actions}
    argv = []
    for key, value in settings.items():
        action = actions.get(key)
        if action is None:
            near = difflib.get_close_matches(key, names(), n=1, cutoff=0.6)
            raise CacheSettingsError(
                f"unknown setting {key!r}; " + (f"did you mean {near[0]!r}? " if near else "")
                + "expected the name of a cache flag without its dashes (docs/cli.md), or "
                + ", ".join(BUDGET))
        flag = action.option_strings[0]
        if action.nargs == 0:  # a switch: True turns it on
            if not isinstance(value, bool):
                raise CacheSettingsError(f"{key}={value!r}: expected True or False ({flag} is "
                                         "a switch)")
            argv += [flag] if value else []
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


@dataclass(frozen=True)
class Settings:
    """What enable_cache resolved: the gate's config and, in budgeted mode, what it chose."""

    config: CMConfig
    budget: dict | None = None


def resolve(settings: dict, models: tuple[str, ...]) -> Settings:
    """The CMConfig of keyword `settings` for a transformer that is one of our `models` (the
    pipelines whose architecture its config has). CacheSettingsError names what is wrong."""
    given = dict(settings)
    budget = {k: given.pop(k) for k in BUDGET if k in given}
    parser = _parser()
    try:
        args = parser.parse_args(_argv(parser, given))
    except argparse.ArgumentError as exc:
        raise CacheSettingsError(str(exc)) from None
    fields, chosen = None, None
    if budget:
        target = {k: budget.get(k) for k in ("budget_rel_err", "budget_speedup")}
        if (target["budget_rel_err"] is None) == (target["budget_speedup"] is None):
            raise CacheSettingsError("budgeted mode takes one target: budget_rel_err or "
                                     "budget_speedup (with budget_profile)")
        if budget.get("budget_profile") is None:
            raise CacheSettingsError("budget_rel_err / budget_speedup choose from a calibrated "
                                     "profile: give budget_profile (python calibrate.py --budget)")
        picked = [k for k in ("preset", "enable_cache", "teacache", "fbcache", "deepcache",
                              "magcache") if k in given]
        if picked:
            raise CacheSettingsError(f"budgeted mode chooses the technique; drop "
                                     f"{', '.join(picked)} (or drop the budget)")
        try:
            calibrated = budget_load(budget["budget_profile"])
            choice = budget_choose(calibrated, rel_err=target["budget_rel_err"],
                                   speedup=target["budget_speedup"])
        except BudgetError as exc:
            raise CacheSettingsError(str(exc)) from None
        if calibrated["model"] not in models:
            raise CacheSettingsError(
                f"budget_profile {budget['budget_profile']} was calibrated for "
                f"{calibrated['model']}; this transformer's architecture is "
                f"{' or '.join(models) or 'none of our models'}: calibrate for it "
                "(adapters.diffusers.calibration.calibrate)")
        fields = choice.fields if choice is not None else {}
        chosen = {"choice": choice.label if choice else None, "config": fields,
                  "bound_rel_err": choice.bound if choice else None,
                  "calibrated_steps": calibrated["steps"], **target}
    try:
        config = config_of(cache_flags(args), fields)
    except ConfigError as exc:
        raise CacheSettingsError(str(exc)) from None
    return Settings(config, chosen)

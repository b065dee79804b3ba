"""A profile's budget block, read and checked field by field as `python -m commands.calibrate
--budget` writes it (sampling/calibration.py budget_block): what a run of budgeted mode reads."""

from __future__ import annotations

import math

from cache import CMConfig
from cache.flags import config_from_fields
from cache.validate import (
    MISSING,
    ConfigError,
    FieldError,
    json_int,
    json_list,
    json_number,
    json_object,
    json_str,
    json_type,
    read_json,
    refuse_field,
)

from .budget import FURTHER, BudgetError
from .pipelines import PIPELINES
from .schedulers import SOLVERS

FORMAT = 2  # the profile's "budget" block; 1 was the TeaCache-only threshold curve


def load(profile_path: str) -> dict:
    """The profile's budget block, checked field by field (check); BudgetError, one line naming
    the file and the field, otherwise."""
    try:
        return check(read_json(profile_path))
    except FieldError as exc:
        raise BudgetError(f"--budget_profile {profile_path}: {exc}") from None


def check(profile) -> dict:
    """The budget block of a parsed profile, every field checked as `python -m commands.calibrate
    --budget` writes it (budget_block): format, model, seeds, steps and candidates are required
    (what a run reads); solver, shift and pooled_log_spread, a record of the calibration, are
    checked where present. Each candidate's rel_l2 holds one error per draw, >= 0, or NaN or
    Infinity where the run diverged (choose leaves such a configuration out); computed one
    fraction per draw in [0, 1]; config a partial CMConfig that builds. FieldError otherwise."""
    if not isinstance(profile, dict):
        raise FieldError(f"holds a JSON {json_type(profile)}; expected an object holding the "
                         "budget that `python -m commands.calibrate --budget` writes")
    budget = profile.get("budget", MISSING)
    if budget is MISSING or not isinstance(budget, dict):
        older = "budget_curve" in profile
        refuse_field("budget", budget, f"the budget measured by `python -m commands.calibrate "
                                       f"--budget` (an object, format {FORMAT})"
                     + ("; this one holds the older TeaCache-only threshold curve, calibrate "
                        "again" if older else ""))
    version = budget.get("format", MISSING)
    if not (type(version) is int and version == FORMAT):
        refuse_field("budget.format", version,
                     f"{FORMAT} (the budget format `python -m commands.calibrate --budget` "
                     "writes); calibrate again")
    seeds = json_list(budget.get("seeds", MISSING), "budget.seeds",
                      "the seeds of at least 2 draws (the bound needs a spread)", min_length=2)
    for i, seed in enumerate(seeds):
        json_int(seed, f"budget.seeds[{i}]")
    if len(set(seeds)) != len(seeds):
        refuse_field("budget.seeds", seeds, "distinct seeds, one per draw")
    draws = len(seeds)
    further = {}  # screen / confirm: how many such draws
    taken, kinds, fields = set(seeds), ["calibration"], ["budget.seeds"]
    for key in FURTHER:
        field = f"budget.{key}_seeds"
        more = json_list(budget.get(f"{key}_seeds", []), field,
                         f"the seeds of the {key} draws (calibrate --{key}_draws)")
        for i, seed in enumerate(more):
            json_int(seed, f"{field}[{i}]")
        if len(set(more)) != len(more) or taken & set(more):
            refuse_field(field, more, f"distinct seeds, none of them a {' or '.join(kinds)} "
                                      f"draw's ({', '.join(fields)})")
        further[key] = len(more)
        taken |= set(more)
        kinds.append(key)
        fields.append(field)
    candidates = json_list(budget.get("candidates", MISSING), "budget.candidates",
                           "a non-empty array of measured configurations", min_length=1)
    configs = [_check_candidate(c, f"budget.candidates[{i}]", draws, further)
               for i, c in enumerate(candidates)]
    model = json_str(budget.get("model", MISSING), "budget.model")
    if model in PIPELINES:  # a profile of another model is refused by the run that reads it
        _check_blocks(candidates, configs, model, PIPELINES[model].config.num_layers)
    json_int(budget.get("steps", MISSING), "budget.steps", minimum=1)
    if "solver" in budget:
        json_str(budget["solver"], "budget.solver", choices=SOLVERS)
    if "shift" in budget:
        json_number(budget["shift"], "budget.shift", above=0.0)
    if "pooled_log_spread" in budget:
        json_number(budget["pooled_log_spread"], "budget.pooled_log_spread", minimum=0.0)
    if "floor_baseline" in budget:
        json_number(budget["floor_baseline"], "budget.floor_baseline", minimum=0.0)
    if "chaotic" in budget:
        _check_chaotic(budget["chaotic"], taken)
    return budget


def _check_chaotic(aside, taken: set) -> None:
    """The draws set aside as chaotic: their seeds (none of them a draw still in the budget) and
    bf16 floors, one per seed."""
    json_object(aside, "budget.chaotic", "an object: seeds, floor_rel_l2 (the draws screening "
                                         "set aside as chaotic)")
    seeds = json_list(aside.get("seeds", MISSING), "budget.chaotic.seeds",
                      "the seeds of the draws set aside")
    for i, seed in enumerate(seeds):
        json_int(seed, f"budget.chaotic.seeds[{i}]")
    if len(set(seeds)) != len(seeds) or taken & set(seeds):
        refuse_field("budget.chaotic.seeds", seeds, "distinct seeds, none of them a draw the "
                                                    "budget still holds")
    floors = json_list(aside.get("floor_rel_l2", MISSING), "budget.chaotic.floor_rel_l2",
                       f"{len(seeds)} floors, one per seed", length=len(seeds))
    for i, x in enumerate(floors):
        json_number(x, f"budget.chaotic.floor_rel_l2[{i}]", minimum=0.0)


def _check_candidate(c, where: str, draws: int, further: dict) -> CMConfig:
    json_object(c, where, "an object: label, config, rel_l2, computed (and screen and confirm "
                          "where it ran those draws)")
    label = json_str(c.get("label", MISSING), f"{where}.label")
    fields = json_object(c.get("config", MISSING), f"{where}.config",
                         "an object, a partial CMConfig as a preset gives one")
    try:
        config = config_from_fields(fields)
    except ConfigError as exc:
        raise FieldError(f"{where}.config: {exc}") from None
    _check_draws(c, where, label, draws, "budget.seeds")
    for key, most in further.items():
        if key not in c:
            continue
        if not most:
            refuse_field(f"{where}.{key}", c[key], f"no {key}: budget.{key}_seeds is empty")
        block = json_object(c[key], f"{where}.{key}", "an object: rel_l2, computed")
        ran = block.get("rel_l2")
        ran = len(ran) if isinstance(ran, list) and 1 <= len(ran) <= most else most
        _check_draws(block, f"{where}.{key}", label, ran,
                     f"the first {key} draws (budget.{key}_seeds)")
    return config


def _check_draws(c, where: str, label: str, draws: int, seeds: str) -> None:
    errors = json_list(c.get("rel_l2", MISSING), f"{where}.rel_l2",
                       f"{draws} relative L2 errors, one per draw of {seeds}", length=draws)
    for k, e in enumerate(errors):
        # NaN or Infinity: the configuration diverged on that draw (calibrate writes it so)
        if not (isinstance(e, int | float) and not isinstance(e, bool)
                and (math.isnan(e) or e >= 0.0)):
            refuse_field(f"{where}.rel_l2[{k}]", e, "a relative L2 error >= 0 (NaN or Infinity "
                                                    "where the run diverged)")
    fractions = json_list(c.get("computed", MISSING), f"{where}.computed",
                          f"{draws} computed fractions, one per draw of {seeds}", length=draws)
    for k, f in enumerate(fractions):
        json_number(f, f"{where}.computed[{k}]", minimum=0.0, maximum=1.0,
                    expected="the fraction of block evaluations computed, in [0, 1]")
    for k, (e, f) in enumerate(zip(errors, fractions, strict=True)):
        # only a draw that computed every block matches the uncached run exactly; an error of 0
        # on one that reused was not measured, and its bound of 0 would meet any target
        if e == 0 and f < 1.0:
            refuse_field(f"{where}.rel_l2[{k}]", e, f"an error > 0 ({label!r} reused blocks on "
                                                    f"that draw, computing {f:.3g} of them, and a "
                                                    "reuse never reproduces the uncached run "
                                                    "exactly); calibrate again")


def _check_blocks(candidates, configs, model: str, blocks: int) -> None:
    """Probe and tail blocks within the model's: a run would refuse the choice without naming the
    profile it came from."""
    for i, (c, config) in enumerate(zip(candidates, configs, strict=True)):
        fn, bn = config.probe_blocks, config.tail_blocks
        if config.enabled and fn + bn > blocks:
            key = next((k for k in ("bn_blocks", "fn_blocks") if k in c["config"]), None)
            where = f"budget.candidates[{i}].config" + (f".{key}" if key else "")
            refuse_field(where, c["config"][key] if key else c["config"],
                         f"probe blocks ({fn}) + tail blocks ({bn}) <= {blocks}, the {model} "
                         "model's blocks (budget.model)")

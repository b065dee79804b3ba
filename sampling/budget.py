"""Budgeted mode: a target instead of a setting.

`python -m commands.calibrate --budget` runs every configuration of SPACE (the techniques,
forecast orders, thresholds and limits we ship) on a few calibration draws, each against the
uncached run of the same draw, and stores per configuration the final-latent relative L2 error
and the computed fraction of block evaluations of every draw. A run then asks for a target:

  --budget_rel_err e   the configuration computing the least whose error bound is within e
  --budget_speedup s   the configuration with the least typical error (the geometric mean over
                       every draw it ran) among those whose computed fraction of block
                       evaluations is bounded by 1/s on a draw not seen (a 95% prediction bound
                       over the calibration draws, at least their max)

A speedup target promises speed, not an error: on trained weights the 95% error bound is set by
the rare draw that flips (a chaotic prompt moves its object under any perturbation, bf16 weights
included: bench/results/fragile_prompts_wan.md), so choosing by it traded the typical draw's
quality for a flip it cannot prevent (issue 39: the Wan model's 1.1-1.25 targets took a 0.80
schedule erring 2.3e-4 on the typical draw over a 0.84 one erring 2.0e-4). The geometric mean is
what the mean PSNR over draws measures.

A configuration's error bound is a one-sided 95% prediction bound for one more draw, learned from
the calibration spread: errors are taken as log-normal across draws, with the configuration's own
spread of log errors or, where that is smaller, the spread pooled over every configuration (a few
draws that happen to agree say little), and Student's t for the few draws measured:

    bound = exp(mean log e + t(0.95, n - 1) * max(s, s_pooled) * sqrt(1 + 1/n)), at least max e

With 3 draws t is 2.92, so a configuration whose errors spread by a factor 1.5 promises about
2.6x its geometric mean; 2 draws (t 6.31) promise little, 5 (t 2.13) more.

Screening (`--screen_draws N`). On trained weights a prompt can be fragile: most caching that errs
more than a little elsewhere moves its object to another place (a rel L2 of 0.15-0.5 where other
draws give 0.005), so on the trained HunyuanVideo-1.5 twin a bound learned from 3 ordinary draws
promised 0.03 and a held-out prompt gave 0.24 (before screening). Such flips are rare and differ by prompt and
configuration; a few draws do not see them. So every configuration that some target would choose
is run again on N further draws, its bound taken over all its draws (and at least their
ceil(0.95 (n + 1))-th smallest error, a distribution-free 95% bound for one more draw, which is
their max below 39 draws), and the choices measured again, until every configuration a target can
choose has been screened. A configuration stops at the first screen draw whose error is over the
bound it had before (it broke the promise it would have been chosen on; its bound is now at least
that error), and goes on from there only if some target still chooses it: a flipping one drops
out after a few draws, and every configuration a target chooses has run them all (a steady one
earns the tighter bound its many draws give). Screened errors sit beside the calibration draws' in
each candidate's "screen" ({"rel_l2": [...], "computed": [...]}, one per screen draw it ran, in
the order of budget.screen_seeds).

Confirmation (`--confirm_draws N`). Screening picks, for an error budget, the cheapest of many
configurations whose draws all stayed within it, and the luckiest of them wins: on the held-out
Wan (seed 11) the 0.01 budget took a schedule that no calibration or screen draw took over 0.01
and that went over it on 4 of 35 further ordinary draws (issue 39: a flip rate near 11%, which 33
clean draws hide with a chance of 2%, and one of some 130 screened configurations will). So
every configuration an error budget chooses, once screened, runs on N further draws against the
bound it would be chosen on, frozen before them: it stops at the first draw over that bound,
whose error its bound is then at least (the confirm draws only ever raise a bound; they are not
pooled into it), and the choices are screened and confirmed again until every configuration an
error budget chooses has passed. A configuration with flip rate p passes with chance (1 - p)^N:
0.21 at 5% and N = 30, 0.74 at 1%. A speedup target's choice is not confirmed: it promises a
computed fraction, which the screen draws already bound. Confirm errors sit in each candidate's
"confirm", in the order of budget.confirm_seeds.

Chaotic draws. Some draws flip with no caching at all: their uncached run with the weights merely
rounded to bf16 (what any bf16 deployment does) errs several times more than on other draws (the
held-out Wan seed 7's confirm draws 123 and 142: 1.0e-2 and 3.0e-2, where draw 100 gives 1.7e-3).
No cache can be held to a budget below that floor there, and confirming on such a draw only made
budgets dearer: 46 of the 53 configurations that broke on seed 7's confirm draws broke on one of
those two, and its 0.01 budget ran uncached. So where a configuration breaks its promise on a screen or
confirm draw, that draw's floor is measured (once): over CHAOS x the median floor of the
calibration draws, the draw is chaotic and set aside for every configuration (out of
screen_seeds / confirm_seeds and their runs; its seed and floor in "chaotic", the baseline in
"floor_baseline"). A budget then promises its error on draws that are not chaotic; the fragile
page counts misses off chaotic draws apart for the same reason (bench/fragile_prompts.py).
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass

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

from .pipelines import PIPELINES
from .schedulers import SOLVERS

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


# (label, partial CMConfig in the presets' format): what budgeted mode chooses from, besides
# the static schedules of the run's own sigma schedule (`space`)
SPACE = _space()

# Static schedules (issue 39). On trained weights a forecast holds for a step or two, and which
# steps a fixed budget computes moves the final error by several dB: on the trained tiny Wans,
# computing the last steps and spacing the others by the size of the steps in sigma kept far
# more than computing every n-th step at the same fraction, while on the trained HunyuanVideo-1.5
# twin evenly spaced steps with the last three computed did best (bench/results/
# static_schedules*.md). No one shape wins on every model, so budgeted mode measures a small
# family of both on its calibration draws and picks per model. A static schedule reads nothing
# from the device.
EVERY = (2, 3, 4, 5, 6)  # compute every n-th step...
FIRST = (1, 2, 3)  # ...after computing this many first steps...
LAST = (1, 2, 3)  # ...and this many last ones
# Which steps of the n-th the grid hits (its phase, so where its last step falls before the last
# ones) moved the final error as much as the fraction did on the trained tiny Wan: up to 13 dB
# between the phases of one n at the same count. So every phase is measured too, after 1 or 2
# first steps, and sparser grids for the cheapest end (bench/results/pareto/trained*).
PHASED_EVERY = EVERY + (7, 8)
PHASED_FIRST = (1, 2)
# The high end: skipping single steps spread over the middle of the schedule kept far more than
# skipping the small early steps (paced) or a threshold's choice at 0.74-0.9 computed on the
# trained tiny Wan (a reuse between two computes is forecast best; the first steps set the
# layout, the last the detail). Skip every k-th step from a to b (fractions of the steps).
SKIP_EVERY = (2, 3, 4)
SKIP_FROM = (0.1, 0.2, 0.3)
SKIP_TO = (0.6, 0.7, 0.8, 0.9)
PACE = (0.25, 0.5)  # paced: steps spaced evenly in the sum of |d sigma| ** pace
PACED_WARMUP = 2
# the high end too: skipping only the smallest early steps keeps far more than a threshold does
PACED_FRACTIONS = (0.24, 0.28, 0.32, 0.36, 0.40, 0.46, 0.52, 0.6, 0.7, 0.8, 0.9)


def every_nth(steps: int, n: int, first: int, last: int, phase: int | None = None) -> tuple[int, ...]:
    """The first `first` steps, every n-th step from there (or the steps at `phase` mod n), and
    the last `last` steps."""
    chosen = set(range(min(first, steps))) | set(range(first if phase is None else phase, steps, n))
    return tuple(sorted(chosen | set(range(max(0, steps - last), steps))))


def skip_window(steps: int, k: int, start: float, end: float) -> tuple[int, ...]:
    """Every step computed but every k-th from `start` to `end` (fractions of the steps)."""
    skipped = set(range(round(start * steps), round(end * steps), k))
    return tuple(i for i in range(steps) if i not in skipped)


def paced(sigmas, count: int, pace: float, first: int, last: int) -> tuple[int, ...]:
    """`first` and `last` steps computed, and `count` steps from `first` to the end placed evenly
    in the running sum of |sigma_i - sigma_i+1| ** pace (0: evenly in steps; 1: evenly in sigma,
    which crowds the large late steps of a shifted schedule)."""
    steps = len(sigmas) - 1
    sizes = [abs(a - b) ** pace for a, b in zip(sigmas[first:-1], sigmas[first + 1:], strict=True)]
    total = sum(sizes)
    cum, run = [], 0.0
    for size in sizes:
        cum.append(run / total)
        run += size
    chosen = set(range(first)) | set(range(steps - last, steps))
    for k in range(count):
        target = k / (count - 1) if count > 1 else 0.0
        i = bisect.bisect_left(cum, target)  # cum rises: the nearest is i or the one before
        near = min((j for j in (i - 1, i) if 0 <= j < len(cum)), key=lambda j: abs(cum[j] - target))
        chosen.add(first + near)
    return tuple(sorted(chosen))


def static_schedules(sigmas) -> tuple:
    """(label, fields) of every static schedule budgeted mode measures for a run of these sigmas
    (len(sigmas) - 1 steps): the reused residual forecast linearly, no tail block, no probe."""
    steps = len(sigmas) - 1
    found = {}
    for n in EVERY:
        for first in FIRST:
            for last in LAST:
                found.setdefault(every_nth(steps, n, first, last),
                                 f"static every {n} after {first}, last {last}")
    for pace in PACE:
        for last in LAST:
            for fraction in PACED_FRACTIONS:
                want = round(fraction * steps)
                # the computed set grows with the count (placements can coincide): from the
                # count that cannot overshoot up to the first that reaches the fraction
                options = []
                for count in range(max(2, want - PACED_WARMUP - last), steps):
                    options.append(paced(sigmas, count, pace, PACED_WARMUP, last))
                    if len(options[-1]) >= want:
                        break
                best = min(options, key=lambda s: abs(len(s) - want))
                found.setdefault(best, f"static paced {pace:g}, last {last}, {len(best)} steps")
    for n in PHASED_EVERY:
        for phase in range(n):
            for first in PHASED_FIRST:
                for last in LAST:
                    found.setdefault(every_nth(steps, n, first, last, phase),
                                     f"static every {n} at {phase} mod {n}, after {first}, last {last}")
    for k in SKIP_EVERY:
        for start in SKIP_FROM:
            for end in SKIP_TO:
                found.setdefault(skip_window(steps, k, start, end),
                                 f"static skip every {k} from {start:g} to {end:g} of the steps")
    return tuple((label, static_fields(chosen))
                 for chosen, label in found.items() if len(chosen) < steps)


def static_fields(computed) -> dict:
    """The partial CMConfig of one static schedule: these steps computed, the reused residual
    forecast linearly, no probe or tail block."""
    return {"deepcache": {"steps": list(computed)}, "bn_blocks": 0, "forecast": 1}


def run_static_schedules(solver: str, steps: int, shift: float) -> tuple:
    """static_schedules of the sigmas a run of this solver, step count and shift steps through."""
    from .schedulers import make_scheduler
    return static_schedules([float(s) for s in make_scheduler(solver, steps, shift).sigmas])


def space(solver: str, steps: int, shift: float) -> tuple:
    """What `python -m commands.calibrate --budget` measures for a run of this schedule: SPACE
    and the static schedules of its sigmas."""
    return SPACE + run_static_schedules(solver, steps, shift)


@dataclass(frozen=True)
class Choice:
    label: str
    fields: dict  # partial CMConfig, as a preset
    bound: float  # the error the choice promises for a draw it has not seen
    computed: float  # mean computed fraction of block evaluations on the calibration draws
    computed_bound: float  # the most it may compute on a draw it has not seen
    typical: float  # geometric mean error over every draw it ran (typical())


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


def typical(errors) -> float:
    """The geometric mean of the errors above 0 (the draws that reused); 0 if none did, inf if
    a draw diverged (NaN or Infinity)."""
    if any(not math.isfinite(e) for e in errors):
        return math.inf
    reused = [e for e in errors if e > 0.0]
    return math.exp(_log_stats(reused)[0]) if reused else 0.0


FURTHER = ("screen", "confirm")  # where a candidate's further draws sit, beside its calibration


def errors_of(c) -> list:
    """A candidate's errors on every draw it ran: the calibration draws and, where it was
    screened or confirmed, those draws."""
    return list(c["rel_l2"]) + [e for k in FURTHER for e in c.get(k, {}).get("rel_l2", ())]


def computed_of(c) -> list:
    return list(c["computed"]) + [f for k in FURTHER for f in c.get(k, {}).get("computed", ())]


def pooled_spread(candidates) -> float:
    """The spread of log errors between the calibration draws, pooled over the configurations
    that reused on every draw and stayed finite (one that reused nothing on a draw has no log
    error there, one that diverged none that means anything). The screen draws stay out of it:
    they are run only by the few configurations a target would choose."""
    variances = [_log_stats(c["rel_l2"])[1] ** 2 for c in candidates
                 if len(c["rel_l2"]) > 1 and all(0.0 < e < math.inf for e in c["rel_l2"])]
    return math.sqrt(sum(variances) / len(variances)) if variances else 0.0


def order_bound(errors) -> float:
    """A distribution-free one-sided 95% prediction bound for one more draw: the
    ceil(0.95 (n + 1))-th smallest of n errors, the largest below 39 draws."""
    ranked = sorted(errors)
    return ranked[min(len(ranked), -(-95 * (len(ranked) + 1) // 100)) - 1]


def bounds(candidates) -> list[float]:
    """Each configuration's error bound for a draw it has not seen (see the module's text), over
    its calibration and screen draws, and at least its every confirm draw's error. The draws on
    which a configuration reused nothing (no error) are left out of its statistics."""
    pooled = pooled_spread(candidates)
    out = []
    for c in candidates:
        confirmed = list(c.get("confirm", {}).get("rel_l2", ()))
        # a confirm draw that diverged (NaN) breaks any promise
        floor = max((e if math.isfinite(e) else math.inf for e in confirmed), default=0.0)
        errors = [e for e in list(c["rel_l2"]) + list(c.get("screen", {}).get("rel_l2", ()))
                  if e > 0.0]
        if not errors:  # never reused on any calibration or screen draw
            out.append(floor)
            continue
        n = len(errors)
        mean, spread = _log_stats(errors)
        out.append(max(floor, order_bound(errors),
                       math.exp(mean + t95(max(n - 1, 1)) * max(spread, pooled)
                                * math.sqrt(1.0 + 1.0 / n))))
    return out


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


CHAOS = 5.0  # a draw whose bf16 floor is over this many times the calibration draws' median


def screen(budget: dict, seeds, run, done=None, confirm_seeds=(), floor=None) -> dict:
    """The budget block screened on the draws `seeds` and, where `confirm_seeds` are given, its
    error budgets' choices confirmed on those (see the module's text); run(candidate, seed) ->
    (final-latent rel L2 against the uncached run of that draw, computed fraction);
    done(candidate), if given, each time a candidate's screen or confirmation is in.

    With floor(seed) -> the rel L2 of that draw's uncached run with its weights rounded to bf16,
    a draw on which some configuration breaks its promise is first checked: where the floor is
    over CHAOS x the calibration draws' median floor, the draw is chaotic (no cache can be held
    to a small budget there; bf16 weights alone move its object) and is set aside for every
    configuration, its seed and floor kept in "chaotic" (see the module's text)."""
    seeds, confirm_seeds = list(seeds), list(confirm_seeds)
    candidates = [dict(c) for c in budget["candidates"]]
    block = {**budget, "screen_seeds": seeds, "candidates": candidates}
    if confirm_seeds:
        block["confirm_seeds"] = confirm_seeds
    floors = {}  # seed -> floor, measured where a promise broke (and on the calibration draws)

    def chaotic(seed) -> bool:
        if floor is None:
            return False
        if not floors:  # the baseline: what bf16 rounding does to an ordinary draw
            for s in budget["seeds"]:
                floors[s] = floor(s)
            block["floor_baseline"] = statistics.median(floors[s] for s in budget["seeds"])
        if seed not in floors:
            floors[seed] = floor(seed)
        return floors[seed] > CHAOS * block["floor_baseline"]

    def set_aside(key, draws, seed):
        """The chaotic draw out of `draws` and out of every candidate's runs of it."""
        k = draws.index(seed)
        del draws[k]
        for c in candidates:
            ran = c.get(key)
            if ran is not None and len(ran["rel_l2"]) > k:
                c[key] = {f: v[:k] + v[k + 1:] for f, v in ran.items()}
        aside = block.setdefault("chaotic", {"seeds": [], "floor_rel_l2": []})
        aside["seeds"].append(seed)
        aside["floor_rel_l2"].append(floors[seed])

    def todo(key, draws, chosen):
        return sorted(i for i in chosen if len(candidates[i].get(key, {}).get("rel_l2", ()))
                      < len(draws))

    def next_job():
        """Screen what some target chooses; once all of it is screened, confirm what an error
        budget chooses (a broken confirmation moves a choice, which is screened first)."""
        if indices := todo("screen", seeds, reachable(block)):
            return "screen", seeds, indices
        return "confirm", confirm_seeds, todo("confirm", confirm_seeds,
                                              reachable(block, speedup=False))

    while (job := next_job())[2]:
        key, draws, indices = job
        promised = bounds(candidates)
        for i in indices:  # one stopped before and still chosen goes on where it stopped
            errors = list(candidates[i].get(key, {}).get("rel_l2", ()))
            fractions = list(candidates[i].get(key, {}).get("computed", ()))
            for seed in draws[len(errors):]:
                error, fraction = run(candidates[i], seed)
                if not error <= promised[i] and math.isfinite(error) and chaotic(seed):
                    set_aside(key, draws, seed)
                    continue
                errors.append(error)
                fractions.append(fraction)
                if not error <= promised[i]:  # over its promise, or diverged (NaN)
                    break
            candidates[i][key] = {"rel_l2": errors, "computed": fractions}
            if done is not None:
                done(candidates[i])
    return block


def computed_bound(computed) -> float:
    """The computed fraction a configuration may reach on a draw it has not seen: a one-sided 95%
    prediction bound over the calibration draws, at least their max. A static schedule computes
    the same on every draw; a threshold's count moves with the draw, and the calibration max alone
    let a speedup target slip on unseen draws (0.501 computed for speedup 2 on the held-out Wan)."""
    n = len(computed)
    mean = sum(computed) / n
    if n < 2 or min(computed) == max(computed):
        # the same on every draw (a static schedule): exactly that, where the summed mean can
        # land an ulp above it and lose a speedup it meets exactly (0.2 for speedup 5)
        return max(computed)
    spread = math.sqrt(sum((x - mean) ** 2 for x in computed) / (n - 1))
    return min(1.0, max(max(computed), mean + t95(n - 1) * spread * math.sqrt(1.0 + 1.0 / n)))


def _choices(budget: dict) -> list[tuple[int, Choice]]:
    """(index in budget.candidates, Choice) of every configuration a target may choose."""
    # a configuration that computed every block on every draw is the uncached run by another
    # name: it promises nothing about caching (issue 39: such a choice was reported as a technique)
    measured = [(i, c) for i, c in enumerate(budget["candidates"])
                if all(math.isfinite(e) for e in errors_of(c)) and min(computed_of(c)) < 1.0]
    out = []
    for (i, c), bound in zip(measured, bounds([c for _, c in measured]), strict=True):
        computed = computed_of(c)
        out.append((i, Choice(c["label"], c["config"], bound, sum(computed) / len(computed),
                              computed_bound(computed), typical(errors_of(c)))))
    return out


def _pick(choices, rel_err, speedup):
    if rel_err is not None:
        within = [x for x in choices if x[1].bound <= rel_err]
        return min(within, key=lambda x: (x[1].computed, x[1].bound), default=None)
    fast = [x for x in choices if x[1].computed_bound * speedup <= 1.0 + 1e-9]
    return min(fast, key=lambda x: (x[1].typical, x[1].computed), default=None)


def choose(budget: dict, *, rel_err: float | None = None,
           speedup: float | None = None) -> Choice | None:
    """The configuration for one target, or None when caching cannot promise it (run uncached)."""
    if (rel_err is None) == (speedup is None):
        raise BudgetError("give one target: a relative-error budget or a speedup")
    picked = _pick(_choices(budget), rel_err, speedup)
    return None if picked is None else picked[1]


def reachable(budget: dict, *, speedup: bool = True) -> set[int]:
    """The candidates (indices) that some target chooses (with speedup False, some error
    budget): an error budget's choice changes only at a bound, a speedup's only at a computed
    bound, so trying those targets tries them all."""
    choices = _choices(budget)
    picks = [_pick(choices, c.bound, None) for _, c in choices]
    if speedup:
        picks += [_pick(choices, None, 1.0 / c.computed_bound) for _, c in choices
                  if c.computed_bound > 0]
    return {x[0] for x in picks if x is not None}

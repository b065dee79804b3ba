"""Calibration, whatever runs the samples: the TeaCache fit and MagCache ratios from uncached runs,
and budgeted mode's measurement, screening and confirmation of configurations against the
uncached run of each draw. What runs a sample is injected, so our calibrate command (our
pipelines on our backends, commands/calibrate.py) and the diffusers adapter (a diffusers
pipeline with the gate on it, adapters/diffusers/calibrate.py) measure, fit and write the same
profile from the same code.

The runners it is given:
- `observed_run(seed, draw, observe) -> trace rows`: one uncached run (TeaCache threshold 0:
  every call computes, every signature measured) of the draw, calling observe(step, branch,
  expert, output on the host) on every model output;
- `once(config, seed, draw, fresh=False) -> (final latents on the host, computed fraction of
  block evaluations)`; fresh: the weights changed since the last run (the bf16 floor).
"""

from __future__ import annotations

import contextlib
import json

import numpy as np
import torch

from cache import CMConfig, magcache
from cache.teacache_profiles import check_profile
from cache.validate import FieldError

from . import budget, budget_profile, progress
from .errors import StageFileError
from .journal import atomic_write

MIN_R2 = 0.8  # below: the curve predicts the output's change too poorly to gate on
FLOOR = {"uncached": "weights rounded to bf16"}  # the floor's key among the runs kept
THRESHOLD = 0.15  # the threshold a profile suggests (each run gives its own)


class OutputChanges:
    """Observer of one run, per (step, branch): the relative L1 change of the output since the
    branch's previous call (TeaCache's fit), and MagCache's magnitude ratio, the mean over
    tokens of |out| / |previous out| with the norm over the channels."""

    def __init__(self):
        self.last, self.changes, self.ratios = {}, {}, {}

    def __call__(self, step, branch, expert, host):
        host = host.double()
        prev = self.last.get(branch)
        if prev is not None:
            self.changes[(step, branch)] = ((host - prev).abs().mean() / prev.abs().mean()).item()
            norms = host.norm(dim=1), prev.norm(dim=1)  # [B, C, F, H, W]: per token
            self.ratios[(step, branch)] = (norms[0] / norms[1].clamp_min(1e-30)).mean().item()
        self.last[branch] = host


def collect(observed_run, draws: dict, *, steps: int | None = None):
    """([(expert, rel, output change)] over every call of every draw, MagCache's ratios:
    branch -> one per step, step 0's 1, each the mean over the draws). steps: of every run
    (None: the first run's trace says)."""
    pairs, ratios = [], {}
    for seed, draw in draws.items():
        observed = OutputChanges()
        rows = observed_run(seed, draw, observed)
        if steps is None:
            steps = 1 + max(row["step"] for row in rows)
        for row in rows:
            key = (row["step"], row["branch"])
            if row["rel"] is not None and key in observed.changes:
                pairs.append((row["expert"], row["rel"], observed.changes[key]))
        for (step, branch), ratio in observed.ratios.items():
            ratios.setdefault(branch, [[] for _ in range(steps)])[step].append(ratio)
    mag = {branch: [sum(v) / len(v) if v else 1.0 for v in per_step]
           for branch, per_step in ratios.items()}
    return pairs, mag


def fit(pairs, degree: int) -> dict:
    """Coefficients (highest power first) over all pairs and per expert, with R^2 and the range
    of rel values each fit saw (the gate counts evaluations outside it)."""
    def one(points):
        x = np.array([p[1] for p in points])
        y = np.array([p[2] for p in points])
        coefficients = np.polyfit(x, y, degree)
        residual = y - np.polyval(coefficients, x)
        r2 = 1.0 - residual.var() / y.var() if y.var() > 0 else 1.0
        return [float(c) for c in coefficients], float(r2), len(points), [float(x.min()),
                                                                           float(x.max())]

    coefficients, r2, n, rel_range = one(pairs)
    out = {"coefficients": coefficients, "r2": r2, "points": n, "rel_range": rel_range,
           "experts": {}, "experts_r2": {}, "experts_rel_range": {}}
    experts = sorted({p[0] for p in pairs if p[0] is not None})
    for expert in experts:
        points = [p for p in pairs if p[0] == expert]
        if len(points) > degree + 1:
            (out["experts"][expert], out["experts_r2"][expert], _,
             out["experts_rel_range"][expert]) = one(points)
    return out


def fit_warnings(result: dict, signal: str) -> list[str]:
    """A fit whose R^2 (overall or of an expert) is below MIN_R2, and what to do about it."""
    poor = [(name, r2) for name, r2 in [("overall", result["r2"]), *result["experts_r2"].items()]
            if r2 < MIN_R2]
    if not poor:
        return []
    fits = ", ".join(f"{name} R^2 {r2:.2f}" for name, r2 in poor)
    return [f"poor fit ({fits}; below {MIN_R2}): the {signal} signal's change predicts the "
            "output's change badly on this model, so a poly: policy from this profile gates "
            "little better than chance; calibrate with more --samples, another "
            "--teacache_signal or --degree, or use the linear policy with --teacache_relative "
            "true (no profile needed)"]


def profile_of(result: dict, ratios: dict, *, signal: str, steps: int, source: str,
               fingerprints: dict) -> dict:
    """The profile `--teacache_policy poly:<file>` and `--magcache_profile <file>` load: the fit,
    the magnitude ratios of the same runs, and which weights they hold for (a run on others
    refuses it)."""
    return {
        "signal": signal, "threshold": THRESHOLD, "warmup": 1, "source": source,
        "weights_fingerprint": fingerprints,
        **result,
        magcache.PROFILE_KEY: {**{b: [round(x, 6) for x in v] for b, v in ratios.items()},
                               "steps": steps, "measured_on": "model output (velocity)"},
    }


@contextlib.contextmanager
def bf16_rounded(models):
    """The models (torch modules) with every weight rounded to bf16 and back, restored after:
    the perturbation any bf16 deployment makes, with no caching at all."""
    params = [p for m in models for p in m.parameters()]
    saved = [p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            for p in params:
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
        yield
    finally:
        with torch.no_grad():
            for p, keep in zip(params, saved, strict=True):
                p.copy_(keep)


def scorer(once, draws: dict, memo=None, models=None):
    """score(fields, seed) -> (final-latent rel L2 against the uncached run of the same draw,
    computed fraction); each draw's uncached run once, when first needed; with a RunMemo
    (sampling/calibration_runs.py), a run it holds is not run again and every new one goes in.
    With `models` (the torch modules the runs use), score.floor(seed) is the rel L2 of the
    draw's uncached run with those weights rounded to bf16 (sampling/budget.py screen)."""
    from cache.flags import config_from_fields

    from .fidelity import fidelity

    refs = {}

    def ref(seed):
        if seed not in refs:
            refs[seed] = once(CMConfig(), seed, draws[seed])[0]
        return refs[seed]

    def kept(fields, seed, measure):
        if memo is not None and (found := memo.get(fields, seed)) is not None:
            return found
        out = measure()
        if memo is not None:
            memo.add(fields, seed, *out)
        return out

    def score(fields, seed):
        def measure():
            latents, fraction = once(config_from_fields(fields), seed, draws[seed])
            return float(fidelity(latents, ref(seed))["rel_l2"]), float(fraction)
        return kept(fields, seed, measure)

    def floor(seed):
        def measure():
            with bf16_rounded(models):
                latents = once(CMConfig(), seed, draws[seed], fresh=True)[0]
            return float(fidelity(latents, ref(seed))["rel_l2"]), 1.0
        return kept(FLOOR, seed, measure)[0]

    score.floor = None if models is None else floor
    return score


def measure_space(once, draws: dict, *, space, log=None, memo=None) -> list[dict]:
    """Budgeted mode's calibration: every (label, fields) of `space` on every draw, each against
    the uncached run of the same draw. [{label, config, rel_l2: [per draw], computed: [per
    draw]}]; computed is the fraction of block evaluations (a reuse runs the probe and tail);
    with `memo` (a RunMemo) the runs it holds are not run again."""
    score = scorer(once, draws, memo)
    out = []
    with progress.bar(len(draws) * len(space), "calibrating (configuration x draw)",
                      unit="run") as shown:
        for label, fields in space:
            errors, fractions = [], []
            for seed in draws:
                shown.set_postfix_str(f"{label}, seed {seed}", refresh=False)
                error, fraction = score(fields, seed)
                errors.append(error)
                fractions.append(fraction)
                shown.update(1)
            out.append({"label": label, "config": fields, "rel_l2": errors, "computed": fractions})
            if log is not None:
                log(f"  {label}: rel L2 {' '.join(f'{e:.2e}' for e in errors)}, computed "
                    f"{' '.join(f'{f:.3f}' for f in fractions)}")
    return out


def screen_space(once, block, screen_draws: dict, *, confirm_draws=None, log=None, memo=None,
                 models=None, calibration_draws=None) -> dict:
    """Budgeted mode's screening (sampling/budget.py screen): every candidate that some target
    chooses run on the screen draws too, against their uncached runs, until the choices are all
    screened; with confirm_draws, every one an error budget chooses then confirmed on those;
    with `memo` (a RunMemo) the runs it holds are not run again. With `models` (the torch
    modules `once` runs) and the calibration draws, a draw a promise breaks on is set aside
    where it is chaotic (its bf16 floor; sampling/budget.py)."""
    confirm_draws = confirm_draws or {}
    if models is not None and set(calibration_draws or ()) != set(block["seeds"]):
        raise ValueError("screen_space: the chaos check needs the calibration draws "
                         f"(seeds {block['seeds']})")
    score = scorer(once, {**(calibration_draws or {}), **screen_draws, **confirm_draws}, memo,
                   models)

    def run(candidate, seed):
        shown.set_postfix_str(f"{candidate['label']}, seed {seed}", refresh=False)
        shown.update(1)
        return score(candidate["config"], seed)

    def done(c):
        if log is not None:
            for key, said in (("screen", "screened"), ("confirm", "confirmed")):
                if key in c:
                    log(f"  {c['label']}: {said} rel L2 "
                        + " ".join(f"{e:.2e}" for e in c[key]["rel_l2"]))

    with progress.bar(None, "screening (configuration x draw)", unit="run") as shown:
        return budget.screen(block, list(screen_draws), run, done,
                             confirm_seeds=list(confirm_draws), floor=score.floor)


def budget_block(candidates, *, pipe_name, seeds, steps, solver, shift) -> dict:
    """The profile's "budget" entry: what was measured and the margin learned from it."""
    return {"format": budget_profile.FORMAT, "model": pipe_name, "seeds": list(seeds),
            "steps": steps, "solver": solver, "shift": shift,
            "pooled_log_spread": budget.pooled_spread(candidates),
            "candidates": candidates}


def summary_lines(calls: int, result: dict, out: str, warnings=(), block=None) -> list[str]:
    """A calibration's summary as our calibrate command prints it."""
    lines = [f"{calls} calls; fit R^2 {result['r2']:.3f}"
             + "".join(f", {e} {r:.3f}" for e, r in result["experts_r2"].items())
             + f"; wrote {out}"]
    lines += [f"warning: {w}" for w in warnings]
    b = block
    if b:
        screened = sum("screen" in c for c in b["candidates"])
        confirmed = sum("confirm" in c for c in b["candidates"])
        lines.append(f"budget: {len(b['candidates'])} configurations on {len(b['seeds'])} draws "
                     f"(seeds {b['seeds'][0]}..{b['seeds'][-1]}), pooled spread of log errors "
                     f"{b['pooled_log_spread']:.2f}"
                     + (f"; {screened} screened on {len(b['screen_seeds'])} more draws"
                        if b.get("screen_seeds") else "")
                     + (f"; {confirmed} confirmed on {len(b['confirm_seeds'])} more"
                        if b.get("confirm_seeds") else "")
                     + (f"; {len(b['chaotic']['seeds'])} chaotic draws set aside (seeds "
                        f"{', '.join(map(str, b['chaotic']['seeds']))}: uncached with bf16 "
                        f"weights they err over {budget.CHAOS:g}x the calibration draws' "
                        f"{b['floor_baseline']:.1e})" if b.get("chaotic") else "")
                     + "; bound for an unseen draw (95%):")
        for c, bound in zip(b["candidates"], budget.bounds(b["candidates"]), strict=True):
            computed = budget.computed_of(c)
            lines.append(f"  {c['label']}: rel L2 <= {bound:.2e}, computed "
                         f"{sum(computed) / len(computed):.3f}"
                         + (" (screened)" if "screen" in c else "")
                         + (" (confirmed)" if "confirm" in c else ""))
    return lines


def profile_files(budget_profile: str | None, config: CMConfig) -> tuple[tuple[str, str], ...]:
    """(flag, path) of every calibrated profile file a run with `config` uses."""
    files = [("--budget_profile", budget_profile)] if budget_profile else []
    tc = config.teacache
    if tc is not None and tc.policy.startswith("poly:") and tc.policy.endswith(".json"):
        files.append(("--teacache_policy", tc.policy.removeprefix("poly:")))
    if config.magcache is not None and config.magcache.profile is not None:
        files.append(("--magcache_profile", config.magcache.profile))
    return tuple(files)


def recorded_weights(files, fingerprints: dict):
    """(flag, path, what the profile records) of each profile in `files` calibrated on other
    weights than `fingerprints` (expert -> fingerprint), the record None where a profile holds
    none (written before profiles did). A file that cannot be read is left to its loader."""
    ours = json.loads(json.dumps(fingerprints))  # as a profile holds them (expert None: "null")
    out = []
    for flag, path in files:
        try:
            with open(path) as fh:
                recorded = json.load(fh).get("weights_fingerprint")
        except (OSError, ValueError, AttributeError):
            continue  # the profile's own loader says what is wrong with it
        if recorded != ours:
            out.append((flag, path, recorded))
    return out


def write_profile(path: str, profile: dict, flag: str = "--out") -> None:
    """Write the profile, once the loaders would take it back (`--teacache_policy poly:`, and
    `--budget_profile` with the budget): a fit that is not finite is refused, not written."""
    written = json.loads(json.dumps(profile))  # what the loaders will parse
    try:
        check_profile(written, path)
        if "budget" in written:
            budget_profile.check(written)
    except FieldError as exc:
        raise StageFileError(f"{flag} {path}: the calibration gave a profile its loader would "
                             f"refuse ({exc}); not written") from None
    try:
        atomic_write(path, lambda f: json.dump(profile, f, indent=1))
    except OSError as exc:
        raise StageFileError(f"{flag} {path} could not be written: "
                             f"{exc.strerror or exc}") from None

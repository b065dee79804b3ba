"""Calibrate TeaCache and MagCache for a model: fit the polynomial that maps the signature's
relative change to the model output's relative change, and write it as a profile
`--teacache_policy poly:<file>` loads (one fit per expert for Wan2.2 I2V-A14B, and one over all
calls); the same runs' magnitude ratios go in its `magcache` block (`--magcache_profile <file>`).

    python calibrate.py --model wan-tiny-i2v --samples 3 --out profile.json

Each sample is an uncached run (threshold 0: nothing is skipped) on its own seed; every model call
gives a pair (signature change, output change), the output change being
mean |out_t - out_{t-1}| / mean |out_{t-1}| of the same branch. The fit is numpy.polyfit.

With --budget it also runs every configuration budgeted mode chooses from (sampling/budget.py)
on the samples and stores their errors and computed fractions in the same profile:

    python calibrate.py --model wan-tiny-ti2v --samples 3 --budget --out profile.json
    python stage2_transformer_flax_deepcache.py --model wan-tiny-ti2v \
        --budget_profile profile.json --budget_rel_err 5e-3 --compare

With --screen_draws N the configurations a target would choose also run on N further draws, so
one that flips a rare fragile prompt is not chosen (sampling/budget.py screen).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
from dataclasses import dataclass

import numpy as np
import torch

from cache import CMConfig, TeaCacheConfig, magcache
from cache.teacache_profiles import SIGNALS, check_profile
from cache.validate import FieldError
from modules import ops
from modules.checkpoint import model_fingerprint
from modules.layers import ModelConfigError
from modules.layouts import CheckpointError
from sampling import budget, progress
from sampling.cli import CommandParser, as_int, command
from sampling.errors import StageFileError, UsageError
from sampling.journal import atomic_write
from sampling.pipelines import DEFAULT_PIPELINE, PIPELINES, Pipeline, get_pipeline
from sampling.run import make_sample, sample_once
from sampling.run_spec import check_path
from sampling.schedulers import SchedulerError
from sampling.stage_io import check_writable_file
from sampling.stages import SignalPlan

from .calibration_runs import RunMemo
from .calibration_runs import identity as runs_identity
from .stage2_backend import load_models


class OutputChanges:
    """Observer of one run, per (step, branch): the relative L1 change of the output since the
    branch's previous call (TeaCache's fit), and MagCache's magnitude ratio, the mean over
    tokens of |out| / |previous out| with the norm over the channels."""

    def __init__(self, backend):
        self.backend, self.last, self.changes, self.ratios = backend, {}, {}, {}

    def __call__(self, step, branch, expert, out):
        host = self.backend.get(out).double()
        prev = self.last.get(branch)
        if prev is not None:
            self.changes[(step, branch)] = ((host - prev).abs().mean() / prev.abs().mean()).item()
            norms = host.norm(dim=1), prev.norm(dim=1)  # [B, C, F, H, W]: per token
            self.ratios[(step, branch)] = (norms[0] / norms[1].clamp_min(1e-30)).mean().item()
        self.last[branch] = host


def collect(backend, pipe, tensors_by_seed, latent_shape, *, signal, steps, solver, shift):
    """([(expert, rel, output change)] over every call of every sample, MagCache's ratios:
    branch -> one per step, step 0's 1, each the mean over the samples)."""
    config = CMConfig(teacache=TeaCacheConfig(threshold=0.0, signal=signal))
    pairs, ratios = [], {}
    for seed, tensors in tensors_by_seed.items():
        sample = make_sample(backend, pipe, tensors, latent_shape, image=pipe.task == "i2v",
                             seed=seed)
        observed = OutputChanges(backend)
        traj = sample_once(backend, config, sample, solver=solver, steps=steps, shift=shift,
                           observe=observed)
        for row in traj.gate.telemetry.trace:
            key = (row["step"], row["branch"])
            if row["rel"] is not None and key in observed.changes:
                pairs.append((row["expert"], row["rel"], observed.changes[key]))
        for (step, branch), ratio in observed.ratios.items():
            ratios.setdefault(branch, [[] for _ in range(steps)])[step].append(ratio)
    mag = {branch: [sum(v) / len(v) if v else 1.0 for v in per_step]
           for branch, per_step in ratios.items()}
    return pairs, mag


def _runner(make_backend, pipe, latent_shape, *, steps, solver, shift):
    """once(config, seed, tensors) -> (final latents on the host, computed fraction of block
    evaluations; a reuse runs the probe and tail), one backend per probe/tail/signal plan."""
    backends = {}
    blocks = pipe.config.num_layers

    def once(config, seed, tensors, fresh=False):
        plan = SignalPlan.from_config(config)
        if fresh:  # weights changed since the plan's backend was made (a JAX one holds a copy)
            backend = make_backend(plan)
        else:  # one backend (one set of programs) per probe/tail/signal plan
            if plan not in backends:
                backends[plan] = make_backend(plan)
            backend = backends[plan]
        sample = make_sample(backend, pipe, tensors, latent_shape, image=pipe.task == "i2v",
                             seed=seed)
        traj = sample_once(backend, config, sample, solver=solver, steps=steps, shift=shift)
        rows = traj.gate.telemetry.trace
        reuse = plan.fn_blocks + plan.reuse_tail_blocks
        ran = sum(blocks if r["action"] == "compute" else reuse for r in rows)
        return backend.get(traj.latents), ran / (blocks * len(rows))

    return once


FLOOR = {"uncached": "weights rounded to bf16"}  # the floor's key among the runs kept


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


def _scorer(once, tensors_by_seed, memo=None, models=None):
    """score(fields, seed) -> (final-latent rel L2 against the uncached run of the same draw,
    computed fraction); each draw's uncached run once, when first needed; with a RunMemo
    (commands/calibration_runs.py), a run it holds is not run again and every new one goes in.
    With `models` (the torch modules the backends run), score.floor(seed) is the rel L2 of the
    draw's uncached run with those weights rounded to bf16 (sampling/budget.py screen)."""
    from cache.flags import config_from_fields
    from sampling.fidelity import fidelity

    refs = {}

    def ref(seed):
        if seed not in refs:
            refs[seed] = once(CMConfig(), seed, tensors_by_seed[seed])[0]
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
            latents, fraction = once(config_from_fields(fields), seed, tensors_by_seed[seed])
            return float(fidelity(latents, ref(seed))["rel_l2"]), float(fraction)
        return kept(fields, seed, measure)

    def floor(seed):
        def measure():
            with bf16_rounded(models):
                latents = once(CMConfig(), seed, tensors_by_seed[seed], fresh=True)[0]
            return float(fidelity(latents, ref(seed))["rel_l2"]), 1.0
        return kept(FLOOR, seed, measure)[0]

    score.floor = None if models is None else floor
    return score


def measure_space(make_backend, pipe, tensors_by_seed, latent_shape, *, steps, solver, shift,
                  space, log=None, memo=None):
    """Budgeted mode's calibration: every (label, fields) of `space` on every draw, each against
    the uncached run of the same draw. [{label, config, rel_l2: [per draw], computed: [per
    draw]}]; computed is the fraction of block evaluations (a reuse runs the probe and tail);
    with `memo` (a RunMemo) the runs it holds are not run again."""
    score = _scorer(_runner(make_backend, pipe, latent_shape, steps=steps, solver=solver,
                            shift=shift), tensors_by_seed, memo)
    out = []
    with progress.bar(len(tensors_by_seed) * len(space), "calibrating (configuration x draw)",
                      unit="run") as shown:
        for label, fields in space:
            errors, fractions = [], []
            for seed in tensors_by_seed:
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


def screen_space(make_backend, pipe, block, screen_tensors, latent_shape, *, confirm_tensors=None,
                 log=None, memo=None, models=None, calibration_tensors=None) -> dict:
    """Budgeted mode's screening (sampling/budget.py screen): every candidate that some target
    chooses run on the screen draws too, against their uncached runs, until the choices are all
    screened; with confirm_tensors, every one an error budget chooses then confirmed on those;
    with `memo` (a RunMemo) the runs it holds are not run again. With `models` (the torch
    modules make_backend's backends run) and the calibration draws' tensors, a draw a promise
    breaks on is set aside where it is chaotic (its bf16 floor; sampling/budget.py)."""
    confirm_tensors = confirm_tensors or {}
    if models is not None and set(calibration_tensors or ()) != set(block["seeds"]):
        raise ValueError("screen_space: the chaos check needs the calibration draws' tensors "
                         f"(seeds {block['seeds']})")
    score = _scorer(_runner(make_backend, pipe, latent_shape, steps=block["steps"],
                            solver=block["solver"], shift=block["shift"]),
                    {**(calibration_tensors or {}), **screen_tensors, **confirm_tensors}, memo,
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
        return budget.screen(block, list(screen_tensors), run, done,
                             confirm_seeds=list(confirm_tensors), floor=score.floor)


def budget_block(candidates, *, pipe_name, seeds, steps, solver, shift) -> dict:
    """The profile's "budget" entry: what was measured and the margin learned from it."""
    return {"format": budget.FORMAT, "model": pipe_name, "seeds": list(seeds), "steps": steps,
            "solver": solver, "shift": shift, "pooled_log_spread": budget.pooled_spread(candidates),
            "candidates": candidates}


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


def build_parser() -> argparse.ArgumentParser:
    ap = CommandParser(prog="calibrate.py", description=__doc__.splitlines()[0],
                       common={"model", "model_path", "samples", "out", "budget", "backend"})
    g = ap.add_argument_group("inputs and model")
    g.add_argument("--model", default=DEFAULT_PIPELINE, choices=tuple(PIPELINES),
                   help="named pipeline")
    g.add_argument("--model_path", help="checkpoint (default: the model's built-in or tiny random "
                   "weights)")
    g.add_argument("--samples", type=int, default=3, help="runs, each on its own seed")
    g.add_argument("--num_inference_steps", type=int, help="default: the model's")
    g = ap.add_argument_group("caching")
    g.add_argument("--teacache_signal", choices=SIGNALS, default="modulated_input",
                   help="what the TeaCache signature summarises")
    g.add_argument("--degree", type=int, default=4, help="degree of the rescaling polynomial")
    g = ap.add_argument_group("advanced")
    g.add_argument("--backend", choices=("jax", "torch"), default="torch", help="where the "
                   "samples run")
    g = ap.add_argument_group("outputs and reports")
    g.add_argument("--out", required=True, help="profile JSON to write")
    g = ap.add_argument_group("caching")
    g.add_argument("--first_seed", type=int, default=0,
                    help="the samples' seeds are first_seed, first_seed + 1, ... (keep them apart "
                         "from the seeds the budget will be used on)")
    g.add_argument("--budget", action="store_true",
                    help="also run every configuration budgeted mode chooses from on the samples "
                         "(final-latent error and computed fraction against uncached), for "
                         "--budget_profile with --budget_rel_err/--budget_speedup; needs "
                         "--samples >= 2 (the margin is learned from their spread)")
    g.add_argument("--screen_draws", type=int, default=0,
                    help="with --budget: run every configuration a target would choose on this "
                         "many further draws (seeds after the samples'), again until the choices "
                         "are all screened, so a configuration that flips a rare fragile prompt "
                         "drops out (on the trained HunyuanVideo-1.5 twin, 3 draws alone missed 4 "
                         "of 48 error budget runs on its page's 16 draws); 0: none")
    g.add_argument("--confirm_draws", type=int, default=0,
                    help="with --budget: once screened, run every configuration an error budget "
                         "would choose on this many further draws (seeds after the screen "
                         "draws') against the bound it would be chosen on, so the luckiest of "
                         "many configurations is not chosen on luck (sampling/budget.py); 0: none")
    g.add_argument("--runs", help="with --budget: keep every finished configuration run in this "
                   "JSON-lines file as it lands; a rerun with the same file, weights and "
                   "settings takes the runs it holds instead of sampling them again (resume a "
                   "killed calibration; commands/calibration_runs.py)")
    return ap


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """A calibration, its flags checked: what to sample, how many times, and where it goes."""

    pipe: Pipeline
    model_path: str | None
    backend: str  # where the samples run: jax or torch
    samples: int
    steps: int
    first_seed: int
    signal: str  # what the TeaCache signature summarises
    degree: int
    budget: bool  # also measure every configuration budgeted mode chooses from
    screen_draws: int  # ...and screen the ones a target chooses on this many further draws
    confirm_draws: int  # ...and confirm the ones an error budget chooses on this many more
    out: str
    runs: str | None = None  # where finished budget runs are kept, and resumed from


def resolve(args) -> Calibration:
    """The flags, checked before any model is loaded or program compiled."""
    pipe = get_pipeline(args.model)
    samples = as_int("--samples", args.samples, minimum=1)
    steps = as_int("--num_inference_steps", args.num_inference_steps
                   if args.num_inference_steps is not None else pipe.steps, minimum=2,
                   expected="an integer >= 2 (a change needs two steps)")
    degree = as_int("--degree", args.degree, minimum=0)
    if samples * (steps - 1) <= degree:
        raise UsageError(f"--degree {degree}: a fit of degree {degree} needs more than {degree} "
                         f"points, and --samples {samples} x {steps - 1} changes give "
                         f"{samples * (steps - 1)}; expected a lower degree or more samples/steps")
    first_seed = as_int("--first_seed", args.first_seed, minimum=0, maximum=2 ** 63 - samples)
    if args.budget and samples < 2:
        raise UsageError(f"--budget learns its safety margin from the spread between samples; "
                         f"--samples {samples}: expected 2 or more")
    screen = as_int("--screen_draws", args.screen_draws, minimum=0)
    if screen and not args.budget:
        raise UsageError(f"--screen_draws {screen}: screening runs the budget's configurations; "
                         "expected --budget with it")
    confirm = as_int("--confirm_draws", args.confirm_draws, minimum=0)
    if confirm and not args.budget:
        raise UsageError(f"--confirm_draws {confirm}: confirmation runs the budget's "
                         "configurations; expected --budget with it")
    if first_seed + samples + screen + confirm > 2 ** 63:
        raise UsageError(f"--first_seed {first_seed}: the samples', screen and confirm draws' "
                         f"seeds run past 2**63; expected a smaller --first_seed")
    if args.runs is not None and not args.budget:
        raise UsageError(f"--runs {args.runs}: it keeps the budget's configuration runs; "
                         "expected --budget with it")
    check_path("--model_path", args.model_path)
    check_writable_file("--out", args.out)
    if args.runs is not None:
        check_writable_file("--runs", args.runs)
    return Calibration(pipe=pipe, model_path=args.model_path, backend=args.backend,
                       samples=samples, steps=steps, first_seed=first_seed,
                       signal=args.teacache_signal, degree=degree, budget=args.budget,
                       screen_draws=screen, confirm_draws=confirm, out=args.out,
                       runs=args.runs)


def run(args) -> dict:
    return calibrate(resolve(args))


def _backend(kind: str, models: dict, plan):
    if kind == "torch":
        from torch_backend.backend import TorchBackend
        return TorchBackend(models, plan)
    from tpu.backend import JaxBackend
    return JaxBackend(models, plan)


def calibrate(spec: Calibration) -> dict:
    """Sample, fit, (measure the budget's configurations,) write the profile once, at the end."""
    pipe, steps = spec.pipe, spec.steps
    models = load_models(pipe, spec.model_path, torch.float32)
    plan = SignalPlan.from_config(CMConfig(teacache=TeaCacheConfig(signal=spec.signal)))
    backend = _backend(spec.backend, models, plan)
    shape = pipe.latent_shape(*pipe.size)
    seeds = range(spec.first_seed, spec.first_seed + spec.samples)
    tensors = {seed: pipe.synthesize(shape, True, pipe.task == "i2v", seed) for seed in seeds}
    fingerprints = {expert: model_fingerprint(m) for expert, m in models.items()}
    # read (and refuse) the runs file before any sampling
    memo = None if spec.runs is None else RunMemo(spec.runs, runs_identity(
        fingerprints, model=pipe.name, steps=steps, solver=pipe.solver, shift=pipe.shift,
        shape=shape, backend=spec.backend))
    if memo is not None and memo.resumed():
        print(memo.resumed(), file=sys.stderr, flush=True)
    pairs, ratios = collect(backend, pipe, tensors, shape, signal=spec.signal,
                            steps=steps, solver=pipe.solver, shift=pipe.shift)
    result = fit(pairs, spec.degree)
    profile = {
        "signal": spec.signal, "threshold": 0.15, "warmup": 1,
        "source": f"commands.calibrate: {pipe.name}, {spec.samples} samples x {steps} steps "
                  f"({pipe.solver}, shift {pipe.shift}), {datetime.date.today()}",
        # which weights these figures hold for: stage 2 refuses the profile for others
        "weights_fingerprint": fingerprints,
        **result,
        # MagCache's plan (--magcache_profile): the same runs' magnitude ratios
        magcache.PROFILE_KEY: {**{b: [round(x, 6) for x in v] for b, v in ratios.items()},
                               "steps": steps, "measured_on": "model output (velocity)"},
    }
    if spec.budget:
        candidates = measure_space(lambda plan: _backend(spec.backend, models, plan), pipe,
                                   tensors, shape, steps=steps, solver=pipe.solver,
                                   shift=pipe.shift,
                                   space=budget.space(pipe.solver, steps, pipe.shift),
                                   log=lambda line: print(line, flush=True), memo=memo)
        profile["budget"] = budget_block(candidates, pipe_name=pipe.name, seeds=list(seeds),
                                         steps=steps, solver=pipe.solver, shift=pipe.shift)
        if spec.screen_draws or spec.confirm_draws:
            def draws(first, count):
                return {seed: pipe.synthesize(shape, True, pipe.task == "i2v", seed)
                        for seed in range(first, first + count)}

            screen = draws(spec.first_seed + spec.samples, spec.screen_draws)
            confirm = draws(spec.first_seed + spec.samples + spec.screen_draws, spec.confirm_draws)
            profile["budget"] = screen_space(lambda plan: _backend(spec.backend, models, plan),
                                             pipe, profile["budget"], screen, shape,
                                             confirm_tensors=confirm,
                                             log=lambda line: print(line, flush=True), memo=memo,
                                             models=list(models.values()),
                                             calibration_tensors=tensors)
    _write(spec.out, profile)  # once, at the end: an interrupted run leaves the old profile
    return {"calls": len(pairs), "result": result, "out": spec.out,
            "budget": profile.get("budget"), "warnings": fit_warnings(result, spec.signal)}


MIN_R2 = 0.8  # below: the curve predicts the output's change too poorly to gate on


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


def format_summary(report: dict) -> str:
    result = report["result"]
    lines = [f"{report['calls']} calls; fit R^2 {result['r2']:.3f}"
             + "".join(f", {e} {r:.3f}" for e, r in result["experts_r2"].items())
             + f"; wrote {report['out']}"]
    lines += [f"warning: {w}" for w in report.get("warnings", [])]
    b = report.get("budget")
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
    return "\n".join(lines)


def _write(path, profile):
    """Write the profile, once the loaders would take it back (`--teacache_policy poly:`, and
    `--budget_profile` with the budget): a fit that is not finite is refused, not written."""
    written = json.loads(json.dumps(profile))  # what the loaders will parse
    try:
        check_profile(written, path)
        if "budget" in written:
            budget.check(written)
    except FieldError as exc:
        raise StageFileError(f"--out {path}: the calibration gave a profile its loader would "
                             f"refuse ({exc}); not written") from None
    try:
        atomic_write(path, lambda f: json.dump(profile, f, indent=1))
    except OSError as exc:
        raise StageFileError(f"--out {path} could not be written: {exc.strerror or exc}") from None


ERRORS = (UsageError, StageFileError, CheckpointError, ModelConfigError, SchedulerError,
          ops.OpError)

main = command(build_parser, run, format_summary, ERRORS)


if __name__ == "__main__":
    sys.exit(main())

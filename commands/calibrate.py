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
import datetime
import sys
from dataclasses import dataclass

import torch

from cache import CMConfig, TeaCacheConfig
from cache.teacache_profiles import SIGNALS
from modules import ops
from modules.checkpoint import model_fingerprint
from modules.layers import ModelConfigError
from modules.layouts import CheckpointError
from sampling import budget_space, calibration
from sampling.calibration_runs import RunMemo
from sampling.calibration_runs import identity as runs_identity
from sampling.cli import CommandParser, as_int, command
from sampling.errors import StageFileError, UsageError
from sampling.pipelines import DEFAULT_PIPELINE, PIPELINES, Pipeline, get_pipeline
from sampling.run import make_sample, sample_once
from sampling.run_spec import Launch, check_path
from sampling.schedulers import SchedulerError
from sampling.stage_io import check_writable_file
from sampling.stages import SignalPlan

from .stage2_backend import load_models, make_backend


def collect(backend, pipe, tensors_by_seed, latent_shape, *, signal, steps, solver, shift):
    """([(expert, rel, output change)] over every call of every sample, MagCache's ratios:
    branch -> one per step, step 0's 1, each the mean over the samples)."""
    config = CMConfig(teacache=TeaCacheConfig(threshold=0.0, signal=signal))

    def observed_run(seed, tensors, observe):
        sample = make_sample(backend, pipe, tensors, latent_shape, image=pipe.task == "i2v",
                             seed=seed)
        traj = sample_once(backend, config, sample, solver=solver, steps=steps, shift=shift,
                           observe=lambda s, b, e, out: observe(s, b, e, backend.get(out)))
        return traj.gate.telemetry.trace

    return calibration.collect(observed_run, tensors_by_seed, steps=steps)


def runner(backend_for, pipe, latent_shape, *, steps, solver, shift):
    """once(config, seed, tensors) -> (final latents on the host, computed fraction of block
    evaluations; a reuse runs the probe and tail), one backend per probe/tail/signal plan."""
    backends = {}
    blocks = pipe.config.num_layers

    def once(config, seed, tensors, fresh=False):
        plan = SignalPlan.from_config(config)
        if fresh:  # weights changed since the plan's backend was made (a JAX one holds a copy)
            backend = backend_for(plan)
        else:  # one backend (one set of programs) per probe/tail/signal plan
            if plan not in backends:
                backends[plan] = backend_for(plan)
            backend = backends[plan]
        sample = make_sample(backend, pipe, tensors, latent_shape, image=pipe.task == "i2v",
                             seed=seed)
        traj = sample_once(backend, config, sample, solver=solver, steps=steps, shift=shift)
        return backend.get(traj.latents), plan.computed_fraction(traj.gate.telemetry.trace,
                                                                 blocks)

    return once


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
                   "killed calibration; sampling/calibration_runs.py)")
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


def request_of(args: argparse.Namespace) -> Calibration:
    """The command line's request, its flags checked before any model is loaded or program
    compiled: the one place calibrate reads its Namespace."""
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


def run(args: argparse.Namespace) -> dict:
    return calibrate(request_of(args))


def calibrate(spec: Calibration) -> dict:
    """Sample, fit, (measure the budget's configurations,) write the profile once, at the end."""
    pipe, steps = spec.pipe, spec.steps
    models = load_models(pipe, spec.model_path, torch.float32)
    plan = SignalPlan.from_config(CMConfig(teacache=TeaCacheConfig(signal=spec.signal)))
    launch = Launch(backend=spec.backend)
    backend = make_backend(launch, models, plan)
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
    result = calibration.fit(pairs, spec.degree)
    profile = calibration.profile_of(
        result, ratios, signal=spec.signal, steps=steps, fingerprints=fingerprints,
        source=f"commands.calibrate: {pipe.name}, {spec.samples} samples x {steps} steps "
               f"({pipe.solver}, shift {pipe.shift}), {datetime.date.today()}")
    if spec.budget:
        once = runner(lambda plan: make_backend(launch, models, plan), pipe, shape, steps=steps,
                      solver=pipe.solver, shift=pipe.shift)
        candidates = calibration.measure_space(
            once, tensors, space=budget_space.space(pipe.solver, steps, pipe.shift),
            log=lambda line: print(line, flush=True), memo=memo)
        profile["budget"] = calibration.budget_block(
            candidates, pipe_name=pipe.name, seeds=list(seeds), steps=steps, solver=pipe.solver,
            shift=pipe.shift)
        if spec.screen_draws or spec.confirm_draws:
            def draws(first, count):
                return {seed: pipe.synthesize(shape, True, pipe.task == "i2v", seed)
                        for seed in range(first, first + count)}

            screen = draws(spec.first_seed + spec.samples, spec.screen_draws)
            confirm = draws(spec.first_seed + spec.samples + spec.screen_draws, spec.confirm_draws)
            profile["budget"] = calibration.screen_space(
                once, profile["budget"], screen, confirm_draws=confirm,
                log=lambda line: print(line, flush=True), memo=memo,
                models=list(models.values()), calibration_draws=tensors)
    # once, at the end: an interrupted run leaves the old profile
    calibration.write_profile(spec.out, profile)
    return {"calls": len(pairs), "result": result, "out": spec.out,
            "budget": profile.get("budget"),
            "warnings": calibration.fit_warnings(result, spec.signal)}


def format_summary(report: dict) -> str:
    return "\n".join(calibration.summary_lines(report["calls"], report["result"], report["out"],
                                               report.get("warnings", ()),
                                               report.get("budget")))


ERRORS = (UsageError, StageFileError, CheckpointError, ModelConfigError, SchedulerError,
          ops.OpError)

main = command(build_parser, run, format_summary, ERRORS)


if __name__ == "__main__":
    sys.exit(main())

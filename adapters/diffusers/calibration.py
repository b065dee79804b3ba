"""Calibration through a diffusers pipeline: the profile our calibrate command writes (the TeaCache
fit, MagCache's ratios and, with `budget=True`, budgeted mode's measured configurations), made
from pipeline calls, for `enable_cache(pipe, teacache_policy="poly:<file>")`,
`magcache_profile=<file>` and `budget_rel_err=... / budget_speedup=...` with `budget_profile=`.

    from adapters.diffusers import enable_cache
    from adapters.diffusers.calibration import calibrate
    draws = [dict(prompt=p, generator=torch.Generator().manual_seed(s), num_inference_steps=40)
             for s, p in enumerate(prompts)]
    calibrate(pipe, draws, out="profile.json", budget=True)
    enable_cache(pipe, budget_rel_err=0.03, budget_profile="profile.json")

Each draw is the keywords of one pipeline call (a prompt or its embeddings, an image, `latents=`
or a seeded `generator=`), sampled many times: uncached with every signature measured (the fit),
then, with `budget=True`, once per configuration budgeted mode chooses from (its error against
the draw's uncached latents, and the fraction of blocks it computed). `screen_draws` and
`confirm_draws` (more such calls) screen and confirm the chosen configurations as
`calibrate.py --screen_draws / --confirm_draws` do. The measuring, fitting and choosing are
sampling/calibration.py's, the very code of our command: only what runs a sample differs.
"""

from __future__ import annotations

import datetime
import hashlib

import torch

from cache import CMConfig, TeaCacheConfig
from cache.teacache_profiles import SIGNALS
from sampling import budget_space, calibration
from sampling.calibration_runs import RunMemo
from sampling.calibration_runs import identity as runs_identity
from sampling.errors import StageFileError
from sampling.stage_io import check_writable_file

from . import cache_report, disable_cache, enable_cache, gate_of, transformers_of
from .families import family_of, our_models, weights_fingerprint
from .gate import installed
from .settings import CacheSettingsError

# our solver names of diffusers' schedulers (a profile records what it was measured with)
SOLVERS = {"UniPCMultistepScheduler": "unipc", "FlowMatchEulerDiscreteScheduler": "euler",
           "DPMSolverMultistepScheduler": "dpm++"}
SET_BY_US = ("output_type", "return_dict")
SAME = (("output_type", "latent"), ("return_dict", True))  # what calibration asks anyway


def _check_draws(draws, what: str) -> list[dict]:
    if isinstance(draws, (dict, str, bytes)) or not hasattr(draws, "__iter__"):
        raise CacheSettingsError(f"{what}: expected a list of pipeline-call keyword dicts, one a "
                                 f"draw; got {type(draws).__name__}")
    draws = list(draws)
    for i, draw in enumerate(draws):
        if not isinstance(draw, dict):
            raise CacheSettingsError(f"{what}[{i}]: expected a dict of the pipeline call's "
                                     f"keywords; got {type(draw).__name__}")
        taken = [k for k in SET_BY_US if k in draw and (k, draw[k]) not in SAME]
        if taken:
            raise CacheSettingsError(f"{what}[{i}]: drop {', '.join(taken)} (calibration asks "
                                     "the pipeline for latents itself)")
        generator = draw.get("generator")
        if draw.get("latents") is None and not isinstance(generator, torch.Generator):
            raise CacheSettingsError(
                f"{what}[{i}]: expected latents= or a seeded generator= (one torch.Generator): "
                "each draw is sampled many times and must start from the same noise every time")
    return draws


def _digest(draws: list[dict]) -> str:
    """What the draws are (their keywords' values: tensors, images and generators by content),
    so a runs file of other draws is refused rather than answered from."""
    digest = hashlib.sha256()
    for draw in draws:
        for key in sorted(draw):
            value = draw[key]
            if torch.is_tensor(value):
                data = value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
                data = data.tobytes()
            elif isinstance(value, torch.Generator):
                data = value.get_state().numpy().tobytes()
            elif hasattr(value, "tobytes"):  # a PIL image or a numpy array
                data = value.tobytes()
            else:
                data = repr(value).encode()
            digest.update(key.encode() + b"=" + data + b";")
        digest.update(b"|")
    return digest.hexdigest()[:16]


class _Draws:
    """Each draw's call, with its generator put back to where it started before every call."""

    def __init__(self, draws: list[dict]):
        self.draws = draws
        self.states = [d["generator"].get_state() if isinstance(d.get("generator"),
                                                                 torch.Generator) else None
                       for d in draws]

    def call(self, pipe, i: int):
        draw = self.draws[i]
        if self.states[i] is not None:
            draw["generator"].set_state(self.states[i])
        kwargs = {k: v for k, v in draw.items() if k not in SET_BY_US}
        return pipe(**kwargs, output_type="latent", return_dict=True).frames


def calibrate(pipe, draws, *, out: str, budget: bool = False, screen_draws=(),
              confirm_draws=(), signal: str = "modulated_input", degree: int = 4,
              runs: str | None = None, log=None) -> dict:
    """Calibrate the gate for `pipe`'s transformer(s) on `draws` (pipeline-call keywords, one
    dict a draw) and write the profile to `out` (once, at the end). Returns what our calibrate
    command reports (calls, the fit, the budget block, warnings) and `text`, its summary.
    CacheSettingsError, before any sampling and with the pipeline as it was, for an unsupported
    pipeline, draws that cannot be sampled again alike, budget=True with fewer than 2 draws, a
    transformer whose architecture none of our pipelines has (budget), an unwritable `out`."""
    transformers = transformers_of(pipe)
    family = family_of(next(iter(transformers.values())))
    if gate_of(pipe) is not None or any(installed(t) is not None for t in transformers.values()):
        raise CacheSettingsError("the gate is on this pipeline; call disable_cache(pipe) before "
                                 "calibrating (calibration puts it on and off itself)")
    if any(getattr(t, "is_cache_enabled", False) for t in transformers.values()):
        raise CacheSettingsError("diffusers' own cache is enabled on the transformer; call "
                                 "pipe.transformer.disable_cache() first")
    draws = _check_draws(draws, "draws")
    screen = _check_draws(screen_draws, "screen_draws")
    confirm = _check_draws(confirm_draws, "confirm_draws")
    if not draws:
        raise CacheSettingsError("draws: expected at least one pipeline call to calibrate on")
    if budget and len(draws) < 2:
        raise CacheSettingsError(f"budget=True learns its safety margin from the spread between "
                                 f"draws; {len(draws)} given: expected 2 or more")
    if (screen or confirm) and not budget:
        raise CacheSettingsError("screen_draws / confirm_draws run the budget's configurations: "
                                 "expected budget=True with them")
    if signal not in SIGNALS:
        raise CacheSettingsError(f"signal {signal!r}: expected one of {', '.join(SIGNALS)}")
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 0:
        raise CacheSettingsError(f"degree {degree!r}: expected an integer >= 0")
    models = our_models(next(iter(transformers.values())), family)
    if budget and not models:
        raise CacheSettingsError(
            f"{type(next(iter(transformers.values()))).__name__} of this configuration has the "
            "architecture of none of our pipelines, so budgeted mode cannot check its schedules "
            "against a model; calibrate without budget=True (the TeaCache and MagCache profile)")
    try:
        check_writable_file("out", out)
        if runs is not None:
            check_writable_file("runs", runs)
    except StageFileError as exc:
        raise CacheSettingsError(str(exc)) from None

    fingerprints = {e: weights_fingerprint(t, family) for e, t in transformers.items()}
    digest = _digest(draws + screen + confirm)  # before any call moves a generator
    calls = _Draws(draws + screen + confirm)
    say = log or (lambda line: None)
    sampled = {}  # what the first run learned of the pipeline: steps, sigmas

    def with_gate(config, i, observe=None):
        enable_cache(pipe, config=config)
        try:
            gate_of(pipe).observe = observe
            latents = calls.call(pipe, i)
            report = cache_report(pipe)
        finally:
            disable_cache(pipe)
        if not sampled:  # the first run: every draw samples the same schedule
            sampled.update(steps=report["steps"],
                           sigmas=[float(s) for s in pipe.scheduler.sigmas])
        return latents.detach().to("cpu", torch.float32), report

    def observed_run(i, _draw, observe):
        config = CMConfig(teacache=TeaCacheConfig(threshold=0.0, signal=signal))
        return with_gate(config, i, observe)[1]["trace"]

    def once(config, i, _draw, fresh=False):  # the adapter holds no copy of the weights
        latents, report = with_gate(config, i)
        return latents, report["computed_blocks"]

    first = dict(enumerate(draws))
    with torch.no_grad():
        pairs, ratios = calibration.collect(observed_run, first)
    steps = sampled["steps"]
    if len(pairs) <= degree:
        raise CacheSettingsError(f"degree {degree}: a fit of degree {degree} needs more than "
                                 f"{degree} points and {len(draws)} draws gave {len(pairs)}; "
                                 "expected a lower degree or more draws")
    result = calibration.fit(pairs, degree)
    scheduler = type(pipe.scheduler).__name__
    solver = next((SOLVERS[c.__name__] for c in type(pipe.scheduler).__mro__
                   if c.__name__ in SOLVERS), None)  # a subclass samples as its base does
    shift = pipe.scheduler.config.get("flow_shift") or pipe.scheduler.config.get("shift")
    profile = calibration.profile_of(
        result, ratios, signal=signal, steps=steps, fingerprints=fingerprints,
        source=f"adapters.diffusers.calibration: {type(pipe).__name__} "
               f"({', '.join(models) or 'no pipeline of ours'}), {len(draws)} draws x {steps} "
               f"steps ({scheduler}, shift {shift}), {datetime.date.today()}")
    if budget:
        try:
            memo = None if runs is None else RunMemo(runs, runs_identity(
                fingerprints, model=models[0], steps=steps, solver=solver or scheduler,
                shift=shift, shape=[], pipeline=type(pipe).__name__, draws=digest))
        except StageFileError as exc:
            raise CacheSettingsError(str(exc)) from None
        space = budget_space.SPACE + budget_space.static_schedules(sampled["sigmas"])
        with torch.no_grad():
            candidates = calibration.measure_space(once, first, space=space, log=log, memo=memo)
            block = calibration.budget_block(candidates, pipe_name=models[0],
                                             seeds=list(first), steps=steps, solver=solver,
                                             shift=float(shift) if shift else None)
            block = {k: v for k, v in block.items() if v is not None}
            if screen or confirm:
                n = len(draws)
                block = calibration.screen_space(
                    once, block, {n + i: d for i, d in enumerate(screen)},
                    confirm_draws={n + len(screen) + i: d for i, d in enumerate(confirm)},
                    log=log, memo=memo, models=list(transformers.values()),
                    calibration_draws=first)
        profile["budget"] = block
    try:
        calibration.write_profile(out, profile, flag="out")
    except StageFileError as exc:
        raise CacheSettingsError(str(exc)) from None
    say(f"wrote {out}")
    report = {"calls": len(pairs), "result": result, "out": out, "budget": profile.get("budget"),
              "warnings": calibration.fit_warnings(result, signal)}
    report["text"] = "\n".join(calibration.summary_lines(
        report["calls"], result, out, report["warnings"], report["budget"]))
    return report

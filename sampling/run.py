"""Wiring one trajectory: inputs onto the device, warm-up of every program, the timed loop."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from cache import CacheManager, CMConfig

from . import progress
from .loop import Backend, Combination, LoopStats, Sample, check_cond_updates, denoise, folding
from .pipelines import Pipeline
from .schedulers import make_scheduler
from .stages import SignalPlan


def noise_for(latent_shape, seed: int) -> torch.Tensor:
    """Initial noise, drawn on the host from the seed: never inside a jitted program. A seed past
    torch's range (the last seed plus a clip index) wraps around, as a 64-bit counter does."""
    if seed >= 2 ** 64:
        seed -= 2 ** 64
    return torch.randn(latent_shape, generator=torch.Generator().manual_seed(seed))


def put_conditions(backend: Backend, pipe: Pipeline, tensors: dict, latent_shape, *, image: bool,
                   guidance=None, fused_cfg: bool = False) -> tuple[dict, dict]:
    """(branch -> condition tensors on the device, static switches) of one trajectory.
    fused_cfg: both CFG branches go in one batch-2 call, [uncond, cond] (the gate's `fused`)."""
    g_values = {pipe.guidance_for(e, guidance) for e, _ in pipe.experts}
    needed = ("cond", "uncond") if any(g != 1.0 for g in g_values) else ("cond",)
    if fused_cfg and (len(needed) != 2 or 1.0 in g_values):
        raise ValueError("fused CFG needs guidance != 1 for every expert (both branches each step)")
    host, static = {}, {}
    for branch in needed:
        host[branch], static = pipe.conditions(tensors, branch, image, latent_shape)
    if fused_cfg:
        host = {"pair": {k: torch.cat([host["uncond"][k], host["cond"][k]]) for k in host["cond"]}}
    return {b: {k: backend.put(v) for k, v in kw.items()} for b, kw in host.items()}, static


def make_sample(backend: Backend, pipe: Pipeline, tensors: dict, latent_shape, *, image: bool,
                seed: int, guidance=None, fused_cfg: bool = False) -> Sample:
    """Put one trajectory's inputs on the device and build the backend's programs for them
    (another trajectory of the same shapes can reuse them: `put_conditions` and `noise_for`)."""
    conds, static = put_conditions(backend, pipe, tensors, latent_shape, image=image,
                                   guidance=guidance, fused_cfg=fused_cfg)
    names = tuple(next(iter(conds.values())))
    if pipe.meanflow:
        names += ("timestep_r",)
    backend.prepare(names, static, (2 if fused_cfg else 1, *latent_shape[1:]))
    first = pipe.first_frame(tensors, image)
    return Sample(pipe, backend.put(noise_for(latent_shape, seed)), tuple(latent_shape), conds,
                  guidance, image, None if first is None else backend.put(first))


def warm_up(backend: Backend, plan: SignalPlan, scheduler, sample: Sample) -> None:
    """Run every program the loop can use once, on the real shapes, outside the timed loop:
    probe, middle, tail, the residual add/sub, the signal read, the CFG combination, every
    scheduler combination (a dry pass over the whole schedule) and the frame write-back.
    A counting bar shows it (the backend ticks it per program call; the first calls compile)."""
    with progress.phase("warm-up (compiling programs)"):
        _warm_up(backend, plan, scheduler, sample)


def _warm_up(backend: Backend, plan: SignalPlan, scheduler, sample: Sample) -> None:
    pipe = sample.pipeline
    t = backend.put(pipe.timestep_input(scheduler.timesteps[0], sample.latent_shape, sample.image))
    # what the programs were built for; every branch has these shapes (Pipeline.conditions pads
    # a shorter negative prompt as the model does)
    conds = dict(next(iter(sample.conds.values())))
    if pipe.meanflow:
        conds["timestep_r"] = backend.put(torch.tensor([0.0]))
    expert = pipe.experts[0][0]  # the JAX experts share their programs
    backend.activate(expert)
    hidden, ctx, signals, r1 = backend.probe(expert, sample.noise, t, conds, None)
    if plan.fields:
        backend.read_signals(signals)
    references = [r1] if plan.needs_reference else []
    if plan.forecast_reference:  # forecast_gate: the reference is a combination of stored ones
        references += [backend.ops.combine([(1.0, r1)] * (order + 1))
                       for order in range(1, plan.forecast + 1)]
    for ref in references:
        backend.probe(expert, sample.noise, t, conds, ref)
    after, parts = backend.middle(expert, hidden, ctx), None
    if plan.remodulate:  # the middle also returns its residual's parts; reuse hands them back
        after, parts = after
    # what a compute stores and a reuse forecasts (the residual, or its parts), and the state a
    # reuse step's tail starts from (probe + residual, or the probe's own with remodulate)
    stored = parts if parts is not None else backend.ops.sub(after, hidden)
    reused = hidden if parts is not None else backend.ops.add(hidden, stored)
    for order in range(1, plan.forecast + 1):  # forecasts combine order + 1 residuals
        backend.ops.combine([(1.0, stored)] * (order + 1))
    out = backend.tail(expert, hidden, ctx)
    # the loop's tail takes the middle's output or the reused state, never the probe's: a
    # program whose output came back sharded differently compiles here, not in the loop
    for h in (after, reused):
        backend.tail(expert, h, ctx)
    tail = ()
    if plan.tail_runs:  # the full tail also returns its runs' residuals; reuse adds them back
        out, tail = out
        for order in range(1, plan.forecast + 1):
            for r in tail:
                backend.ops.combine([(1.0, r)] * (order + 1))
    if plan.cached_tail:  # a reuse step's tail (a remodulated one starts from the probe's state)
        backend.cached_tail(expert, reused, ctx, ((parts,) if parts is not None else ()) + tuple(tail))
    if isinstance(out, tuple):  # a fused CFG call returns (uncond, cond)
        out = out[1]
    lincomb, x = folding(backend.lincomb), sample.noise
    for v in (out, Combination(((-1.0, out), (2.0, out)))):  # without and with CFG
        dry = scheduler.fresh()
        for i in range(len(dry.timesteps)):
            x = dry.step(i, v, x, lincomb)
    if sample.first_frame is not None:
        x = backend.replace_first_frame(x, sample.first_frame)
    # From step 1 the probe reads the scheduler's latent (and the last one as `previous`). A
    # jitted program specialises on placements: should a latent come back placed unlike the
    # noise (before the JAX layout returned results whole, Wan S2V's came back split over
    # frames), the program compiles here, not in the loop.
    for ref in [None] + references:
        for previous in (sample.noise, x):
            backend.probe(expert, x, t, conds, ref, previous)
    for updates in sample.cond_updates.values():  # the control guard's change measure
        for branch, new in updates.items():
            backend.relative_change(list(new.values()), [sample.conds[branch][n] for n in new])
    backend.sync(x)


@dataclass
class Trajectory:
    latents: Any  # on the device
    stats: LoopStats
    gate: CacheManager
    warmup_compiles: Any = None  # the backend's compile counts during warm-up
    loop_compiles: Any = None  # ... and during the timed loop (zero when all is well)
    warmup_seconds: float = 0.0


def sample_once(backend: Backend, config: CMConfig, sample: Sample, *, solver: str, steps: int,
                shift: float, progress=None, warmup_rounds: int = 1, step_sync: bool = True,
                observe=None) -> Trajectory:
    """Warm up (`warmup_rounds` passes over every program; compiles happen in the first) and
    run one trajectory with a fresh gate. The backend's programs
    (its SignalPlan) must serve `config`: same probe and tail blocks, and the signals it needs;
    a config with caching off runs on any plan (the gate then always computes)."""
    plan = backend.plan
    want = SignalPlan.from_config(config)
    if config.enabled and want != plan:
        raise ValueError(f"the backend was built for {plan}, the gate needs {want}")
    check_cond_updates(sample, steps)
    scheduler = make_scheduler(solver, steps, shift)
    gate = CacheManager(config, backend.ops)
    layout = getattr(backend, "layout", None)
    gate.attach(steps, layout.sp_size if layout is not None else 1)
    before = backend.compile_counts()
    began = time.perf_counter()
    for _ in range(warmup_rounds):
        warm_up(backend, plan, scheduler, sample)
    warmed = backend.compile_counts()
    warm_seconds = time.perf_counter() - began
    latents, stats = denoise(backend, gate, plan, scheduler.fresh(), sample, progress=progress,
                             step_sync=step_sync, observe=observe)
    backend.release()
    after = backend.compile_counts()
    return Trajectory(latents, stats, gate, _delta(warmed, before), _delta(after, warmed),
                      warm_seconds)


def _delta(after, before):
    return None if after is None else after - before


def layer_ideal(num_blocks: int, computed: int, reused: int, fn: int, bn: int) -> float:
    """Speedup the schedule allows if time were proportional to blocks run (head counted as one):
    HunyuanVideo-1.5's 54 blocks with DeepCache 11/45/4 over 50 steps give 2750 / 1425 = 1.93x."""
    full = num_blocks + 1
    return (computed + reused) * full / (computed * full + reused * (fn + bn + 1))

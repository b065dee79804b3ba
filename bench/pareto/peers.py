"""bench.pareto's peers as installed libraries: diffusers' transformer with our weights, the
small loop that drives it with our scheduler and CFG, its cache hooks and cache-dit. One adapter
per peer; each returns a Run counted by the same block hooks as ours. What diffusers' side of a
family does differently is that family's record in DIFFUSERS_FAMILIES, found by the registry's
family name."""

from __future__ import annotations

import contextlib
import io
import json
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from adapters.diffusers.tiny import fit_fixed_widths
from bench.pareto.workload import CALIBRATION_SEED, BlockCounter, Run, Workload
from modules.layouts import DIFFUSERS
from modules.registry import FAMILIES
from sampling.loop import Combination, folding
from sampling.schedulers import make_scheduler

# --- diffusers' side of each family -----------------------------------------------------------


def _wan_inputs(host: dict, cfg) -> dict:
    context = host["context"]  # diffusers attends to the zero padding as ours does (T3)
    return {"encoder_hidden_states": torch.nn.functional.pad(
        context, (0, 0, 0, cfg.text_len - context.shape[1]))}


def _hunyuan_inputs(host: dict, cfg) -> dict:
    return {"encoder_hidden_states": host["text"], "encoder_attention_mask": host["text_mask"],
            "encoder_hidden_states_2": host["byt5"], "encoder_attention_mask_2": host["byt5_mask"],
            "image_embeds": torch.zeros(1, cfg.vision_len, cfg.vision_dim)}  # zeros: T2V (T22)


@dataclass(frozen=True)
class DiffusersFamily:
    """What diffusers' transformer of one family is given and told (its class, config and key
    mapping come from the registry's checkpoint format)."""

    # (our host conditions of one CFG branch, our config) -> the forward's keyword inputs
    inputs: Callable[[dict, Any], dict]
    cond_channels: bool  # its latent input is [noise | cond | mask]: zeros after the noise (T17)
    # TaylorSeer's module patterns: diffusers' defaults ('^blocks.*attn' under re.fullmatch) match
    # no Wan module ('blocks.0.attn1'), so with defaults TaylorSeer caches nothing on Wan
    taylorseer: tuple[str, ...]


# modules.registry's family name -> diffusers' side of that family
DIFFUSERS_FAMILIES = {
    "wan": DiffusersFamily(_wan_inputs, False,
                           (r"blocks\.\d+\.attn1", r"blocks\.\d+\.attn2", r"blocks\.\d+\.ffn")),
    "hunyuan_video15": DiffusersFamily(
        _hunyuan_inputs, True, (r"transformer_blocks\.\d+\.attn", r"transformer_blocks\.\d+\.ff",
                                r"transformer_blocks\.\d+\.ff_context")),
}


def diffusers_model(wl: Workload) -> torch.nn.Module:
    """A fresh diffusers model with our weights (cache-dit patches in place: one per run)."""
    import diffusers

    cfg, fmt = wl.family.config, FAMILIES[wl.family.name].format
    cls = getattr(diffusers, fmt.config_to_json(cfg, DIFFUSERS)["_class_name"])
    model = cls(**fmt.diffusers_config(cfg))
    fit_fixed_widths(model, wl.theirs_state)
    model.load_state_dict(wl.theirs_state, strict=True)
    return model.eval()


def diffusers_inputs(wl: Workload, branch: str) -> dict:
    """Keyword inputs of the diffusers forward for one CFG branch (the latent and t added per call)."""
    host, _ = wl.pipe.conditions(wl.tensors, branch, False, wl.shape)
    return DIFFUSERS_FAMILIES[wl.family.name].inputs(host, wl.family.config)


def cond_zeros(wl: Workload) -> torch.Tensor | None:
    """The [cond | mask] channels (zeros: T2V) that the family's diffusers model reads after
    the noise, or None where it reads the noise alone."""
    if not DIFFUSERS_FAMILIES[wl.family.name].cond_channels:
        return None
    return torch.zeros(1, wl.family.config.in_channels + 1, *wl.shape[2:])


def their_counter(wl: Workload, model) -> BlockCounter:
    f = wl.family
    return BlockCounter(model, f.blocks_theirs, f.sublayers_theirs, None)


def _lincomb(terms):
    """sum(w * x) in fp32, as our torch backend combines scheduler terms."""
    out = None
    for w, x in terms:
        out = w * x.float() if out is None else out + w * x.float()
    return out


def denoise_diffusers(wl: Workload, model) -> tuple[torch.Tensor, float, float]:
    """Our scheduler and CFG around the diffusers forward; cond then uncond, each in its cache
    context (as diffusers' pipelines call it), with the step, sigma and step count SeaCache reads."""
    scheduler = make_scheduler(wl.pipe.solver, wl.steps, wl.pipe.shift)
    conds = {b: diffusers_inputs(wl, b) for b in ("cond", "uncond")}
    lincomb, g = folding(_lincomb), wl.guidance
    x = wl.noise
    zeros = cond_zeros(wl)
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for i, t in enumerate(scheduler.timesteps):
            tt = wl.pipe.timestep_input(t, wl.shape, False)
            xin = x if zeros is None else torch.cat([x, zeros], dim=1)
            outs = {}
            for branch in ("cond", "uncond"):
                with model.cache_context(branch, step_index=i, num_inference_steps=wl.steps,
                                         timestep=t, sigma=scheduler.sigmas[i]):
                    outs[branch] = model(xin, tt, **conds[branch], return_dict=False)[0].float()
            v = Combination(((1.0 - g, outs["uncond"]), (g, outs["cond"])))  # uncond + g (c - u)
            x = scheduler.step(i, v, x, lincomb)
    return x, time.perf_counter() - start, time.process_time() - cpu


def run_diffusers(wl: Workload, setup: Callable | None = None) -> Run:
    """One trajectory on a fresh diffusers model; `setup(model)` enables a cache after the
    warm-up call and returns a function giving the method's trace after the run (or None)."""
    model = diffusers_model(wl)
    counter = their_counter(wl, model)
    with torch.no_grad():  # warm-up, before any cache hook sees a call
        x, zeros = wl.noise, cond_zeros(wl)
        if zeros is not None:
            x = torch.cat([x, zeros], 1)
        model(x, wl.pipe.timestep_input(999.0, wl.shape, False), **diffusers_inputs(wl, "cond"),
              return_dict=False)
    tracer = setup(model) if setup is not None else None
    counter.reset()
    latents, wall, cpu = denoise_diffusers(wl, model)
    trace = tracer() if tracer is not None else None
    counter.remove()
    return Run(latents, wall, cpu, counter.fraction, counter.blocks_per_call(), trace)


# --- the peers, as installed libraries --------------------------------------------------------

class _Holder:
    """What the adapter reads off a pipeline, for diffusers' model in this bench's own loop: the
    transformer, and a scheduler whose timesteps (one object a run) and sigmas are the run's."""

    def __init__(self, transformer, scheduler):
        self.transformer, self.scheduler = transformer, scheduler


def adapter_setup(wl: Workload, settings: dict) -> Callable:
    """setup() for our gate through the diffusers adapter (adapters/diffusers) on diffusers' model:
    `settings` are enable_cache's keywords; the trace is the gate's decisions."""
    def setup(model):
        from adapters.diffusers import cache_report, enable_cache
        scheduler = make_scheduler(wl.pipe.solver, wl.steps, wl.pipe.shift)
        holder = _Holder(model, scheduler)
        enable_cache(holder, **settings)

        def trace():
            rows = cache_report(holder)["trace"]
            return {k: [r[k] for r in rows] for k in ("step", "branch", "action", "reason")}
        return trace
    return setup


def taylorseer_identifiers(wl: Workload) -> list[str]:
    """Explicit module patterns, the family's (DiffusersFamily.taylorseer)."""
    return list(DIFFUSERS_FAMILIES[wl.family.name].taylorseer)


def diffusers_hook(config_factory: Callable) -> Callable:
    """setup() for a diffusers cache hook: `config_factory()` -> its config, then enable_cache."""
    def setup(model):
        model.enable_cache(config_factory())
        return None  # the per-call block counts are the trace
    return setup


def mag_ratios(wl: Workload) -> tuple[list[float], dict]:
    """MagCache's calibration run (diffusers' `calibrate=True`, which never skips), on a held-out
    draw. diffusers prints one ratio list per cache context; its config takes one list for all
    contexts, so the cond list is used (both are saved in the trace)."""
    from diffusers.hooks import MagCacheConfig

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_diffusers(wl.reseeded(CALIBRATION_SEED), diffusers_hook(
            lambda: MagCacheConfig(calibrate=True, num_inference_steps=wl.steps)))
    lists = [json.loads(m) for m in re.findall(r"^\[[^\]]*\]$", printed.getvalue(), re.M)]
    if len(lists) != 2:
        raise RuntimeError(f"MagCache calibration printed {len(lists)} ratio lists, expected 2 "
                           f"(cond, uncond):\n{printed.getvalue()[-2000:]}")
    return lists[0], {"cond": lists[0], "uncond": lists[1]}


def cachedit_setup(wl: Workload, fn: int, bn: int, rdt: float, taylorseer: bool) -> Callable:
    """cache-dit DBCache on the transformer alone (library defaults but Fn, Bn and the threshold;
    separate CFG as cache-dit's Wan and HunyuanVideo-1.5 adapters set it)."""
    def setup(model):
        import cache_dit
        from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

        cache_dit.enable_cache(
            model, cache_config=DBCacheConfig(
                Fn_compute_blocks=fn, Bn_compute_blocks=bn, residual_diff_threshold=rdt,
                num_inference_steps=wl.steps, enable_separate_cfg=True),
            calibrator_config=TaylorSeerCalibratorConfig(taylorseer_order=1) if taylorseer
            else None)

        def trace():
            stats = cache_dit.summary(model, logging=False)[0]
            return {"cached_steps": list(stats.cached_steps),
                    "cfg_cached_steps": list(stats.cfg_cached_steps),
                    "residual_diffs": {k: round(float(v), 5) for k, v in stats.residual_diffs.items()},
                    "cfg_residual_diffs": {k: round(float(v), 5)
                                           for k, v in stats.cfg_residual_diffs.items()}}
        return trace
    return setup


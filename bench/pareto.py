"""Fidelity against speed: our caching beside diffusers' cache hooks and cache-dit, same weights.

    python bench/pareto.py [--quick] [--families wan,hunyuan] [--out bench/results/pareto]

Tiny-but-deep random-weight DiTs (Wan2.2 TI2V-shaped, then HunyuanVideo-1.5), made smooth in t
(bench/workload.py), are loaded into our model and, through modules/convert.py, into diffusers'
`WanTransformer3DModel` / `HunyuanVideo15Transformer3DModel`. Every run shares the noise, the
text embeddings, our scheduler (sampling/schedulers.py) and the step count; ours run on the torch
backend (eager, CPU), the peers' in a small loop that drives the diffusers model with the same
scheduler, so wall times compare like with like. Per run:

  computed   fraction of block evaluations that really ran, counted by forward pre-hooks on the
             first linear of each block's sub-layers (hooks on a block fire even when a cache
             hook replaced its forward, benchmark_workload.md), for every method, ours included
  CPU, wall  the denoising loop's process CPU time (steady when other jobs share the machine;
             one torch thread) and wall time; speedup = the same implementation's uncached CPU
             time over the run's (ours over ours, peers over diffusers')
  PSNR, rel L2, rel/disp   final latents against the same implementation's uncached latents;
             rel/disp divides the error by how far the uncached run moved from the noise
  trace      computed blocks per model call, plus each method's own decisions (traces_*.json)

Writes results.csv, table.md, pareto.png, traces_<family>.json and README.md (machine,
command, table, plot, and the standing against each peer at matched computed fraction) under
--out. A peer that cannot be installed or cannot drive a model is reported as such; nothing is
estimated in its place.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import platform
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "warning")  # read when cache_dit is imported

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.workload import smooth_in_t  # noqa: E402
from cache import (  # noqa: E402
    CMConfig,
    DeepCacheConfig,
    FBCacheConfig,
    LimitsConfig,
    MagCacheConfig,
    TeaCacheConfig,
)
from modules import hunyuan_video15, wan  # noqa: E402
from modules.convert import (  # noqa: E402
    hunyuan_diffusers_config,
    hunyuan_to_diffusers,
    wan_diffusers_config,
    wan_to_diffusers,
)
from modules.registry import build_model  # noqa: E402
from sampling.fidelity import fidelity  # noqa: E402
from sampling.loop import Combination, folding  # noqa: E402
from sampling.pipelines import PIPELINES  # noqa: E402
from sampling.run import make_sample, noise_for, sample_once, warm_up  # noqa: E402
from sampling.schedulers import make_scheduler  # noqa: E402
from sampling.stages import SignalPlan  # noqa: E402
from torch_backend.backend import TorchBackend  # noqa: E402

SEED = 0  # noise and stage-1 tensors of the evaluated trajectory
CALIBRATION_SEED = 1  # MagCache calibrates on another draw (held out)
BUDGET_SEEDS = (1, 2, 3)  # budgeted mode calibrates on these draws...
UNSEEN_SEEDS = (SEED, 4, 5, 6, 7)  # ...and is checked on five it never saw
BUDGETS = (2e-3, 5e-3, 1.5e-2)  # final-latent rel L2 asked of budgeted mode
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pareto")
INIT = ("smooth in t (bench/workload.py: Gaussian low-pass over the time embedder's sinusoid "
        "columns, cutoff period 300 timesteps, power renormalised; modulation weights x3), "
        "torch.manual_seed(0) draw, fp32")


# --- the workload -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    """One model family: its tiny-deep config and where its work can be counted."""

    key: str
    title: str
    pipeline: str  # the tiny pipeline whose sampling defaults (solver, shift, CFG) we keep
    config: Any  # our model config (tiny-deep)
    size: tuple[int, int, int]  # (height, width, frames) of the clip
    blocks: str  # attribute of the block list: ours, diffusers'
    blocks_theirs: str
    # first linear of each sub-layer of a block: ours, diffusers' (same sub-layers in both)
    sublayers: tuple[str, ...]
    sublayers_theirs: tuple[str, ...]
    per_call: str  # our module that runs once per model call (prepare), to split the count
    trained: bool = False  # the pipeline's committed checkpoint (issue 28), not random weights


def families(blocks: int, hy_blocks: int) -> dict[str, Family]:
    wn = dataclasses.replace(wan.CONFIGS["wan-tiny-ti2v"], num_layers=blocks, dim=48, ffn_dim=96,
                             num_heads=4)
    hy = dataclasses.replace(hunyuan_video15.CONFIGS["hunyuanvideo-tiny"], num_layers=hy_blocks,
                             hidden_size=64, num_heads=4, rope_axes=(4, 6, 6))
    return {
        "wan": Family("wan", "Wan2.2 TI2V-5B-shaped (text-to-video, UniPC)", "wan-tiny-ti2v", wn,
                      (256, 256, 17), "blocks", "blocks",
                      ("self_attn.q", "cross_attn.q", "ffn.0"),
                      ("attn1.to_q", "attn2.to_q", "ffn.net.0.proj"), "time_embedding"),
        "hunyuan": Family("hunyuan", "HunyuanVideo-1.5-shaped (text-to-video, Euler)",
                          "hunyuanvideo-tiny", hy, (128, 160, 17), "double_blocks",
                          "transformer_blocks", ("img_attn_q", "img_mlp.fc1", "txt_mlp.fc1"),
                          ("attn.to_q", "ff.net.0.proj", "ff_context.net.0.proj"), "time_in.mlp"),
    }


# The tiny models trained here on procedural clips (issue 28, bench/fixtures): the family's
# pipeline in sampling/pipelines.py, whose committed checkpoint (`builtin`) is loaded by the same
# loader as a real checkpoint.
TRAINED = {"wan": "wan-tiny-trained", "hunyuan": "hunyuanvideo-tiny-trained"}
FOLLOW_SEEDS = tuple(range(10, 34))  # held-out prompts of the prompt-following runs (none of
# them is the evaluated draw or a calibration draw: SEED, CALIBRATION_SEED, BUDGET_SEEDS)
PROMPT_SEED = 1234  # the order of the held-out combinations (bench/fixtures/evaluate.py's)


def trained_families() -> dict[str, Family]:
    """Each family whose trained pipeline exists: its own size, config and blocks."""
    out = {}
    for key, fam in families(1, 1).items():
        name = TRAINED[key]
        if name not in PIPELINES:
            continue
        pipe = PIPELINES[name]
        title = fam.title.split(" (")[0].replace("-shaped", "-style")
        out[key] = dataclasses.replace(
            fam, title=f"{title}, trained here ({pipe.builtin}, {pipe.config.num_layers} blocks)",
            pipeline=name, config=pipe.config, size=pipe.size, trained=True)
    return out


def held_out_clip(seed: int):
    """The held-out prompt (an attribute combination never trained on, bench/fixtures/videos.py
    split) that draw `seed` of the trained regime asks for."""
    from bench.fixtures import videos as V
    from bench.fixtures.evaluate import held_out_clips
    from bench.fixtures.train import SPLIT_SEED
    clips, _ = held_out_clips(V.split(SPLIT_SEED)[1], seed + 1, PROMPT_SEED)
    return clips[seed]


def prompt_tensors(pipe, seed: int) -> dict:
    """Stage-1 tensors of draw `seed`'s held-out prompt, through the pipeline's own encoder."""
    from encoders import for_pipeline
    from encoders.request import Request
    tensors, _ = for_pipeline(pipe).encode(pipe, Request(prompt=held_out_clip(seed).prompt), None)
    return tensors


def deep_pipeline(family: Family):
    """The family's tiny pipeline pointed at the tiny-deep config and the benchmark clip size."""
    base = PIPELINES[family.pipeline]

    class Deep(type(base)):
        @property
        def config(self):
            return family.config

    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return Deep(**{**fields, "size": family.size})


@dataclass
class Workload:
    family: Family
    pipe: Any
    model: torch.nn.Module  # ours, smooth in t
    theirs_state: dict  # the same weights in diffusers' layout
    tensors: dict  # stage-1 tensors of seed SEED
    shape: tuple
    steps: int
    guidance: float
    seed: int = SEED

    @property
    def noise(self) -> torch.Tensor:
        return noise_for(self.shape, self.seed)

    def reseeded(self, seed: int) -> "Workload":
        """The same model and settings on another draw of noise and stage-1 tensors (trained
        regime: another held-out prompt)."""
        return dataclasses.replace(self, seed=seed, tensors=draw_tensors(self.family, self.pipe,
                                                                         self.shape, seed))


def draw_tensors(family: Family, pipe, shape, seed: int) -> dict:
    if family.trained:
        return prompt_tensors(pipe, seed)
    return pipe.synthesize(shape, True, False, seed)


def build_workload(family: Family, steps: int | None = None) -> Workload:
    pipe = deep_pipeline(family)
    if family.trained:
        from modules.checkpoint import load_model
        model = load_model(pipe.builtin_path)[0].eval()
    else:
        torch.manual_seed(0)
        model = smooth_in_t(build_model(family.config)).eval()
    convert = wan_to_diffusers if family.key == "wan" else hunyuan_to_diffusers
    shape = pipe.latent_shape(*pipe.size)
    return Workload(family, pipe, model, convert(model.state_dict()),
                    draw_tensors(family, pipe, shape, SEED), shape, steps or pipe.steps,
                    pipe.guidance_for(None))


def diffusers_model(wl: Workload) -> torch.nn.Module:
    """A fresh diffusers model with our weights (cache-dit patches in place: one per run)."""
    import diffusers

    cfg = wl.family.config
    if wl.family.key == "wan":
        model = diffusers.WanTransformer3DModel(**wan_diffusers_config(cfg))
    else:
        model = diffusers.HunyuanVideo15Transformer3DModel(**hunyuan_diffusers_config(cfg))
    _fit_fixed_widths(model, wl.theirs_state)
    model.load_state_dict(wl.theirs_state, strict=True)
    return model.eval()


def _fit_fixed_widths(model: torch.nn.Module, state: dict) -> None:
    """diffusers' HunyuanVideo15Transformer3DModel fixes two widths the released model has (the
    token refiner's MLP at 4x, the byT5 projection's 2048), which the tiny model trained here
    sets smaller (bench/fixtures/train.py). Each linear whose weight in `state` has another
    shape is rebuilt at that shape: the forward only applies them, so the maths is the one the
    weights were trained with."""
    for name, module in list(model.named_modules()):
        weight = state.get(f"{name}.weight")
        if not isinstance(module, torch.nn.Linear) or weight is None \
                or tuple(weight.shape) == tuple(module.weight.shape):
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf,
                torch.nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None))


def diffusers_inputs(wl: Workload, branch: str) -> dict:
    """Keyword inputs of the diffusers forward for one CFG branch (the latent and t added per call)."""
    host, _ = wl.pipe.conditions(wl.tensors, branch, False, wl.shape)
    cfg = wl.family.config
    if wl.family.key == "wan":
        context = host["context"]  # diffusers attends to the zero padding as ours does (T3)
        return {"encoder_hidden_states": torch.nn.functional.pad(
            context, (0, 0, 0, cfg.text_len - context.shape[1]))}
    return {"encoder_hidden_states": host["text"], "encoder_attention_mask": host["text_mask"],
            "encoder_hidden_states_2": host["byt5"], "encoder_attention_mask_2": host["byt5_mask"],
            "image_embeds": torch.zeros(1, cfg.vision_len, cfg.vision_dim)}  # zeros: T2V (T22)


# --- counting the work that ran ---------------------------------------------------------------

class BlockCounter:
    """Sub-layer evaluations per model call.

    A forward pre-hook on the first linear of each sub-layer of every block counts what really
    ran (a hook on the block itself would fire even when a cache hook replaced its forward); a
    pre-hook on a module that runs once per model call starts a new call."""

    def __init__(self, model: torch.nn.Module, blocks: str, sublayers, per_call: str | None):
        block_list = getattr(model, blocks)
        self.num_blocks, self.width = len(block_list), len(sublayers)
        self.per_call: list[int] = []
        self.handles = [block.get_submodule(name).register_forward_pre_hook(self._hit)
                        for block in block_list for name in sublayers]
        starter = model if per_call is None else model.get_submodule(per_call)
        self.handles.append(starter.register_forward_pre_hook(self._call))

    def _call(self, *_):
        self.per_call.append(0)

    def _hit(self, *_):
        self.per_call[-1] += 1

    def reset(self) -> None:
        self.per_call = []

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    @property
    def fraction(self) -> float:
        return sum(self.per_call) / (self.num_blocks * self.width * max(len(self.per_call), 1))

    def blocks_per_call(self) -> list[float]:
        """Block-equivalents computed in each call (sub-layers / sub-layers per block)."""
        return [round(c / self.width, 3) for c in self.per_call]


def our_counter(wl: Workload) -> BlockCounter:
    f = wl.family
    return BlockCounter(wl.model, f.blocks, f.sublayers, f.per_call)


def their_counter(wl: Workload, model) -> BlockCounter:
    f = wl.family
    return BlockCounter(model, f.blocks_theirs, f.sublayers_theirs, None)


# --- the runs ---------------------------------------------------------------------------------

@dataclass
class Run:
    latents: torch.Tensor
    wall: float
    cpu: float  # process CPU time of the loop: other jobs on the machine hardly move it
    fraction: float
    per_call: list[float]
    trace: Any = None  # the method's own decisions
    note: str = ""  # what the run chose for itself (the budget's threshold), shown by its setting
    follow: dict | None = None  # trained regime: prompt following over the pooled prompts


def run_ours(wl: Workload, config: CMConfig, counter: BlockCounter) -> Run:
    """One trajectory on our torch backend (eager), warmed up outside the count and the clock."""
    plan = SignalPlan.from_config(config)
    backend = TorchBackend({None: wl.model}, plan)
    sample = make_sample(backend, wl.pipe, wl.tensors, wl.shape, image=False, seed=wl.seed)
    warm_up(backend, plan, make_scheduler(wl.pipe.solver, wl.steps, wl.pipe.shift), sample)
    counter.reset()
    cpu = time.process_time()
    traj = sample_once(backend, config, sample, solver=wl.pipe.solver, steps=wl.steps,
                       shift=wl.pipe.shift, warmup_rounds=0, step_sync=False)
    cpu = time.process_time() - cpu
    rows = traj.gate.telemetry.trace
    trace = {k: [round(r[k], 6) if isinstance(r[k], float) else r[k] for r in rows]
             for k in ("step", "branch", "action", "reason", "rel", "accum")}  # one list a column
    # What the gate says it ran must be what the hooks saw: all blocks, or Fn + Bn on a reuse.
    claimed = [wl.model.num_blocks if r["action"] == "compute" else plan.fn_blocks + plan.bn_blocks
               for r in rows]
    seen = counter.blocks_per_call()
    if claimed != seen:
        wrong = sum(a != b for a, b in zip(claimed, seen, strict=False))
        raise RuntimeError(f"the gate's trace and the block hooks disagree on {wrong} of "
                           f"{len(seen)} calls (or on the number of calls)")
    return Run(backend.get(traj.latents), traj.stats.wall_seconds, cpu, counter.fraction, seen,
               trace)


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
    hy = wl.family.key == "hunyuan"
    zeros = torch.zeros(1, wl.family.config.in_channels + 1, *wl.shape[2:]) if hy else None
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for i, t in enumerate(scheduler.timesteps):
            tt = wl.pipe.timestep_input(t, wl.shape, False)
            xin = torch.cat([x, zeros], dim=1) if hy else x  # HY reads [noise | cond | mask] (T17)
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
        x = wl.noise
        if wl.family.key == "hunyuan":
            x = torch.cat([x, torch.zeros(1, wl.family.config.in_channels + 1, *wl.shape[2:])], 1)
        model(x, wl.pipe.timestep_input(999.0, wl.shape, False), **diffusers_inputs(wl, "cond"),
              return_dict=False)
    tracer = setup(model) if setup is not None else None
    counter.reset()
    latents, wall, cpu = denoise_diffusers(wl, model)
    trace = tracer() if tracer is not None else None
    counter.remove()
    return Run(latents, wall, cpu, counter.fraction, counter.blocks_per_call(), trace)


# --- prompt following (trained regime) --------------------------------------------------------

def shown_clip(pipe, latents: torch.Tensor):
    """[F, H, W, 3] in [0, 1]: a pixel-space pipeline's latents [1, C, F, H, W] through its own
    latent mapping (modules.vae: the one stage 3 decodes with), as the fixtures' analyser reads."""
    from modules.vae import build_tiny, spec_for

    video = build_tiny(spec_for(pipe), latents.shape[1]).decode(latents.float())[0]
    return ((video[0] + 1.0) / 2.0).clamp(0.0, 1.0).permute(1, 2, 3, 0).numpy()


def over_prompts(wl: Workload, go: Callable, seeds) -> Run:
    """Trained regime: one setting run on each held-out prompt of `seeds` (a fresh noise draw
    each) and pooled into one Run: latents and noise stacked on the batch axis (so PSNR and rel
    L2 pool the error of every prompt, where one draw's figure jumps with where the object
    went), CPU and wall summed, the computed fraction averaged. `run.follow`: the fixtures'
    analyser on each decoded video, per attribute, and the hits per prompt."""
    from bench.fixtures import analyser

    runs, hits = [], []
    for seed in seeds:
        run = go(wl.reseeded(seed))
        hits.append(analyser.score(shown_clip(wl.pipe, run.latents), held_out_clip(seed)))
        runs.append(run)
    out = Run(torch.cat([r.latents for r in runs]), sum(r.wall for r in runs),
              sum(r.cpu for r in runs), sum(r.fraction for r in runs) / len(runs),
              [c for r in runs for c in r.per_call], [r.trace for r in runs], runs[0].note)
    out.follow = {**{k: sum(h[k] for h in hits) / len(hits) for k in analyser.ATTRIBUTES},
                  "hits": [{k: bool(v) for k, v in h.items()} for h in hits]}
    return out


# --- the peers, as installed libraries --------------------------------------------------------

def taylorseer_identifiers(wl: Workload) -> list[str]:
    """Explicit module patterns: diffusers' defaults ('^blocks.*attn' under re.fullmatch) match
    no Wan module ('blocks.0.attn1'), so with defaults TaylorSeer caches nothing on Wan."""
    if wl.family.key == "wan":
        return [r"blocks\.\d+\.attn1", r"blocks\.\d+\.attn2", r"blocks\.\d+\.ffn"]
    return [r"transformer_blocks\.\d+\.attn", r"transformer_blocks\.\d+\.ff",
            r"transformer_blocks\.\d+\.ff_context"]


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


def our_mag_ratios(wl: Workload) -> dict:
    """Our calibrate command's MagCache ratios (commands/calibrate.collect), measured on the
    same held-out draw as diffusers' calibration: branch -> one ratio per step."""
    from commands.calibrate import collect

    draw = wl.reseeded(CALIBRATION_SEED)
    plan = SignalPlan.from_config(CMConfig(teacache=TeaCacheConfig()))
    _, ratios = collect(TorchBackend({None: wl.model}, plan), wl.pipe, {draw.seed: draw.tensors},
                        wl.shape, signal=None, steps=wl.steps, solver=wl.pipe.solver,
                        shift=wl.pipe.shift)
    return ratios


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


# --- our budgeted mode: calibrate on held-out draws, then ask for an error budget ------------

def budget_profile(wl: Workload, path: str) -> dict:
    """`python -m commands.calibrate --budget`'s measurement on this workload: every
    configuration of sampling/budget.py's SPACE on the draws BUDGET_SEEDS (none of them
    evaluated), written to `path`; returns the budget block."""
    from commands import calibrate
    from sampling import budget

    draws = {seed: wl.reseeded(seed).tensors for seed in BUDGET_SEEDS}
    candidates = calibrate.measure_space(
        lambda plan: TorchBackend({None: wl.model}, plan), wl.pipe, draws, wl.shape,
        steps=wl.steps, solver=wl.pipe.solver, shift=wl.pipe.shift,
        space=budget.space(wl.pipe.solver, wl.steps, wl.pipe.shift))
    block = calibrate.budget_block(candidates, pipe_name=wl.pipe.name, seeds=BUDGET_SEEDS,
                                   steps=wl.steps, solver=wl.pipe.solver, shift=wl.pipe.shift)
    _write_json(path, {"source": f"bench/pareto.py: {wl.family.title}", "budget": block})
    return block


def budgeted_config(cache: dict, wl: Workload, rel_err: float):
    """(CMConfig, what was chosen and promised) for one budget; uncached when nothing promises it."""
    from cache.flags import config_from_fields
    from sampling.budget import choose

    if "budget" not in cache:
        cache["budget"] = budget_profile(wl, cache["profile_path"])
    choice = choose(cache["budget"], rel_err=rel_err)
    if choice is None:
        return CMConfig(), {"choice": None}
    return config_from_fields(choice.fields), {"choice": choice.label, "bound": choice.bound,
                                               "predicted_computed": choice.computed}


def budgets_on_unseen_draws(wl: Workload, cache: dict) -> list[dict]:
    """Every budget on every UNSEEN_SEEDS draw but SEED (whose runs are the method's rows):
    achieved rel L2 against the uncached run of the same draw."""
    out = []
    for seed in UNSEEN_SEEDS:
        if seed == SEED:
            continue
        draw = wl.reseeded(seed)
        base = run_ours(draw, CMConfig(), cache["counter"])
        for b in BUDGETS:
            config, chosen = budgeted_config(cache, wl, b)
            run = run_ours(draw, config, cache["counter"])
            out.append({"budget": b, "seed": seed, "choice": chosen["choice"],
                        "rel_l2": fidelity(run.latents, base.latents)["rel_l2"],
                        "computed": run.fraction})
    return out


# --- the menu ---------------------------------------------------------------------------------

@dataclass
class Method:
    """One curve: a method and the settings swept along it. Each setting is (label, run(wl))."""

    name: str
    impl: str  # "ours", "diffusers" or "cache-dit"
    settings: list = field(default_factory=list)
    about: str = ""


def scaled(schedule, steps):
    """A DeepCache schedule written for 50 steps, for `steps` steps."""
    start, end, interval = schedule
    return max(1, round(start * steps / 50)), round(end * steps / 50), interval


def methods(wl: Workload, quick: bool, cache: dict) -> list[Method]:
    """Every curve, in plot order: peers first, then ours. `cache` keeps per-family results
    that several settings share (MagCache ratios, the budget profile)."""
    pick = (lambda xs: xs[::2] if len(xs) > 2 else xs) if quick else (lambda xs: xs)
    trained = wl.family.trained

    def grid(random, on_trained):
        """The settings swept: trained models move further between steps (issue 28: the same
        threshold computes 19% of blocks on random weights and 44% on trained), so their
        thresholds reach higher."""
        return pick(on_trained if trained else random)

    out = []

    # diffusers hooks (as installed: diffusers 0.42.1)
    from diffusers.hooks import FirstBlockCacheConfig, SeaCacheConfig, TaylorSeerCacheConfig
    from diffusers.hooks import MagCacheConfig as TheirMagCacheConfig

    def hook(factory):
        return lambda w: run_diffusers(w, diffusers_hook(factory))

    out.append(Method("diffusers FBC", "diffusers", [
        (f"threshold {th}", hook(lambda th=th: FirstBlockCacheConfig(threshold=th)))
        for th in grid([0.02, 0.05, 0.1, 0.2], [0.05, 0.1, 0.2, 0.4, 0.8])],
        "FirstBlockCacheConfig"))

    def mag(th, k):
        def go(w):
            if "mag" not in cache:
                cache["mag"] = mag_ratios(w)
            return run_diffusers(w, diffusers_hook(lambda: TheirMagCacheConfig(
                threshold=th, max_skip_steps=k, num_inference_steps=w.steps,
                mag_ratios=cache["mag"][0])))
        return go

    out.append(Method("diffusers MagCache", "diffusers", [
        (f"threshold {th}, K {k}", mag(th, k))
        for th, k in grid([(0.001, 3), (0.003, 3), (0.01, 3), (0.06, 5)],
                          [(0.01, 3), (0.03, 3), (0.06, 3), (0.12, 4), (0.24, 6)])],
        "MagCacheConfig, ratios from its calibration run on a held-out draw, retention 0.2"))
    out.append(Method("diffusers TaylorSeer", "diffusers", [
        (f"interval {iv}", hook(lambda iv=iv: TaylorSeerCacheConfig(
            cache_interval=iv, max_order=1, taylor_factors_dtype=torch.float32,
            cache_identifiers=taylorseer_identifiers(wl))))
        for iv in pick([2, 3, 5])],
        "TaylorSeerCacheConfig, order 1, fp32 factors, attention and FFN modules of every block"))
    out.append(Method("diffusers SeaCache", "diffusers", [
        (f"threshold {th}", hook(lambda th=th: SeaCacheConfig(threshold=th)))
        for th in grid([0.1, 0.25, 1.0], [0.25, 0.5, 1.0, 2.0])],
        "SeaCacheConfig (also in diffusers 0.42.1)"))

    # cache-dit (as installed), DBCache on the transformer
    try:
        import cache_dit
        version = cache_dit.__version__
    except Exception as exc:  # noqa: BLE001 - any import failure means: not available
        version = None
        missing = f"cache-dit cannot be imported ({type(exc).__name__}: {exc})"
    wide = 8 if not trained else max(2, wl.family.config.num_layers // 2)  # Fn < the blocks
    for fn, ts in ((1, False), (1, True), (wide, False), (wide, True)):
        name = f"cache-dit F{fn}B0" + (" +TaylorSeer" if ts else "")
        if version is None:
            out.append(Method(name, "cache-dit", [("-", _unavailable(missing))]))
            continue
        out.append(Method(name, "cache-dit", [
            (f"rdt {rdt}", lambda w, fn=fn, rdt=rdt, ts=ts: run_diffusers(
                w, cachedit_setup(w, fn, 0, rdt, ts)))
            for rdt in grid([0.04, 0.1, 0.25], [0.1, 0.25, 0.5, 1.0])],
            f"cache-dit {version} DBCache, max_warmup_steps 8 (library default)"
            + (", TaylorSeer calibrator order 1" if ts else "")))

    # ours, on the torch backend
    def ours(config):
        return lambda w: run_ours(w, config, cache["counter"])

    fb = lambda th: FBCacheConfig(threshold=th, metric="residual_tensor_rel_l1")  # noqa: E731
    out.append(Method("ours TeaCache", "ours", [
        (f"threshold {th}", ours(CMConfig(teacache=TeaCacheConfig(threshold=th))))
        for th in grid([0.001, 0.002, 0.005, 0.01], [0.005, 0.01, 0.02, 0.05])],
        "linear policy on block 0's modulated input"))
    out.append(Method("ours FBCache", "ours", [
        (f"threshold {th}", ours(CMConfig(fbcache=fb(th))))
        for th in grid([0.02, 0.05, 0.1, 0.2], [0.1, 0.2, 0.4, 0.8])],
        "residual_tensor_rel_l1, F1B0"))
    deep = [scaled(s, wl.steps) for s in pick([(15, 40, 3), (11, 45, 4), (5, 48, 5)])]
    out.append(Method("ours DeepCache", "ours", [
        (f"start {a}, end {b}, every {n}", ours(CMConfig(
            deepcache=DeepCacheConfig(start=a, end=b, interval=n)))) for a, b, n in deep],
        "schedule, B1"))
    out.append(Method("ours FBCache +forecast2", "ours", [
        (f"threshold {th}", ours(CMConfig(fbcache=fb(th), forecast=2)))
        for th in grid([0.03, 0.05, 0.1, 0.2], [0.1, 0.2, 0.4, 0.8])],
        "F1B0, quadratic forecast of the reused residual"))
    out.append(Method("ours FBCache F1B2 +forecast1", "ours", [
        (f"threshold {th}", ours(CMConfig(fbcache=fb(th), bn_blocks=2, forecast=1)))
        for th in grid([0.05, 0.1, 0.2], [0.2, 0.4, 0.8])],
        "two tail blocks always run, linear forecast"))
    # issue 17: reuse while the forecast's own error stays small. The probe compares block 0's
    # residual with its forecast (--forecast_gate), and the errors are summed over the reuse
    # run (--fb_accumulate), so the threshold bounds a run's forecast error, not the raw drift.
    fbsum = lambda th: FBCacheConfig(threshold=th, metric="residual_tensor_rel_l1",  # noqa: E731
                                     accumulate=True)
    out.append(Method("ours FBCache +forecast2 gated", "ours", [
        (f"threshold {th}", ours(CMConfig(fbcache=fbsum(th), forecast=2, forecast_gate=True)))
        for th in grid([0.005, 0.01, 0.02, 0.03, 0.07, 0.15, 0.3, 0.6],
                       [0.07, 0.15, 0.3, 0.6, 1.2, 2.4])],
        "F1B0, quadratic forecast; reuse while the summed forecast error of block 0 stays under "
        "the threshold"))
    out.append(Method("ours FBCache +forecast1 gated", "ours", [
        (f"threshold {th}", ours(CMConfig(fbcache=fbsum(th), forecast=1, forecast_gate=True)))
        for th in grid([0.2, 0.4, 0.8], [0.4, 0.8, 1.6])],
        "the same with a linear forecast (cheap end)"))
    # the cheap end: each step's forecast error weighted by the step's size in sigma (an error
    # on a large late step moves the final latent more), no forced last compute
    out.append(Method("ours FBCache +forecast1 gated step-weighted", "ours", [
        (f"threshold {th}", ours(CMConfig(fbcache=fbsum(th), forecast=1, forecast_gate=True,
                                          step_weight=1.0, last_steps=0)))
        for th in grid([0.01, 0.02, 0.05, 0.1, 0.3, 0.7, 1.2, 2.1], [0.3, 0.7, 1.2, 2.1, 4.0])],
        "linear forecast, summed forecast error weighted by |dsigma| over its mean "
        "(--step_weight 1), --cache_last_steps 0"))
    # The trained regime (issue 28): a forecast is good for a step or two, so cap the reuse run
    # (what SeaCache does, max_consecutive_cached 2); TeaCache's signal places the computes.
    out.append(Method("ours TeaCache +forecast1 (2 in a row)", "ours", [
        (f"threshold {th}", ours(CMConfig(teacache=TeaCacheConfig(threshold=th), forecast=1,
                                          limits=LimitsConfig(max_continuous=2))))
        for th in grid([0.002, 0.005, 0.01, 0.02], [0.005, 0.01, 0.02, 0.05, 0.2])],
        "linear forecast, at most 2 reuses in a row"))
    out.append(Method("ours TeaCache +forecast1 (1 in a row)", "ours", [
        (f"threshold {th}", ours(CMConfig(teacache=TeaCacheConfig(threshold=th), forecast=1,
                                          limits=LimitsConfig(max_continuous=1))))
        for th in grid([0.002, 0.005, 0.01], [0.01, 0.02, 0.05])],
        "linear forecast, never two reuses in a row (the high-fidelity end)"))
    schedules = [(2, n) for n in pick([2, 3, 4, 5])]
    out.append(Method("ours DeepCache B0 +forecast1", "ours", [
        (f"start {a}, every {n}", ours(CMConfig(
            deepcache=DeepCacheConfig(start=a, end=wl.steps, interval=n), forecast=1,
            bn_blocks=0))) for a, n in schedules],
        "no tail block, linear forecast, the last step computed"))
    if wl.family.key == "wan":  # remodulated reuse needs gates the blocks share (Wan2.2)
        out.append(Method("ours DeepCache B0 +forecast1 remodulated", "ours", [
            (f"start {a}, every {n}", ours(CMConfig(
                deepcache=DeepCacheConfig(start=a, end=wl.steps, interval=n), forecast=1,
                bn_blocks=0, remodulate=True))) for a, n in schedules],
            "the same, the reused residual kept split by the time gates and rebuilt with each "
            "step's own (--remodulate), each part forecast linearly"))
    def ours_mag(th, k, forecast=0):
        def go(w):
            if "our_mag" not in cache:
                cache["our_mag"] = our_mag_ratios(w)
            ratios = cache["our_mag"]
            return run_ours(w, CMConfig(magcache=MagCacheConfig(
                ratios=ratios["cond"], uncond_ratios=ratios.get("uncond", ()), threshold=th,
                max_skip=k), forecast=forecast), cache["counter"])
        return go

    out.append(Method("ours MagCache", "ours", [
        (f"threshold {th}, K {k}", ours_mag(th, k))
        for th, k in grid([(0.001, 3), (0.003, 3), (0.01, 3), (0.06, 5)],
                          [(0.001, 3), (0.003, 3), (0.01, 3), (0.03, 3), (0.06, 3), (0.12, 4),
                           (0.24, 6)])],
        "our gate's MagCache: ratios from our calibrate command on the held-out draw diffusers "
        "calibrates on, retention 0.2, per branch"))
    out.append(Method("ours MagCache +forecast1 (K 2)", "ours", [
        (f"threshold {th}, K 2", ours_mag(th, 2, forecast=1))
        for th in grid([0.001, 0.003, 0.01], [0.003, 0.005, 0.01, 0.03])],
        "our MagCache, at most 2 reuses in a row, the reused residual extrapolated linearly"))
    out.append(Method("ours TeaCache +forecast2", "ours", [
        (f"threshold {th}", ours(CMConfig(teacache=TeaCacheConfig(threshold=th), forecast=2,
                                          limits=LimitsConfig(max_continuous=3))))
        for th in grid([0.002, 0.005, 0.01], [0.005, 0.01, 0.02])], "at most 3 reuses in a row"))

    def budgeted(rel_err):
        def go(w):
            config, chosen = budgeted_config(cache, w, rel_err)
            run = run_ours(w, config, cache["counter"])
            run.trace = {**chosen, "gate": run.trace}
            run.note = chosen["choice"] or "uncached (nothing calibrated promises it)"
            return run
        return go

    out.append(Method("ours budgeted", "ours", [
        (f"rel L2 budget {b:g}", budgeted(b)) for b in pick(list(BUDGETS))],
        "--budget_rel_err: the cheapest configuration of sampling/budget.py's space whose "
        "error bound (95%, learned from the spread over 3 held-out draws) is within the budget"))
    return out


def _unavailable(message):
    def go(_):
        raise RuntimeError(message)
    return go


def _write_json(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


# --- running a family -------------------------------------------------------------------------

FOLLOW = tuple(f"follow_{k}" for k in ("foreground", "background", "direction", "shape"))
COLUMNS = ("family", "method", "impl", "setting", "computed_fraction", "cpu_s", "wall_s",
           "speedup", "psnr_db", "rel_l2", "rel_to_displacement", *FOLLOW, "status")


def row(family, method, impl, setting, run=None, base=None, noise=None, status="ok") -> dict:
    r = dict.fromkeys(COLUMNS)
    r.update(family=family, method=method, impl=impl, setting=setting, status=status)
    if run is not None:
        r.update(computed_fraction=run.fraction, cpu_s=run.cpu, wall_s=run.wall)
        if run.follow is not None:
            r.update({k: run.follow[k[len("follow_"):]] for k in FOLLOW})
        if base is not None:
            f = fidelity(run.latents, base.latents, noise)
            r.update(speedup=base.cpu / run.cpu, psnr_db=f["psnr_db"], rel_l2=f["rel_l2"],
                     rel_to_displacement=f["rel_to_displacement"])
    return r


def show(r: dict) -> str:
    def num(v, fmt):
        return "-" if v is None else ("inf" if v == math.inf else format(v, fmt))
    text = (f"{r['method']:30s} {r['setting']:26s} {num(r['computed_fraction'], '.3f'):>6s} "
            f"{num(r['cpu_s'], '.2f'):>6s} {num(r['wall_s'], '.2f'):>6s} "
            f"{num(r['speedup'], '.2f'):>5s}x "
            f"{num(r['psnr_db'], '.1f'):>6s} {num(r['rel_l2'], '.2e'):>9s} "
            f"{num(r['rel_to_displacement'], '.2e'):>9s}")
    if r.get("follow_foreground") is not None:
        text += "  prompt " + " ".join(f"{k[7:9]} {r[k]:.0%}" for k in FOLLOW)
    return text if r["status"] == "ok" else f"{text}  {r['status']}"


def run_family(family: Family, args) -> tuple[list[dict], dict, dict]:
    """Every run of one family: rows, traces and the baselines' facts."""
    wl = build_workload(family, args.steps)
    cache = {"counter": our_counter(wl),
             "profile_path": os.path.join(args.out, f"budget_profile_{family.key}.json")}
    print(f"\n{family.title}: {family.config.num_layers} blocks, width "
          f"{getattr(family.config, 'dim', None) or family.config.hidden_size}, latent "
          f"{list(wl.shape)} ({wl.pipe.tokens(wl.shape)} tokens), {wl.steps} steps "
          f"{wl.pipe.solver} shift {wl.pipe.shift}, CFG {wl.guidance}", flush=True)
    header = (f"{'method':30s} {'setting':26s} {'blocks':>6s} {'CPU s':>6s} {'wall s':>6s} "
              f"{'speed':>6s} "
              f"{'PSNR':>6s} {'rel L2':>9s} {'rel/disp':>9s}")
    print(header)
    # Trained regime: every setting runs on the same held-out prompts and is pooled over them.
    seeds = FOLLOW_SEEDS[:args.follow] if family.trained else ()
    pooled = (lambda go: lambda w: over_prompts(w, go, seeds)) if seeds else (lambda go: go)
    noise = torch.cat([noise_for(wl.shape, s) for s in seeds]) if seeds else wl.noise
    # Baselines: the faster of two runs each (timing only; the latents are identical).
    ours_twice = [pooled(lambda w: run_ours(w, CMConfig(), cache["counter"]))(wl)
                  for _ in range(2)]
    theirs_twice = [pooled(run_diffusers)(wl) for _ in range(2)]
    ours_base = min(ours_twice, key=lambda r: r.cpu)
    their_base = min(theirs_twice, key=lambda r: r.cpu)
    # how much one timing moves between identical runs: the noise floor of every speedup
    spread = max(abs(a.cpu - b.cpu) / min(a.cpu, b.cpu) for a, b in (ours_twice, theirs_twice))
    agreement = fidelity(their_base.latents, ours_base.latents, noise)
    rows = [row(family.key, "uncached", "ours", "-", ours_base, ours_base, noise),
            # diffusers' uncached latents against ours: the harness agreement
            row(family.key, "uncached", "diffusers", "- (PSNR etc. against ours)", their_base,
                ours_base, noise)]
    rows[1]["speedup"] = 1.0  # peers' speedups are over this run
    for r in rows:
        print(show(r), flush=True)
    traces = {}
    if seeds:
        traces["prompts"] = [held_out_clip(s).prompt for s in seeds]
        traces["uncached | hits"] = ours_base.follow["hits"]
    menu = methods(wl, args.quick, cache)
    for m in menu:
        for label, go in m.settings:
            try:
                run = pooled(go)(wl)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported
                reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                rows.append(row(family.key, m.name, m.impl, "all", status=f"not run: {reason}"))
                print(show(rows[-1]), flush=True)
                break  # the same failure for every setting of this method
            base = ours_base if m.impl == "ours" else their_base
            label = f"{label}: {run.note}" if run.note else label
            rows.append(row(family.key, m.name, m.impl, label, run, base, noise))
            print(show(rows[-1]), flush=True)
            traces[f"{m.name} | {label}"] = {"per_call_blocks": run.per_call, "trace": run.trace}
            if run.follow is not None:
                traces[f"{m.name} | {label}"]["hits"] = run.follow["hits"]
    if "mag" in cache:
        traces["diffusers MagCache calibration ratios"] = cache["mag"][1]
    if "our_mag" in cache:
        traces["ours MagCache calibration ratios"] = cache["our_mag"]
    unseen = budgets_on_unseen_draws(wl, cache) if "budget" in cache else []
    for u in unseen:
        print(f"budget {u['budget']:g} on unseen draw {u['seed']}: {u['choice']}, computed "
              f"{u['computed']:.3f}, rel L2 {u['rel_l2']:.2e}"
              f" ({'kept' if u['rel_l2'] <= u['budget'] else 'MISSED'})", flush=True)
    facts = {"shape": list(wl.shape), "tokens": wl.pipe.tokens(wl.shape), "steps": wl.steps,
             "solver": wl.pipe.solver, "shift": wl.pipe.shift, "guidance": wl.guidance,
             "blocks": family.config.num_layers, "agreement": agreement, "spread": spread,
             "uncached_cpu": (ours_base.cpu, their_base.cpu),
             "budget_unseen": unseen,
             "about": {m.name: m.about for m in menu}}
    return rows, traces, facts


# --- where we stand ---------------------------------------------------------------------------

MATCH_TOLERANCE = 0.01  # computed fractions within this count as matched (they come in steps)
GOAL_SPEEDUP, GOAL_DB = 1.25, 3.0  # issue 9: at equal fidelity 1.25x, or +3 dB at equal speed


def front(points):
    """Non-dominated (cost, PSNR, ...) points, cheapest first: nothing cheaper has as much PSNR."""
    out, best = [], -math.inf
    for p in sorted(points, key=lambda p: (p[0], -p[1])):
        if p[1] > best:
            out.append(p)
            best = p[1]
    return out


def compare(ours, peer, tolerance):
    """For each point (cost, PSNR, ...) of the peer's front: ours' best PSNR at no more cost
    (+ tolerance) as a gain in dB, and the peer's cost over the least cost at which ours reaches
    the peer's PSNR (a speedup ratio); None where ours has no such point."""
    out = []
    for point in front(peer):
        cost, psnr = point[:2]
        at_cost = [q for c, q, *_ in ours if c <= cost + tolerance]
        reach = [c for c, q, *_ in ours if q >= psnr]
        out.append((point, max(at_cost) - psnr if at_cost else None,
                    cost / min(reach) if reach else None))
    return out


def goal_met(d_psnr, ratio) -> bool:
    return (d_psnr is not None and d_psnr >= GOAL_DB) or (ratio is not None and ratio >= GOAL_SPEEDUP)


def both_met(d_psnr, ratio) -> bool:
    """Issue 17's stricter goal: +3 dB at the peer's fraction and 1.25x at its PSNR, at once."""
    return (d_psnr is not None and d_psnr >= GOAL_DB) and (ratio is not None and ratio >= GOAL_SPEEDUP)


def points(rows, family, ours: bool, cost="computed"):
    """(cost, PSNR, method) of every finished run with finite PSNR, ours' or the peers'; cost is
    the computed fraction, or the loop's CPU seconds: ours and diffusers' run the same maths on
    the same torch CPU, so their seconds compare directly (no baseline's noise in between)."""
    return [(r["computed_fraction"] if cost == "computed" else r["cpu_s"], r["psnr_db"],
             r["method"])
            for r in rows
            if r["family"] == family and r["status"] == "ok" and r["method"] != "uncached"
            and r["psnr_db"] not in (None, math.inf) and (r["impl"] == "ours") == ours]


def _fmt(v, fmt, none="not reached"):
    return none if v is None else format(v, fmt)


def standing(rows, family) -> tuple[list[str], str]:
    """Markdown lines (ours, every curve together, against each peer, then against the best
    peer point by point) and a one-line summary of the goal."""
    ours, peers = points(rows, family, True), points(rows, family, False)
    if not ours or not peers:
        return ["No comparison: ours or every peer is missing for this family."], "no comparison"
    names = list(dict.fromkeys(p[2] for p in peers))
    lines = ["At matched computed fraction (ours = the best of all our curves; a peer's points "
             f"are its Pareto front; matched means ours computes at most {MATCH_TOLERANCE} more "
             "of the blocks):", "",
             "| peer | front points | PSNR gain of ours at matched computed fraction (min / "
             "median / max, dB) | compute speedup of ours at matched PSNR (min / median / max) "
             "| goal met |", "|---|---|---|---|---|"]
    for name in names:
        res = compare(ours, [p for p in peers if p[2] == name], MATCH_TOLERANCE)
        lines.append(f"| {name} | {len(res)} | {_summary([d for _, d, _ in res], '+.1f')} | "
                     f"{_summary([r for _, _, r in res], '.2f', 'x')} | "
                     f"{sum(goal_met(d, r) for _, d, r in res)}/{len(res)} |")
    lines += ["", "Against the best peer (the front of all peers together), point by point:", "",
              "| best-peer point | computed, PSNR | ours' best PSNR at that computed fraction "
              "| ours' least computed fraction for that PSNR | goal (+3 dB or 1.25x) "
              "| both (+3 dB and 1.25x) |", "|---|---|---|---|---|---|"]
    res = compare(ours, peers, MATCH_TOLERANCE)
    for (cost, psnr, name), d, ratio in res:
        ours_at = None if d is None else psnr + d
        least = None if ratio is None else cost / ratio
        lines.append(f"| {name} | {cost:.3f}, {psnr:.1f} dB | {_fmt(ours_at, '.1f', 'none')} "
                     f"({_fmt(d, '+.1f', '-')} dB) | {_fmt(least, '.3f')} "
                     f"({_fmt(ratio, '.2f', '-')}x) | {'met' if goal_met(d, ratio) else 'not met'} "
                     f"| {'met' if both_met(d, ratio) else 'not met'} |")
    met = sum(goal_met(d, r) for _, d, r in res)
    both = sum(both_met(d, r) for _, d, r in res)
    timed = compare(points(rows, family, True, "cpu"), points(rows, family, False, "cpu"), 0.0)
    timed_met = sum(goal_met(d, r) for _, d, r in timed)
    gains, ratios = [d for _, d, _ in timed], [r for _, _, r in timed]
    lines += ["", f"Goal met at {met} of {len(res)} points of the best peer's front in computed "
              f"fraction; both forms at once (issue 17) at {both}. In measured time (the loop's CPU seconds, ours against the peers' "
              f"directly, one run each, no tolerance): PSNR gain at no more CPU time "
              f"{_summary(gains, '+.1f')} dB, speedup ratio at matched PSNR "
              f"{_summary(ratios, '.2f', 'x')}; goal met at {timed_met} of {len(timed)} points "
              f"of the best peer's front in CPU time."]
    summary = (f"goal met at {met} of {len(res)} points of the best peer's front in computed "
               f"fraction, both forms at once (+3 dB and 1.25x) at {both} (PSNR gain of ours at matched fraction "
               f"{_summary([d for _, d, _ in res], '+.1f')} dB, min / median / max), and at "
               f"{timed_met} of {len(timed)} in measured CPU time (gain at no more CPU time "
               f"{_summary(gains, '+.1f')} dB, speedup ratio at matched PSNR "
               f"{_summary(ratios, '.2f', 'x')})")
    return lines, summary


def _summary(values, fmt, unit=""):
    """min / median / max of the values that exist."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return "none"
    mid = values[len(values) // 2]
    return " / ".join(format(v, fmt) + unit for v in (values[0], mid, values[-1]))


# --- writing it down --------------------------------------------------------------------------

def write_csv(rows, path):
    import csv
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def table(rows, family) -> list[str]:
    def num(v, fmt):
        return "-" if v is None else ("inf" if v == math.inf else format(v, fmt))
    lines = ["| method | setting | computed | CPU s | wall s | speedup | PSNR dB | rel L2 | rel/disp |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["family"] != family:
            continue
        name = f"{r['impl']} uncached" if r["method"] == "uncached" else r["method"]
        if r["status"] != "ok":
            lines.append(f"| {name} | {r['setting']} | {r['status']} | | | | | | |")
            continue
        lines.append(f"| {name} | {r['setting']} | {num(r['computed_fraction'], '.3f')} | "
                     f"{num(r['cpu_s'], '.2f')} | {num(r['wall_s'], '.2f')} | "
                     f"{num(r['speedup'], '.2f')}x | "
                     f"{num(r['psnr_db'], '.1f')} | {num(r['rel_l2'], '.2e')} | "
                     f"{num(r['rel_to_displacement'], '.2e')} |")
    return lines


STYLE = {"ours": "-", "diffusers": "--", "cache-dit": ":"}


def plot(rows, fams, path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -r requirements-dev.txt)")
        return False
    fig, axes = plt.subplots(2, len(fams), figsize=(7.5 * len(fams), 10), squeeze=False)
    markers = "osD^v<>phX*"
    tab20 = plt.get_cmap("tab20")
    # one colour and marker per method in every panel; tab20's strong shades first
    order = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "uncached"))
    shades = [tab20(i) for i in (*range(0, 20, 2), *range(1, 20, 2))]
    for col, fam in enumerate(fams):
        names = list(dict.fromkeys(r["method"] for r in rows if r["family"] == fam.key
                                   and r["method"] != "uncached" and r["status"] == "ok"))
        for name in names:
            k = order.index(name)
            pts = sorted((r["computed_fraction"], r["cpu_s"], r["psnr_db"], r["impl"])
                         for r in rows if r["family"] == fam.key and r["method"] == name
                         and r["status"] == "ok" and r["psnr_db"] != math.inf)
            if not pts:
                continue
            impl = pts[0][3]
            style = dict(linestyle=STYLE[impl], marker=markers[k % len(markers)],
                         color=shades[k % 20],
                         linewidth=2.2 if impl == "ours" else 1.3, label=name, markersize=5)
            axes[0][col].plot([p[0] for p in pts], [p[2] for p in pts], **style)
            by_time = sorted(pts, key=lambda p: p[1])
            axes[1][col].plot([p[1] for p in by_time], [p[2] for p in by_time], **style)
        axes[0][col].set_title(f"{fam.title}, {fam.config.num_layers} blocks", fontsize=10)
        axes[0][col].set_xlabel("fraction of block evaluations computed (hooks on sub-layers)")
        axes[1][col].set_xlabel("CPU seconds of the denoising loop (one torch thread; lower is "
                                "faster)")
        for ax in axes[:, col]:
            ax.set_ylabel("PSNR of final latents vs uncached (dB)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            found = re.search(r"model name\s*:\s*(.*)", f.read())
            cpu = found.group(1) if found else cpu
    return (f"{cpu}, {os.cpu_count()} cores visible, torch {torch.__version__} on CPU with "
            f"{torch.get_num_threads()} thread(s), Python {platform.python_version()}, "
            f"{platform.system()} {platform.release()}")


def versions() -> str:
    out = []
    for name in ("diffusers", "cache_dit"):
        try:
            module = __import__(name)
            out.append(f"{name.replace('_', '-')} {module.__version__}")
        except Exception as exc:  # noqa: BLE001
            out.append(f"{name.replace('_', '-')} not importable ({type(exc).__name__})")
    return ", ".join(out)


NOT_REGISTERED = (
    "diffusers' FirstBlockCache, MagCache and SeaCache hooks look each block's class up in "
    "`TransformerBlockRegistry` (diffusers/hooks/_helpers.py); diffusers 0.42.1 registers "
    "`WanTransformerBlock` and the HunyuanVideo 1.0 blocks but not "
    "`HunyuanVideo15TransformerBlock`, so `enable_cache` raises on HunyuanVideo-1.5. Its "
    "TaylorSeer hook selects modules by name and runs; cache-dit ships a HunyuanVideo-1.5 "
    "adapter and runs.")

NOTES = """\
- Check of the harness: ours FBCache without a forecast takes the same decisions as diffusers'
  FBC (the same first-block residual test): the same computed fraction and PSNR at the smaller
  thresholds; at larger ones ours also computes the last step (`last_steps=1`, 2 of 100 calls).
- Where our lead comes from: forecasting the reused residual from the last two or three computed
  ones, and (issue 17) deciding reuse by the forecast's own error: the FBCache +forecast2/+forecast1
  gated curves compare block 0's residual with its forecast (`--forecast_gate`) and sum that
  error over the reuse run (`--fb_accumulate`). Block 0's forecast error follows the middle's
  closely (log correlation 0.99 to 1.00, `python bench/forecast_signals.py`), so reuse runs
  stop where the extrapolation goes wrong, not where the raw change is large; the gated curves
  alone make all of our front on HunyuanVideo-1.5 and its mid and high-fidelity part on Wan.
  cache-dit's TaylorSeer calibrator forecasts like us but decides on the raw change.
- Wan's cheap end (issue 17): the step-weighted curve (linear forecast, each step's forecast
  error weighted by its size in sigma, no forced last compute) reaches diffusers FBC's 55.7 dB at
  0.111 computed and its 62.5 dB at 0.169, by thin margins (0.3 and 0.5 dB) on this one draw;
  forcing compute schedules by hand, the best 4-compute schedule found on Wan gives 56.3 dB, so
  that end is close to what any schedule can do here. The first reuse run has one stored residual
  and is plain reuse; extrapolating it along block 0's change cannot help, since that change
  points almost orthogonally to the middle's (cos 0.0 to 0.2, bench/results/forecast_signals.md).
- Our curves are not monotonic in the threshold (Wan gated 0.07: 0.304 computed, 64.3 dB; 0.15:
  0.265, 70.9 dB): the errors of different reuse runs partly cancel in the final latent, so a
  single point carries a few dB of luck either way; the front takes each curve's best points.
- Measured time: the standing in time compares the loops' CPU seconds directly (ours and
  diffusers' do the same maths on the same torch CPU; their uncached CPU seconds are given
  above). A single run's CPU time moves by several percent between identical runs (the
  spread above) and by more when other jobs load the machine, so the standing in time changes
  between runs wherever the computed-fraction lead is small. The computed fraction does not
  move.
- Budgeted mode (issue 17): `--budget_rel_err` now chooses among every configuration we ship
  (sampling/budget.py SPACE), calibrated on three draws it is never evaluated on, by a 95%
  prediction bound for an unseen draw (log errors, Student's t, the spread pooled over all
  configurations as a floor). The bound is conservative by design: the achieved error sits well
  under the budget (the table's max column), so a budget buys less speed than the curve could
  give on one lucky draw, and keeps on draws it never saw.
- Not measured yet: the step weighting on the quadratic forecast at every threshold, and on
  real checkpoints.
- Caveats: random weights keep much of the initial noise, so PSNR is inflated (rel/disp does not
  flatter); one prompt and one seed make each curve (MagCache calibrates on another draw,
  budgeted mode on three others, and is checked on five); the models are tiny (30 blocks, width
  48 / 64, 320 / 400 tokens), so per-op
  overhead dominates their time on a CPU.
"""


def follow_mean(r) -> float:
    return sum(r[k] for k in FOLLOW) / len(FOLLOW)


def follow_standing(rows, family, n) -> tuple[list[str], str]:
    """Trained regime: prompt following of every setting against its computed fraction, and
    where caching starts to break the prompt, ours (every curve) against the peers (every
    peer). A setting keeps the prompt when no attribute loses more than one of the n prompts
    against its own implementation's uncached run."""
    done = [r for r in rows if r["family"] == family and r["status"] == "ok"
            and r.get("follow_foreground") is not None]
    if not done:
        return ["Prompt following was not measured."], "prompt following not measured"
    base = {r["impl"]: r for r in done if r["method"] == "uncached"}
    slack = 1.0 / n + 1e-9

    def keeps(r):
        ref = base["ours" if r["impl"] == "ours" else "diffusers"]
        return all(r[k] >= ref[k] - slack for k in FOLLOW)

    lines = [f"Each setting on the same {n} held-out prompts (attribute combinations never "
             "trained on; one noise draw each), decoded and read by bench/fixtures/analyser.py. "
             "mean: of the four attributes. keeps: no attribute loses more than one prompt "
             "against the same implementation's uncached run.", "",
             "| method | setting | computed | fg color | bg color | direction | shape | mean | "
             "keeps the prompt |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(done, key=lambda r: (r["impl"] != "ours", r["method"] != "uncached",
                                         r["computed_fraction"])):
        name = f"{r['impl']} uncached" if r["method"] == "uncached" else r["method"]
        lines.append(f"| {name} | {r['setting']} | {r['computed_fraction']:.3f} | "
                     + " | ".join(f"{r[k]:.0%}" for k in FOLLOW)
                     + f" | {follow_mean(r):.0%} | {'yes' if keeps(r) else 'NO'} |")
    cached = [r for r in done if r["method"] != "uncached"]
    parts = []
    for who, mine in (("ours", True), ("the peers", False)):
        side = [r for r in cached if (r["impl"] == "ours") == mine]
        kept = [r for r in side if keeps(r)]
        broke = [r for r in side if not keeps(r)]
        least = min(kept, key=lambda r: r["computed_fraction"], default=None)
        most_broken = max(broke, key=lambda r: r["computed_fraction"], default=None)
        text = (f"{who}: least computed fraction keeping the prompt "
                + (f"{least['computed_fraction']:.3f} ({least['method']}, {least['setting']}, "
                   f"mean {follow_mean(least):.0%})" if least else "none"))
        text += ("; the most computed setting that breaks it "
                 + (f"{most_broken['computed_fraction']:.3f} ({most_broken['method']}, "
                    f"{most_broken['setting']}, mean {follow_mean(most_broken):.0%})"
                    if most_broken else "none"))
        parts.append(text)
    summary = "; ".join(parts)
    lines += ["", f"Where caching starts to break the prompt: {summary}."]
    return lines, summary


def plot_follow(rows, fams, path) -> bool:
    """Prompt following (mean of the four attributes) against computed fraction, per family."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(fams), figsize=(7.5 * len(fams), 5), squeeze=False)
    for ax, fam in zip(axes[0], fams, strict=True):
        done = [r for r in rows if r["family"] == fam.key and r["status"] == "ok"
                and r.get("follow_foreground") is not None]
        for impl, style in (("ours", dict(marker="o", color="tab:blue")),
                            ("peers", dict(marker="s", color="tab:orange", fillstyle="none"))):
            pts = [(r["computed_fraction"], follow_mean(r)) for r in done
                   if r["method"] != "uncached" and (r["impl"] == "ours") == (impl == "ours")]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle="none", label=impl,
                    **style)
        for r in done:
            if r["method"] == "uncached" and r["impl"] == "ours":
                ax.axhline(follow_mean(r), color="gray", linestyle="--", label="uncached")
        ax.set_title(fam.title, fontsize=10)
        ax.set_xlabel("fraction of block evaluations computed")
        ax.set_ylabel("prompt following, mean of 4 attributes")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


TRAINED_NOTES = """\
- The regime (issue 28): on the tiny models trained here (held-out direction 100% on both),
  pooled over 12 held-out prompts, cached runs keep 7-84 dB PSNR against uncached (median 40) on
  Wan and 1-76 dB (median 31) on HunyuanVideo-1.5 at 0.16-0.92 computed, where the random-weight
  tables keep 55-110 dB at like fractions. Which steps a schedule computes moves PSNR by up to
  5 dB at one fraction (bench/results/taylorseer_gap.md), so differences of a dB or two between
  neighbouring points are noise.
- What the trained regime asks of the gate: a forecast holds for a step or two. A linear
  forecast with at most 2 reuses in a row (`--teacache --forecast 1 --max_continuous 2`,
  SeaCache's shape) keeps 52.5 dB at 0.37 on Wan, where 3 in a row keeps 43.7 at 0.33 and a
  quadratic forecast 43.9 at 0.37; with at most 1 in a row, 67.5 dB at 0.63. Our MagCache with
  the same linear forecast and K 2 keeps 65.6 dB at 0.56. The hybrid preset changed to this
  shape (bench/results/presets.md).
- Where a peer still leads (Wan): diffusers' MagCache at its high-fidelity end (73.1 dB at 0.88;
  ours 71.8 at 0.80, -1.3 dB) and level points with it at 0.60 (+0.3 dB) and with TaylorSeer at
  0.26 (-0.6 dB). Nothing else: SeaCache by +4.5 / +4.9 dB, MagCache at 0.34 by +6.9, FBC by
  +2.4 to +17.5, cache-dit by +17 to +58.
- TaylorSeer's lead on the earlier weights was the schedule, not the modulation: at the steps
  TaylorSeer computes, our linear forecast keeps 47.1 dB against its 42.8 (interval 2) and 45.7
  against 46.7 (interval 3, 0.36 against 0.38 computed); re-applying each step's modulation to
  the reused residual (`--remodulate`, exactly TaylorSeer's form of reuse) moves our rows by
  -1.2 to +0.5 dB (bench/results/taylorseer_gap.md).
- HunyuanVideo-1.5: only diffusers' TaylorSeer and cache-dit run on it; ours meets both forms at
  all 3 TaylorSeer points (+6.1 to +16.4 dB, 1.27x-1.62x less computed).
- Prompt following: shape is the first attribute to go, the colours the last. Ours keeps the
  whole prompt down to 0.25 computed on Wan (FBCache 0.8) and 0.16 on HunyuanVideo-1.5
  (TeaCache 0.05); the peers down to 0.26 (TaylorSeer interval 5) on both.
- Caveats: 12 prompts (one prompt is 8 points of accuracy), 6- and 4-block models of 64
  tokens; CPU seconds of a tiny model are mostly per-call overhead, so the computed fraction is
  the figure to compare.
"""


FRONT_DB = 1.0  # issue 17: budgeted mode's points lie within this of our front


def budget_standing(rows, family, unseen) -> tuple[list[str], str]:
    """Budgeted mode: each budget on the five draws it was not calibrated on (SEED's run is its
    row here), and each of its points on SEED against our front (the other curves) and the best
    peer, both forms of the goal. Markdown lines and a one-line summary."""
    runs = [r for r in rows if r["family"] == family and r["method"] == "ours budgeted"
            and r["status"] == "ok"]
    if not runs:
        return ["Budgeted mode did not run."], "budgeted mode did not run"
    ours = [p for p in points(rows, family, True) if p[2] != "ours budgeted"]
    peers = points(rows, family, False)
    lines = [f"Budgeted mode (`--budget_profile` + `--budget_rel_err`), calibrated on draws "
             f"{', '.join(map(str, BUDGET_SEEDS))} and run on {len(UNSEEN_SEEDS)} draws it never "
             f"saw ({', '.join(map(str, UNSEEN_SEEDS))}); its point is the run on draw {SEED}, "
             "the one every curve here is measured on:", "",
             "| budget (rel L2) | chosen | computed | PSNR dB | achieved rel L2 on the unseen "
             "draws (max) | kept | our front's best PSNR at that fraction | best peer's PSNR at "
             "no more computed (ours' gain) | best peer's least computed for that PSNR (ratio) "
             "| both (+3 dB and 1.25x) |", "|---|---|---|---|---|---|---|---|---|---|"]
    kept_all = near_all = both_all = draws = 0
    worst_ratio = 0.0
    for r in runs:
        b = float(re.search(r"budget ([0-9.e-]+)", r["setting"]).group(1))
        choice = r["setting"].split(": ", 1)[1] if ": " in r["setting"] else "-"
        achieved = [r["rel_l2"]] + [u["rel_l2"] for u in unseen if u["budget"] == b]
        draws += len(achieved)
        kept = sum(e <= b for e in achieved)
        worst_ratio = max(worst_ratio, max(achieved) / b)
        f, q = r["computed_fraction"], r["psnr_db"]
        front_at = max((p for c, p, _ in ours if c <= f + MATCH_TOLERANCE), default=None)
        near = front_at is None or q >= front_at - FRONT_DB
        peer_at = max((p for c, p, _ in peers if c <= f + MATCH_TOLERANCE), default=None)
        gain = None if peer_at is None else q - peer_at
        reach = [c for c, p, _ in peers if p >= q]
        ratio = min(reach) / f if reach else None
        both = (gain is None or gain >= GOAL_DB) and (ratio is None or ratio >= GOAL_SPEEDUP)
        kept_all += kept
        near_all += near
        both_all += both
        lines.append(
            f"| {b:g} | {choice} | {f:.3f} | {q:.1f} | {max(achieved):.2e} | "
            f"{kept}/{len(achieved)} | {_fmt(front_at, '.1f', 'none')} "
            f"({'within' if near else 'NOT within'} {FRONT_DB:g} dB) | "
            f"{_fmt(peer_at, '.1f', 'none (no peer is as cheap)')} ({_fmt(gain, '+.1f', '-')} dB) "
            f"| {_fmt(None if ratio is None else f * ratio, '.3f', 'none (no peer reaches it)')} "
            f"({_fmt(ratio, '.2f', '-')}x) | {'met' if both else 'not met'} |")
    summary = (f"budgeted mode kept {kept_all} of {draws} budget x unseen-draw runs (worst "
               f"achieved / budget {worst_ratio:.2f}); its points within {FRONT_DB:g} dB of our "
               f"front at {near_all} of {len(runs)}, both forms against the best peer at "
               f"{both_all} of {len(runs)}")
    lines += ["", f"Summary: {summary}. A peer point missing on one side counts for us (no peer "
              "is as cheap, or none reaches that PSNR)."]
    return lines, summary


def write_readme(path, rows, fams, facts, args, elapsed, loads, have_plot):
    names = {f.key: f.title for f in fams}
    not_run = [r for r in rows if r["status"] != "ok" and r["family"] in names]
    standings = {f.key: standing(rows, f.key) for f in fams}
    budgets = {f.key: budget_standing(rows, f.key, facts[f.key]["budget_unseen"]) for f in fams}
    lines = ["# Fidelity against speed: our caching beside diffusers' cache hooks and cache-dit", "",
             f"Reproduce: `{args.command}` ({'quick mode, ' if args.quick else ''}"
             f"{elapsed / 60:.1f} min for this run; 1-minute load average {loads[0]:.2f} at the "
             f"start, {loads[1]:.2f} at the end: other jobs shared the machine).", "",
             "Issue 9's goal: at equal fidelity 1.25 times the speedup of the best peer, or "
             "+3 dB PSNR at equal speedup. This run:", ""]
    lines += [f"- {names[k]}: {summary}; {budgets[k][1]}." for k, (_, summary) in standings.items()]
    if args.weights == "trained" and args.follow:
        lines += [f"- {f.title}, prompt following: {follow_standing(rows, f.key, args.follow)[1]}."
                  for f in fams]
    lines += ["", "## Setup", "",
              f"- Machine: {machine()}.", f"- Peers as installed: {versions()}.",
              (f"- Models: random weights, {INIT}; the same weights in ours and, through "
               "modules/convert.py, in diffusers' transformer." if not args.weights == "trained"
               else "- Models: TRAINED weights, the tiny models trained here on procedural clips "
               "(issue 28, bench/fixtures; each one's MODEL_CARD.md beside its weights), loaded "
               "by modules/checkpoint.py as a real checkpoint; the same weights in diffusers' "
               f"transformer through modules/convert.py. Every setting runs on {args.follow} "
               "held-out prompts with one noise draw each, pooled: PSNR and rel L2 over all "
               "of them, CPU seconds summed."),
              "- Every run: the same noise and text embeddings (seed 0), our scheduler, the same "
              "step count and CFG, cond then uncond per step; the peers drive diffusers' model "
              "in a small loop (`denoise_diffusers`), ours run on the torch backend (eager).",
              "- computed: fraction of block evaluations that ran, counted for every method by "
              "forward pre-hooks on the first linear of each block's sub-layers (Wan: "
              "self-attention, cross-attention, FFN; HunyuanVideo-1.5: joint attention, image "
              "FFN, text FFN). CPU s: process CPU time of the denoising loop (one torch "
              "thread; steadier than wall time while other jobs share the machine; both are in "
              "the table); speedup: the same implementation's uncached CPU time over the run's. "
              "PSNR, rel L2 "
              "and rel/disp (error over the uncached run's displacement from the noise): final "
              "latents against the same implementation's uncached latents."]
    for fam in fams:
        f, a = facts[fam.key], facts[fam.key]["agreement"]
        psnr = "inf (identical)" if a["psnr_db"] == math.inf else f"{a['psnr_db']:.1f} dB"
        lines.append(f"- {fam.title}: {f['blocks']} blocks, latent {f['shape']} ({f['tokens']} "
                     f"tokens), {f['steps']} steps {f['solver']} shift {f['shift']}, CFG "
                     f"{f['guidance']}. Uncached diffusers against uncached ours: rel L2 "
                     f"{a['rel_l2']:.1e}, PSNR {psnr}. Uncached loop: {f['uncached_cpu'][0]:.2f} "
                     f"CPU s ours, {f['uncached_cpu'][1]:.2f} diffusers'; two identical uncached "
                     f"runs differ by up to {100 * f['spread']:.0f}%.")
    if not_run:
        lines += ["", "Not run (the library's own error; nothing is estimated in its place):", ""]
        lines += [f"- {names[r['family']]}: {r['method']}: {r['status'][len('not run: '):]}"
                  for r in not_run]
        if any("not registered" in r["status"] for r in not_run):
            lines += ["", NOT_REGISTERED]
    if have_plot:
        lines += ["", "![PSNR against computed fraction (top) and the loop's CPU seconds (bottom)]"
                      "(pareto.png)"]
    for fam in fams:
        lines += ["", f"## Where we stand: {fam.title}", ""] + standings[fam.key][0]
        lines += ["", "### Budgeted mode", ""] + budgets[fam.key][0]
        if fam.trained and args.follow:
            lines += ["", "### Prompt following against computed fraction", ""]
            lines += follow_standing(rows, fam.key, args.follow)[0]
            lines += ["", "![prompt following against computed fraction](follow.png)"]
    lines += ["", "## Reading it", "", TRAINED_NOTES if args.weights == "trained" else NOTES]
    for fam in fams:
        lines += [f"## Table: {fam.title}", ""] + table(rows, fam.key) + [""]
    lines += ["Settings: " + "; ".join(f"{k}: {v}" for k, v in facts[fams[0].key]["about"].items()
                                       if v) + ".", "",
              "Files: results.csv (every row), table.md, pareto.png, traces_<family>.json (per "
              "run: the block-equivalents computed in each model call as the hooks counted "
              "them, and the method's own decisions: our gate's trace, cache-dit's cached steps "
              "and residual diffs, MagCache's calibration ratios, the budget's chosen "
              "configuration and its bound), budget_profile_<family>.json (budgeted mode's "
              "calibration: every configuration's rel L2 and computed fraction on each held-out "
              "draw)."]
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="20 steps and every other setting (a few minutes); writes to "
                         "bench/results/tmp/pareto_quick unless --out is given")
    ap.add_argument("--families", default="wan,hunyuan", help="comma-separated: wan, hunyuan")
    ap.add_argument("--out", help=f"results folder (default {os.path.relpath(OUT)})")
    ap.add_argument("--steps", type=int, help="denoising steps (default: the pipeline's, 50)")
    ap.add_argument("--blocks", type=int, default=30, help="Wan blocks (TI2V-5B has 30)")
    ap.add_argument("--hy_blocks", type=int, default=30,
                    help="HunyuanVideo-1.5 blocks (the real model has 54; 30 keeps the run short)")
    ap.add_argument("--weights", choices=("random", "trained"), default="random",
                    help="random: tiny-but-deep random-weight DiTs made smooth in t; trained: the "
                         "tiny models trained here (issue 28), prompt following measured too; "
                         "writes to bench/results/pareto/trained unless --out is given")
    ap.add_argument("--follow", type=int, default=len(FOLLOW_SEEDS),
                    help=f"trained weights: the held-out prompts every setting runs on, pooled "
                         f"(PSNR over all of them, prompt following per attribute); at most "
                         f"{len(FOLLOW_SEEDS)}; 0: the one draw of seed {SEED}, as on random weights")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: steadier timings on a shared machine)")
    args = ap.parse_args(argv)
    args.command = "python bench/pareto.py" + ("" if argv is None and len(sys.argv) == 1
                                               else " " + " ".join(sys.argv[1:] if argv is None else argv))
    if args.quick and args.steps is None:
        args.steps = 20
    if not 0 <= args.follow <= len(FOLLOW_SEEDS):
        ap.error(f"--follow: {args.follow}; expected 0 to {len(FOLLOW_SEEDS)}")
    if args.out is None:
        args.out = (os.path.join(os.path.dirname(OUT), "tmp", "pareto_quick") if args.quick
                    else OUT)
        if args.weights == "trained":
            args.out = os.path.join(args.out, "trained")
    all_families = (trained_families() if args.weights == "trained"
                    else families(args.blocks, args.hy_blocks))
    wanted = [k.strip() for k in args.families.split(",") if k.strip()]
    unknown = [k for k in wanted if k not in all_families]
    if unknown or not wanted:
        ap.error(f"--families: unknown {unknown}; expected a comma-separated subset of "
                 f"{', '.join(all_families)}"
                 + (" (the trained pipelines that exist)" if args.weights == "trained" else ""))
    fams = [all_families[k] for k in wanted]
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    began, load = time.perf_counter(), os.getloadavg()[0]
    init = (INIT if args.weights == "random" else
            f"trained here ({', '.join(PIPELINES[TRAINED[f.key]].builtin for f in fams)}), every "
            + (f"setting on {args.follow} held-out prompts" if args.follow
               else f"setting on the held-out prompt of draw {SEED}"))
    print(f"machine: {machine()}\npeers: {versions()}\nweights: {init}\n"
          "blocks = fraction of block evaluations computed (sub-layer hooks); speed = CPU time "
          "of the same implementation's uncached loop over the run's; PSNR, rel L2, rel/disp "
          "against its uncached latents")
    rows, facts = [], {}
    for fam in fams:
        fam_rows, traces, facts[fam.key] = run_family(fam, args)
        rows += fam_rows
        _write_json(os.path.join(args.out, f"traces_{fam.key}.json"), traces)
    write_csv(rows, os.path.join(args.out, "results.csv"))
    with open(os.path.join(args.out, "table.md"), "w") as f:
        for fam in fams:
            f.write(f"## {fam.title}\n\n" + "\n".join(table(rows, fam.key)) + "\n\n")
    have_plot = plot(rows, fams, os.path.join(args.out, "pareto.png"))
    if args.weights == "trained" and args.follow:
        plot_follow(rows, fams, os.path.join(args.out, "follow.png"))
    elapsed = time.perf_counter() - began
    write_readme(os.path.join(args.out, "README.md"), rows, fams, facts, args, elapsed,
                 (load, os.getloadavg()[0]), have_plot)
    for fam in fams:
        print(f"\n{fam.title}: where we stand")
        print("\n".join(standing(rows, fam.key)[0]))
        print("\n".join(budget_standing(rows, fam.key, facts[fam.key]["budget_unseen"])[0]))
        if fam.trained and args.follow:
            print("\n".join(follow_standing(rows, fam.key, args.follow)[0]))
    print(f"\nwrote {os.path.relpath(args.out)}/ (README.md, results.csv, table.md"
          f"{', pareto.png' if have_plot else ''}, traces_*.json) in {elapsed / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())

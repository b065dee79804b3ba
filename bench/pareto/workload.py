"""bench.pareto's workload: the tiny models (random smooth-in-t or trained here), their
draws (noise, stage-1 tensors, the held-out prompts of the trained regime), the block counter
every method is counted by, and our runs on the torch backend."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from bench.workload import smooth_in_t
from cache import (
    CMConfig,
)
from commands.stage2_backend import make_backend
from modules import hunyuan_video15, wan
from modules.registry import FAMILIES, build_model
from sampling.pipelines import PIPELINES
from sampling.run import make_sample, noise_for, sample_once, warm_up
from sampling.run_spec import Launch
from sampling.schedulers import make_scheduler
from sampling.stages import SignalPlan, check_remodulate

# our runs' backend: stage 2's (commands.stage2_backend.make_backend) for --backend torch on this
# CPU, eager
LAUNCH = Launch(backend="torch", device="cpu")
SEED = 0  # noise and stage-1 tensors of the evaluated trajectory
CALIBRATION_SEED = 1  # MagCache calibrates on another draw (held out)
BUDGET_SEEDS = (1, 2, 3)  # budgeted mode calibrates on these draws...
UNSEEN_SEEDS = (SEED, 4, 5, 6, 7)  # ...and is checked on five it never saw
# Trained regime: what a target would choose is screened on 30 more draws (calibrate
# --screen_draws; a fragile prompt flips under one configuration in 10-40 draws), after every
# prompt-following draw (FOLLOW_SEEDS), so none is ever evaluated
SCREEN_SEEDS = tuple(range(34, 64))
# ...and what an error budget would choose is confirmed on 60 more by default (calibrate
# --confirm_draws; python -m bench.pareto --confirm_draws), after the further unseen draws
# python -m bench.studies.fragile_prompts --more takes (64 on). 30 let a schedule through that flips ~5% of
# draws: the twin's 0.03 choice passed draws 84-113, then flipped 4 of draws 114-143 (and page
# draw 17)
CONFIRM_FIRST = 84


def confirm_seeds(count: int) -> tuple[int, ...]:
    return tuple(range(CONFIRM_FIRST, CONFIRM_FIRST + count))


CONFIRM_SEEDS = confirm_seeds(60)
INIT = ("smooth in t (bench/workload.py: Gaussian low-pass over the time embedder's sinusoid "
        "columns, cutoff period 300 timesteps, power renormalised; modulation weights x3), "
        "torch.manual_seed(0) draw, fp32")

# --- the workload -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    """One model family: its tiny-deep config and where its work can be counted. What a family
    does differently is read off its record (and the registry's record of the same name), never
    asked of its name: bench/pareto/peers.py's diffusers adapter is found by `name`."""

    name: str  # the family's name in modules.registry ("wan", "hunyuan_video15"): its identity
    # A label only ("wan", "hunyuan"), kept so that committed result files and command lines stay
    # valid: the --families values, the result rows' family column (rows are matched to their
    # family by it), file names (traces_hunyuan.json.gz, budget_profile_hunyuan.json) and page
    # text. What a family does is found by `name`.
    label: str
    title: str
    pipeline: str  # the tiny pipeline whose sampling defaults (solver, shift, CFG) we keep
    trained_pipeline: str  # the pipeline of the tiny model trained here (issue 28)
    config: Any  # our model config (tiny-deep)
    size: tuple[int, int, int]  # (height, width, frames) of the clip
    blocks: str  # attribute of the block list: ours, diffusers'
    blocks_theirs: str
    # first linear of each sub-layer of a block: ours, diffusers' (same sub-layers in both)
    sublayers: tuple[str, ...]
    sublayers_theirs: tuple[str, ...]
    per_call: str  # our module that runs once per model call (prepare), to split the count
    trained: bool = False  # the pipeline's committed checkpoint (issue 28), not random weights
    checkpoint: str | None = None  # trained weights from this path instead of the pipeline's
    recipe: Any = None  # trained regime: bench.fixtures.recipes.Recipe (None: procedural)

    @property
    def prompts(self):
        """The recipe the trained regime's held-out prompts and their scoring come from."""
        from bench.fixtures.recipes import PROCEDURAL
        return self.recipe or PROCEDURAL

    @property
    def remodulates(self) -> bool:
        """Whether remodulated reuse applies: the registry's model class has gates whose time
        term its blocks share (sampling.stages.check_remodulate; the Wan2.2 family)."""
        try:
            check_remodulate(FAMILIES[self.name].model_cls)
        except ValueError:
            return False
        return True


def families(blocks: int, hy_blocks: int) -> dict[str, Family]:
    """The random-weight families, by label (the --families values)."""
    wn = dataclasses.replace(wan.CONFIGS["wan-tiny-ti2v"], num_layers=blocks, dim=48, ffn_dim=96,
                             num_heads=4)
    hy = dataclasses.replace(hunyuan_video15.CONFIGS["hunyuanvideo-tiny"], num_layers=hy_blocks,
                             hidden_size=64, num_heads=4, rope_axes=(4, 6, 6))
    # The tiny models trained here on procedural clips (issue 28, bench/fixtures): the family's
    # pipeline in sampling/pipelines.py, whose committed checkpoint (`builtin`) is loaded by the
    # same loader as a real checkpoint.
    out = [
        Family("wan", "wan", "Wan2.2 TI2V-5B-shaped (text-to-video, UniPC)", "wan-tiny-ti2v",
               "wan-tiny-trained", wn, (256, 256, 17), "blocks", "blocks",
               ("self_attn.q", "cross_attn.q", "ffn.0"),
               ("attn1.to_q", "attn2.to_q", "ffn.net.0.proj"), "time_embedding"),
        Family("hunyuan_video15", "hunyuan", "HunyuanVideo-1.5-shaped (text-to-video, Euler)",
               "hunyuanvideo-tiny", "hunyuanvideo-tiny-trained", hy, (128, 160, 17),
               "double_blocks", "transformer_blocks", ("img_attn_q", "img_mlp.fc1", "txt_mlp.fc1"),
               ("attn.to_q", "ff.net.0.proj", "ff_context.net.0.proj"), "time_in.mlp"),
    ]
    return {fam.label: fam for fam in out}


FOLLOW_SEEDS = tuple(range(10, 34))  # held-out prompts of the prompt-following runs (none of
# them is the evaluated draw or a calibration draw: SEED, CALIBRATION_SEED, BUDGET_SEEDS)


def trained_families(checkpoint: str | None = None) -> dict[str, Family]:
    """Each family whose trained pipeline exists: its own size, config and blocks. With
    `checkpoint` (a trained tiny model of one family in the official layout, such as the
    further held-out model or a held-back one), that family only, with those weights and the
    config beside them; its pipeline's clip size, solver, shift and CFG stay unless the model
    was trained on another recipe (bench/fixtures/recipes.py: its training.json fixes them)."""
    from bench.fixtures.recipes import of_checkpoint
    out = {}
    held = recipe = None
    if checkpoint is not None:
        from modules.checkpoint import load_model
        held = load_model(checkpoint, meta=True)[0]
        recipe = of_checkpoint(checkpoint)
    for label, fam in families(1, 1).items():
        name = fam.trained_pipeline
        if name not in PIPELINES:
            continue
        pipe = PIPELINES[name]
        title = fam.title.split(" (")[0].replace("-shaped", "-style")
        if held is not None:
            if type(held.config) is not type(pipe.config):
                continue
            size = (recipe.overrides or {}).get("size", pipe.size)
            out[label] = dataclasses.replace(
                fam, title=f"{title}, trained ({checkpoint}, {held.config.num_layers} blocks, "
                           f"{recipe.name} recipe)",
                pipeline=name, config=held.config, size=size, trained=True,
                checkpoint=str(checkpoint), recipe=recipe)
            continue
        out[label] = dataclasses.replace(
            fam, title=f"{title}, trained here ({pipe.builtin}, {pipe.config.num_layers} blocks)",
            pipeline=name, config=pipe.config, size=pipe.size, trained=True)
    return out


def held_out_clip(seed: int, recipe=None):
    """The held-out prompt (an attribute combination never trained on, the recipe's split) that
    draw `seed` of the trained regime asks for; `recipe` (bench/fixtures/recipes.py) None: the
    procedural one every model before issue 60 was trained on."""
    from bench.fixtures.recipes import PROCEDURAL
    return (recipe or PROCEDURAL).held_out(seed)


def prompt_tensors(pipe, seed: int, recipe=None, weights: str | None = None) -> dict:
    """Stage-1 tensors of draw `seed`'s held-out prompt, through the pipeline's own encoder (the
    word table of `weights`, a checkpoint folder, or of the pipeline's built-in model)."""
    from encoders import for_pipeline
    from encoders.request import Request
    prompt = held_out_clip(seed, recipe).prompt
    tensors, _ = for_pipeline(pipe).encode(pipe, Request(prompt=prompt), weights)
    return tensors


def deep_pipeline(family: Family):
    """The family's tiny pipeline pointed at the tiny-deep config and the benchmark clip size."""
    base = PIPELINES[family.pipeline]

    class Deep(type(base)):
        @property
        def config(self):
            return family.config

    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    overrides = (family.recipe.overrides if family.recipe is not None else None) or {}
    return Deep(**{**fields, **overrides, "size": family.size})


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
        return prompt_tensors(pipe, seed, family.prompts, family.checkpoint)
    return pipe.synthesize(shape, True, False, seed)


def build_workload(family: Family, steps: int | None = None) -> Workload:
    pipe = deep_pipeline(family)
    if family.trained:
        from modules.checkpoint import load_model
        model = load_model(family.checkpoint or pipe.builtin_path)[0].eval()
    else:
        torch.manual_seed(0)
        model = smooth_in_t(build_model(family.config)).eval()
    convert = FAMILIES[family.name].format.to_diffusers  # the registry's diffusers key mapping
    shape = pipe.latent_shape(*pipe.size)
    return Workload(family, pipe, model, convert(model.state_dict()),
                    draw_tensors(family, pipe, shape, SEED), shape, steps or pipe.steps,
                    pipe.guidance_for(None))



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
    backend = make_backend(LAUNCH, {None: wl.model}, plan)
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
    recipe = wl.family.prompts
    runs, hits = [], []
    for seed in seeds:
        run = go(wl.reseeded(seed))
        hits.append(recipe.score(shown_clip(wl.pipe, run.latents), held_out_clip(seed, recipe)))
        runs.append(run)
    out = Run(torch.cat([r.latents for r in runs]), sum(r.wall for r in runs),
              sum(r.cpu for r in runs), sum(r.fraction for r in runs) / len(runs),
              [c for r in runs for c in r.per_call], [r.trace for r in runs], runs[0].note)
    out.follow = {**{k: sum(h[k] for h in hits) / len(hits) for k in recipe.attributes},
                  "hits": [{k: bool(v) for k, v in h.items()} for h in hits]}
    return out


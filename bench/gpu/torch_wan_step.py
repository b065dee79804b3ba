"""Per-step time of the real-size Wan2.2-TI2V-5B DiT on one CUDA GPU, with and without caching,
beside diffusers' WanTransformer3DModel on the same shapes and the same random bf16 weights.

    python -m bench.gpu.torch_wan_step [--steps 10] [--height 480 --width 832 --frames 81]
        [--configs none,deepcache,teacache,fbcache,diffusers] [--image] [--compile] [--out PATH]
    python -m bench.gpu.torch_wan_step --device cpu --tiny --steps 4    # smoke test on wan-tiny-ti2v

Ours: TorchBackend as stage 2 builds it (commands.stage2_backend.make_backend; eager, or --compile)
through sampling.run.sample_once
(CFG on, guidance 5, UniPC, shift 5), one warm-up round of every program excluded (compiles
happen there), a device sync after every step.
Diffusers: two model calls per step (cond, uncond), the CFG combination and the same UniPC
scheduler, one warm-up step excluded, a sync after every step. Both share one set of weights:
drawn from a seed directly on the GPU, bf16 with our fp32 islands, handed to diffusers through
modules.wan_format.to_diffusers with diffusers' own fp32 modules (`_keep_in_fp32_modules`).
Random weights make the adaptive gates (TeaCache, FBCache) skip what they skip on these weights,
not what they skip on the released ones; the computed fraction is printed beside every time.

Prints a Markdown table and writes it to --out (default bench/results/torch_wan_step_<gpu>.md).
Without a CUDA GPU it prints one line, writes nothing and exits 0. With --tiny no file is
written unless --out is given.
"""

from __future__ import annotations

import argparse
import math
import platform
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from cache import CMConfig, DeepCacheConfig, FBCacheConfig, TeaCacheConfig  # noqa: E402
from commands.stage2_backend import make_backend  # noqa: E402
from modules import ops  # noqa: E402
from modules.checkpoint import cast_model  # noqa: E402
from modules.registry import build_model  # noqa: E402
from modules.wan_format import diffusers_config as wan_diffusers_config  # noqa: E402
from modules.wan_format import to_diffusers as wan_to_diffusers  # noqa: E402
from sampling.pipelines import get_pipeline  # noqa: E402
from sampling.run import make_sample, noise_for, sample_once  # noqa: E402
from sampling.run_spec import Launch  # noqa: E402
from sampling.schedulers import make_scheduler  # noqa: E402
from sampling.stages import SignalPlan  # noqa: E402
from sampling.units import GiB  # noqa: E402

REAL, TINY = "wan2.2-ti2v-5b", "wan-tiny-ti2v"
REAL_SIZE = (480, 832, 81)  # 480p class: 21 x 15 x 26 = 8190 tokens after VAE 4x16x16, patch 1x2x2
RUNS = ("none", "deepcache", "teacache", "fbcache", "diffusers")
DTYPE = torch.bfloat16


@dataclass
class Row:
    label: str
    step_seconds: list[float]
    step_computed: list[bool]
    wall_seconds: float
    peak_bytes: int | None
    loop_compiles: int | None = None  # frames compiled inside the timed loop (--compile)


# --- weights -----------------------------------------------------------------------------------

def init_std(name: str, param: torch.Tensor) -> tuple[float, float]:
    """(mean, std) of one random parameter: fan-in scaled matrices, norm weights near 1, small
    biases, so 30 blocks keep activations finite in bf16."""
    if param.ndim >= 2:
        fan_in = param.shape[-1] if name.endswith("modulation") else param[0].numel()
        return 0.0, fan_in**-0.5
    if "norm" in name and name.endswith("weight"):
        return 1.0, 0.02
    return 0.0, 0.02


def random_bf16_model(name: str, device: torch.device, seed: int):
    """The model of `name` with seeded random weights made on `device`: built on meta, cast to bf16
    keeping the fp32 islands (cast_model), allocated there with to_empty, then drawn in place."""
    model = cast_model(build_model(name, meta=True), DTYPE).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            mean, std = init_std(pname, p)
            p.normal_(mean, std, generator=gen)
    return model.eval()


def diffusers_wan(model, device: torch.device):
    """diffusers' WanTransformer3DModel holding our tensors (shared, not copied) in the dtypes
    diffusers' from_pretrained(torch_dtype=bf16) gives: bf16 but its `_keep_in_fp32_modules`."""
    try:
        from diffusers import WanTransformer3DModel
    except ImportError as err:
        raise SystemExit(f"the diffusers run needs diffusers ({err}); pip install diffusers==0.42.1 "
                         "or leave 'diffusers' out of --configs") from None
    cfg = model.config
    # Built on the device, not on meta: its rope buffers (fp64 whatever the default dtype) are
    # computed at construction. A bf16 default halves the throw-away initial weights.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        with torch.device(device):
            ref = WanTransformer3DModel(**wan_diffusers_config(cfg))
    finally:
        torch.set_default_dtype(default_dtype)
    keep = tuple(ref._keep_in_fp32_modules or ())
    state = {k: v.to(torch.float32 if any(m in k.split(".") for m in keep) else DTYPE)
             for k, v in wan_to_diffusers(model.state_dict()).items()}
    ref.load_state_dict(state, strict=True, assign=True)
    return ref.eval()


# --- runs --------------------------------------------------------------------------------------

def cache_configs(args) -> dict[str, tuple[str, CMConfig]]:
    """run name -> (label, config); DeepCache is HunyuanVideo-1.5's 11/45/4 of 50 steps, start
    and end scaled to --steps unless --deepcache is given."""
    start, end, interval = args.deepcache or (round(11 * args.steps / 50),
                                               round(45 * args.steps / 50), 4)
    fb = FBCacheConfig(metric="residual_tensor_rel_l1", threshold=args.fbcache_threshold)
    return {
        "none": ("ours, no cache", CMConfig()),
        "deepcache": (f"ours, DeepCache {start}/{end}/{interval}",
                      CMConfig(deepcache=DeepCacheConfig(start=start, end=end, interval=interval))),
        "teacache": (f"ours, TeaCache {args.teacache_threshold}",
                     CMConfig(teacache=TeaCacheConfig(threshold=args.teacache_threshold))),
        "fbcache": (f"ours, FBCache {fb.metric} {fb.threshold}", CMConfig(fbcache=fb)),
    }


def start_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_ours(model, label: str, config: CMConfig, setup: dict, args) -> Row:
    pipe, device = setup["pipe"], setup["device"]
    start_peak(device)
    launch = Launch(backend="torch", device=args.device, torch_compile=args.compile)
    backend = make_backend(launch, {None: model}, SignalPlan.from_config(config))
    sample = make_sample(backend, pipe, setup["tensors"], setup["shape"], image=args.image,
                         seed=args.seed)
    traj = sample_once(backend, config, sample, solver=pipe.solver, steps=args.steps,
                       shift=pipe.shift, warmup_rounds=1, step_sync=True)
    _warn_if_not_finite(label, traj.latents)
    s = traj.stats
    compiles = None if traj.loop_compiles is None else traj.loop_compiles.lowered
    return Row(label, s.step_seconds, s.step_computed, s.wall_seconds, peak_bytes(device), compiles)


@torch.no_grad()
def run_diffusers(ref, setup: dict, args) -> Row:
    """The same trajectory through diffusers' model: 2 calls a step, CFG, the same scheduler."""
    pipe, device, shape, tensors = setup["pipe"], setup["device"], setup["shape"], setup["tensors"]
    start_peak(device)
    scheduler = make_scheduler(pipe.solver, args.steps, pipe.shift)
    g = pipe.guidance_for(None)
    context = {b: _padded_context(pipe, tensors, b, args.image, shape).to(device, DTYPE)
               for b in ("cond", "uncond")}
    t_inputs = [pipe.timestep_input(t, shape, args.image).to(device) for t in scheduler.timesteps]
    frame = pipe.first_frame(tensors, args.image)
    frame = None if frame is None else frame.to(device)

    def lincomb(terms):
        return sum(w * x.float() for w, x in terms)

    def velocity(x, t):
        x_in = x.to(DTYPE)  # what diffusers' WanPipeline feeds its transformer
        out = {b: ref(x_in, t, c, return_dict=False)[0].float() for b, c in context.items()}
        return out["uncond"] + g * (out["cond"] - out["uncond"])

    x = noise_for(shape, args.seed).to(device)
    if frame is not None:
        x[:, :, :1] = frame
    scheduler.fresh().step(0, velocity(x, t_inputs[0]), x, lincomb)  # warm-up, not timed
    sync(device)
    step_seconds = []
    began = time.perf_counter()
    for i in range(args.steps):
        step_began = time.perf_counter()
        x = scheduler.step(i, velocity(x, t_inputs[i]), x, lincomb)
        if frame is not None:
            x[:, :, :1] = frame
        sync(device)
        step_seconds.append(time.perf_counter() - step_began)
    wall = time.perf_counter() - began
    _warn_if_not_finite("diffusers", x)
    return Row("diffusers WanTransformer3DModel", step_seconds, [True] * args.steps, wall,
               peak_bytes(device))


def _padded_context(pipe, tensors, branch, image, shape) -> torch.Tensor:
    """diffusers takes the text pre-padded to text_len (ours pads inside prepare; trap T3)."""
    context = pipe.conditions(tensors, branch, image, shape)[0]["context"]
    return torch.nn.functional.pad(context, (0, 0, 0, pipe.config.text_len - context.shape[1]))


def _warn_if_not_finite(label, latents) -> None:
    if not torch.isfinite(latents).all():
        print(f"warning: {label}: the final latents are not finite (random weights); the "
              "times stand, the decisions of adaptive gates may not mean much", file=sys.stderr)


@torch.no_grad()
def one_call_error(model, ref, setup: dict, args) -> float:
    """max |ours - diffusers| / max |diffusers| of one cond call at the first timestep."""
    pipe, device, shape = setup["pipe"], setup["device"], setup["shape"]
    t = pipe.timestep_input(make_scheduler(pipe.solver, args.steps, pipe.shift).timesteps[0],
                            shape, args.image).to(device)
    x = noise_for(shape, args.seed).to(device)
    context = pipe.conditions(setup["tensors"], "cond", args.image, shape)[0]["context"]
    ours = model(x, t, context.to(device))
    theirs = ref(x.to(DTYPE), t, _padded_context(pipe, setup["tensors"], "cond", args.image, shape)
                 .to(device, DTYPE), return_dict=False)[0].float()
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


# --- report ------------------------------------------------------------------------------------

def _ms(values) -> str:
    return f"{1e3 * statistics.fmean(values):.1f}" if values else "-"


def table(rows: list[Row], steps: int) -> list[str]:
    base = next((r.wall_seconds for r in rows if r.label == "ours, no cache"), None)
    lines = ["| run | computed steps | ms/step computed | ms/step reused | ms/step (wall/steps) "
             "| wall s | speedup vs ours uncached | peak GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        computed = [s for s, c in zip(r.step_seconds, r.step_computed, strict=True) if c]
        reused = [s for s, c in zip(r.step_seconds, r.step_computed, strict=True) if not c]
        speedup = f"{base / r.wall_seconds:.2f}x" if base else "-"
        peak = "-" if r.peak_bytes is None else f"{r.peak_bytes / GiB:.1f}"
        lines.append(f"| {r.label} | {len(computed)}/{steps} ({len(computed) / steps:.0%}) | "
                     f"{_ms(computed)} | {_ms(reused)} | {1e3 * r.wall_seconds / steps:.1f} | "
                     f"{r.wall_seconds:.2f} | {speedup} | {peak} |")
    return lines


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def default_out(device: torch.device, args) -> Path | None:
    if args.tiny:
        return None
    gpu = re.sub(r"[^a-z0-9]+", "_", device_name(device).lower()).strip("_")
    return ROOT / "bench" / "results" / f"torch_wan_step_{gpu}{'_image' if args.image else ''}.md"


def header(model, setup: dict, args, check: float | None, rows: list[Row]) -> list[str]:
    pipe, device, shape = setup["pipe"], setup["device"], setup["shape"]
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        hw = (f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / GiB:.0f} GiB), "
              f"CUDA {torch.version.cuda}")
    else:
        hw = f"{device_name(device)} CPU ({torch.get_num_threads()} threads)"
    try:
        import diffusers
        versions = f"torch {torch.__version__}, diffusers {diffusers.__version__}"
    except ImportError:
        versions = f"torch {torch.__version__}"
    height, width, frames = setup["size"]
    grid = model.grid(shape)
    mode = ("TI2V image mode (per-token timesteps, first frame written back)" if args.image
            else "text mode (one timestep per call)")
    lines = [
        f"# {pipe.name}: per-step time, ours (torch {'compiled' if args.compile else 'eager'}) "
        "vs diffusers (eager)",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}",
        f"- command: `{shlex.join(['python', '-m', 'bench.gpu.torch_wan_step', *args.argv])}`",
        f"- device: {hw}; {versions}",
        f"- model: {pipe.experts[0][1]} architecture ({cfg.num_layers} blocks, dim {cfg.dim}, "
        f"ffn {cfg.ffn_dim}, {cfg.num_heads} heads), random weights (seed {args.seed}), bf16 "
        f"with fp32 islands: {params / 1e9:.2f} B parameters, {weights / GiB:.2f} GiB",
        f"- input: {height}x{width}, {frames} frames -> latent {list(shape)} -> token grid "
        f"{'x'.join(map(str, grid))} = {math.prod(grid)} image tokens, {cfg.text_len} text "
        f"tokens (cross-attention keys); batch 1, {mode}",
        f"- sampling: {args.steps} steps, {pipe.solver}, shift {pipe.shift}, CFG on (guidance "
        f"{pipe.guidance_for(None)}, 2 model calls per step); one warm-up excluded; a device "
        "sync after every step",
        f"- our ops: {', '.join(f'{k} {v}' for k, v in ops.active().items())}; diffusers: its "
        "own attention dispatch (native SDPA)",
    ]
    if check is not None:
        lines.append(f"- same weights: one model call, ours vs diffusers, max abs diff / max abs "
                     f"= {check:.2e} (bf16; ours keeps the residual stream in fp32, diffusers "
                     "in bf16)")
    compiles = [f"{r.label} {r.loop_compiles}" for r in rows if r.loop_compiles is not None]
    if compiles:
        lines.append(f"- frames compiled inside the timed loops: {', '.join(compiles)}")
    lines.append("- peak GiB: torch.cuda.max_memory_allocated over the run (warm-up included), "
                 "weights included")
    return lines


# --- main --------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--height", type=int, help=f"pixels (default {REAL_SIZE[0]}; tiny: its own)")
    ap.add_argument("--width", type=int, help=f"pixels (default {REAL_SIZE[1]}; tiny: its own)")
    ap.add_argument("--frames", type=int, help=f"4k + 1 (default {REAL_SIZE[2]}; tiny: its own)")
    ap.add_argument("--configs", default=",".join(RUNS),
                    help=f"comma-separated runs among {', '.join(RUNS)}")
    ap.add_argument("--image", action="store_true",
                    help="TI2V image mode: per-token timesteps and first-frame write-back")
    ap.add_argument("--deepcache", type=int, nargs=3, metavar=("START", "END", "INTERVAL"),
                    help="default 11/45/4 of 50 steps scaled to --steps")
    ap.add_argument("--teacache-threshold", type=float, default=TeaCacheConfig().threshold)
    ap.add_argument("--fbcache-threshold", type=float, default=FBCacheConfig().threshold)
    ap.add_argument("--compile", action="store_true",
                    help="our stages through torch.compile (compiled in the warm-up, not timed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (with --tiny)")
    ap.add_argument("--tiny", action="store_true",
                    help=f"the {TINY} pipeline instead of {REAL} (a smoke test of this script)")
    ap.add_argument("--out", type=Path, help="Markdown file to write (default bench/results/"
                    "torch_wan_step_<gpu>.md; none with --tiny)")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    runs = [r.strip() for r in args.configs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUNS]
    if unknown or not runs:
        ap.error(f"--configs {args.configs!r}: unknown run(s) {unknown}; expected a "
                 f"comma-separated list among {', '.join(RUNS)}")
    args.runs = list(dict.fromkeys(runs))
    if args.steps < 2:
        ap.error(f"--steps {args.steps}: expected at least 2 (the gate computes the first and "
                 "last steps)")
    device = torch.device(args.device)
    if device.type == "cpu" and not args.tiny:
        ap.error(f"--device cpu runs the {REAL_SIZE[0]}p {REAL} for hours; add --tiny for the "
                 "smoke test, or run on a CUDA GPU")
    if device.type not in ("cpu", "cuda"):
        ap.error(f"--device {args.device!r}: expected cuda, cuda:N or cpu")
    return args, ap


def main(argv=None) -> None:
    args, ap = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("torch_wan_step: skipped, no CUDA GPU (torch.cuda.is_available() is False)")
        return
    pipe = get_pipeline(TINY if args.tiny else REAL)
    defaults = pipe.size if args.tiny else REAL_SIZE
    size = tuple(v if v is not None else d
                 for v, d in zip((args.height, args.width, args.frames), defaults, strict=True))
    try:
        shape = pipe.latent_shape(*size)
    except ValueError as err:
        ap.error(str(err))
    setup = dict(pipe=pipe, device=device, size=size, shape=shape,
                 tensors=pipe.synthesize(shape, True, args.image, args.seed))
    model_name = pipe.experts[0][1]

    print(f"building {model_name} with random bf16 weights on {device} ...", file=sys.stderr,
          flush=True)
    model = random_bf16_model(model_name, device, args.seed)
    rows, check = [], None
    configs = cache_configs(args)
    for run in args.runs:
        label = configs[run][0] if run in configs else "diffusers"
        print(f"running {label} ...", file=sys.stderr, flush=True)
        if run == "diffusers":  # built when its turn comes: the other runs' peaks exclude it
            ref = diffusers_wan(model, device)
            check = one_call_error(model, ref, setup, args)
            rows.append(run_diffusers(ref, setup, args))
            del ref
        else:
            rows.append(run_ours(model, *configs[run], setup, args))

    lines = header(model, setup, args, check, rows) + [""] + table(rows, args.steps)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    out = args.out or default_out(device, args)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()

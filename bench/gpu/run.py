"""One prepared command for a GPU machine (one H100 or H200, minutes of device time at a time):
the JAX backend and the torch backend on CUDA at real size, beside diffusers on the same card.

    python -m bench.gpu                 # on the GPU machine: every phase, then the page
    python -m bench.gpu --tiny          # the same code on the CPU, tiny models (the test suite)
    python -m bench.gpu --plan_only     # no device: the page's plan (tokens, FLOPs, seconds)

Phases, each in its own process: importing torchax renames torch's private device, which breaks
torch.compile in the same process (commands/stage2_backend.make_backend), and a phase that
fails or hangs leaves the others' figures. Every phase writes one JSON; the page is built
from them.

- smoke (< 1 min): versions, devices, the APIs our code calls (jax.shard_map, jax.set_mesh,
  torchax), and cuDNN's fused attention against XLA's on one bf16 call. A failure stops the
  command there and prints it, so device time is not spent on an import error.
- check: the built-in trained model (wan-tiny-trained) sampled on the device and on the CPU,
  through the JAX backend and the torch backend, TeaCache on: final latents within CHECK_TOL
  (rel L2; fp32 at the highest matmul precision, no TF32), the gate's decisions identical,
  0 compiles in the JAX loop.
- jax: Wan2.2 TI2V-5B at real size, seeded random bf16 weights drawn on the device (no 10 GB
  transfer), per size uncached and cached (DeepCache 11/45/4 scaled to the steps, TeaCache),
  interleaved over rounds, warm-up excluded; compile seconds cold and warm (from the
  persistent cache, after jax.clear_caches), peak device memory.
- torch: the same sizes through our torch backend, eager and compiled, and diffusers'
  WanTransformer3DModel holding the same weights (its SDPA), interleaved in one process.
- adapter (not in the default command: `--phases smoke,adapter`, about 2 minutes): our gate
  inside diffusers' WanPipeline beside diffusers' FirstBlockCache hook (bench/gpu/adapter.py).

Writes bench/results/gpu.json and bench/results/gpu.md (with --tiny only where --out names a
folder), again after every phase, so a command cut short keeps what finished. Without a GPU
(and without --tiny) the smoke phase says so, nothing is written, and it exits 1.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu.adapter import phase_adapter  # noqa: E402
from bench.gpu.plan import (  # noqa: E402
    DEFAULT_PHASES,
    REAL,
    TINY,
    jax_plans,
    plan,
    sizes,
    torch_runs,
)

PHASES = ("smoke", "check", "jax", "torch", "adapter")
CHECK_MODEL = "wan-tiny-trained"  # the built-in trained model (sampling.pipelines.DEFAULT_PIPELINE)
CHECK_TOL = 1e-3  # rel L2 of the final latents, device against CPU (fp32, highest precision)
SEED = 0


# --- shared helpers ------------------------------------------------------------------------------

def cache_config(name: str, steps: int):
    """"none", "deepcache" (HunyuanVideo-1.5's 11/45/4 of 50 steps scaled to `steps`) or
    "teacache" (its defaults)."""
    from cache import CMConfig, DeepCacheConfig, TeaCacheConfig
    if name == "none":
        return CMConfig()
    if name == "deepcache":
        return CMConfig(deepcache=DeepCacheConfig(start=round(11 * steps / 50),
                                                  end=round(45 * steps / 50), interval=4))
    if name == "teacache":
        return CMConfig(teacache=TeaCacheConfig())
    raise ValueError(f"unknown run {name!r}; expected none, deepcache or teacache")


def trajectory_row(traj, backend, *, steps: int) -> dict:
    """What one timed trajectory of `backend` reports: per-step seconds, decisions, computed
    count, compiles, and its schedule's ideal speedup (by the blocks its reuse steps run)."""
    from sampling.run import layer_ideal
    s = traj.stats
    computed = sum(s.step_computed)
    compiles = traj.loop_compiles
    return dict(step_seconds=list(s.step_seconds), computed=list(map(bool, s.step_computed)),
                wall_s=s.wall_seconds, warmup_s=traj.warmup_seconds,
                loop_compiles=None if compiles is None else compiles.lowered,
                ideal=layer_ideal(backend.template.num_blocks, computed, steps - computed,
                                  backend.plan.fn_blocks, backend.plan.bn_blocks))


def summarise(rounds: list[dict]) -> dict:
    """A run over its rounds: the median wall and step seconds (warm-up excluded), the first
    round's warm-up (compiles) seconds, every round's decisions equal or not."""
    first = rounds[0]
    return dict(wall_s=statistics.median(r["wall_s"] for r in rounds),
                step_s=statistics.median(t for r in rounds for t in r["step_seconds"]),
                computed=sum(first["computed"]), steps=len(first["computed"]),
                decisions_stable=all(r["computed"] == first["computed"] for r in rounds),
                warmup_s=first["warmup_s"], loop_compiles=[r["loop_compiles"] for r in rounds],
                ideal=first["ideal"], rounds=len(rounds))


# --- phase: smoke --------------------------------------------------------------------------------

class SmokeError(RuntimeError):
    pass


SMOKE_IMPORTS = ("commands.stage2_backend", "sampling.run", "sampling.stages", "tpu.backend",
                 "tpu.aot_backend", "tpu.compile", "torch_backend.backend", "bench.gpu.torch_wan_step",
                 "bench.gpu.page")


def phase_smoke(args) -> dict:
    began = time.perf_counter()
    out = {"python": platform.python_version()}
    import torch
    out.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
               cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(card=props.name, capability=f"sm_{props.major}{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1))
    out["driver"] = _driver()
    import jax
    out.update(jax=jax.__version__, jax_backend=jax.default_backend(),
               jax_devices=[d.device_kind for d in jax.devices()])
    if not args.tiny and (out["jax_backend"] != "gpu" or not out["cuda_available"]):
        raise SmokeError(f"no GPU here: JAX's backend is {out['jax_backend']}, torch.cuda."
                         f"is_available() is {out['cuda_available']}; expected both on a GPU "
                         "machine (run --tiny on a CPU)")
    # the persistent compilation cache patches JAX internals (tpu.compile): one compile through it
    from tpu.compile import enable_compile_cache
    enable_compile_cache(tempfile.mkdtemp(prefix="bench-gpu-smoke-cache-"))
    jax.jit(lambda x: x + 1)(1.0).block_until_ready()
    missing = [name for name in ("shard_map", "set_mesh") if not hasattr(jax, name)]
    if missing:
        raise SmokeError(f"jax {jax.__version__} lacks {', '.join('jax.' + m for m in missing)}, "
                         "which the sequence-parallel layout calls")
    from compat.torchax_compat import import_torchax
    out["torchax"] = getattr(import_torchax(), "__version__", "unknown")
    import importlib
    for module in SMOKE_IMPORTS:  # every module the later phases import, so one missing fails here
        importlib.import_module(module)
    try:
        import diffusers
        out["diffusers"] = diffusers.__version__
    except ImportError as exc:
        out["diffusers"] = None
        out["diffusers_error"] = str(exc)
    out["fused_attention"] = _fused_attention_check() if out["jax_backend"] == "gpu" else \
        "not applicable: JAX runs on the CPU"
    out["seconds"] = time.perf_counter() - began
    return out


def _driver() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def _fused_attention_check() -> dict:
    """cuDNN's fused kernel against XLA's on one bf16 self-attention call of Wan's head shape."""
    import jax
    import jax.numpy as jnp
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 2048, 24, 128), jnp.bfloat16) for i in range(3))
    want = jax.nn.dot_product_attention(q, k, v, implementation="xla").astype(jnp.float32)
    try:
        got = jax.nn.dot_product_attention(q, k, v, implementation="cudnn").astype(jnp.float32)
        diff = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    except Exception as exc:  # noqa: BLE001 - reported; the timing phases then use XLA's
        return dict(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
    return dict(ok=diff < 2e-2, max_abs_diff_over_max=diff)


# --- phase: check (the built-in trained model, device against CPU) ------------------------------

def phase_check(args) -> dict:
    import torch

    from commands.stage2_backend import load_models, make_backend
    from sampling.fidelity import fidelity
    from sampling.pipelines import get_pipeline
    from sampling.run import make_sample, sample_once
    from sampling.run_spec import Launch
    from sampling.stages import SignalPlan

    pipe = get_pipeline(CHECK_MODEL)
    steps = 20 if args.tiny else pipe.steps  # the suite's time; on the GPU the pipeline's 50
    config = cache_config("teacache", steps)
    plan_ = SignalPlan.from_config(config)
    shape = pipe.latent_shape(*pipe.size)
    tensors = pipe.synthesize(shape, True, False, SEED)
    models = load_models(pipe, None, torch.float32)
    device = "cpu" if args.tiny else "cuda"

    def sample(backend):
        s = make_sample(backend, pipe, tensors, shape, image=False, seed=SEED)
        traj = sample_once(backend, config, s, solver=pipe.solver, steps=steps, shift=pipe.shift)
        compiles = traj.loop_compiles
        return (backend.get(traj.latents).float().cpu(), list(map(bool, traj.stats.step_computed)),
                None if compiles is None else compiles.lowered)

    import jax

    import tpu.backend  # noqa: F401 - torchax imported on jax's default device, as it always was
    runs = {}
    # JAX first: the torch backend moves the models to its device in place. The default device
    # set globally, not by the jax.default_device context, which is thread-local: the weights
    # are placed from a pool of loader threads (tpu.loading.place_all)
    for where, jax_device in (("cpu", jax.devices("cpu")[0]), (device, jax.devices()[0])):
        jax.config.update("jax_default_device", jax_device)
        with jax.default_matmul_precision("highest"):
            # stage 2's JAX backend; this phase never used the persistent compile cache
            runs[f"jax {where}"] = sample(make_backend(Launch(backend="jax", compile_cache_dir="none"),
                                                       models, plan_))
    jax.config.update("jax_default_device", None)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for where in ("cpu", device):
        runs[f"torch {where}"] = sample(make_backend(Launch(backend="torch", device=where), models,
                                                     plan_))
    out = {"model": CHECK_MODEL, "gate": "TeaCache (defaults)", "steps": steps,
           "tolerance": CHECK_TOL, "device": device}
    for backend in ("jax", "torch"):
        cpu, dev = runs[f"{backend} cpu"], runs[f"{backend} {device}"]
        out[backend] = dict(rel_l2=fidelity(dev[0], cpu[0])["rel_l2"], decisions_equal=dev[1] == cpu[1],
                            computed=sum(dev[1]), loop_compiles=dev[2])
        out[backend]["ok"] = (out[backend]["rel_l2"] <= CHECK_TOL and out[backend]["decisions_equal"]
                              and dev[2] in (None, 0))
    out["jax_vs_torch_rel_l2"] = fidelity(runs[f"jax {device}"][0], runs[f"torch {device}"][0])["rel_l2"]
    return out


# --- phase: jax (real size) ----------------------------------------------------------------------

def phase_jax(args) -> dict:
    from tpu.compile import enable_compile_cache
    cache_dir = tempfile.mkdtemp(prefix="bench-gpu-jax-cache-")
    enable_compile_cache(cache_dir)  # before torchax is imported (it compiles on import)
    import jax
    import torch

    from bench.gpu.torch_wan_step import init_std
    from modules.checkpoint import cast_model
    from modules.registry import build_model
    from sampling.pipelines import get_pipeline
    from sampling.run import make_sample, sample_once
    from sampling.stages import SignalPlan
    from tpu.aot_backend import jax_dtype
    from tpu.backend import JaxBackend

    # a subclass (weights drawn on the device), which make_backend cannot build: left as it is
    class RandomWeights(JaxBackend):
        """JaxBackend whose weights are drawn on the device from a seed (bench.gpu.torch_wan_step's
        recipe), not read from a checkpoint or the host."""

        def _weights(self, model, checkpoint=None):
            specs, stacks = self._weight_specs(model)
            params = dict(model.named_parameters())
            key, out = jax.random.key(SEED), {}
            for i, (name, spec) in enumerate(sorted(specs.items())):
                member = stacks.get(name, (name,))[0]
                mean, std = init_std(member, params[member])
                x = _normal()(jax.random.fold_in(key, i), mean, std, shape=tuple(spec.shape),
                              dtype=jax_dtype(spec.dtype))
                out[f"model.{name}"] = x if spec.sharding is None else jax.device_put(x, spec.sharding)
            return jax.block_until_ready(out)

    from tpu import attention
    attention.fused_on_gpu = not args.no_fused
    pipe = get_pipeline(TINY if args.tiny else REAL)
    model = cast_model(build_model(pipe.experts[0][1], meta=True), torch.bfloat16)
    device = jax.devices()[0]
    # the fused kernel runs only where there is a GPU: a CPU run (--tiny) reports false
    out = {"device": device.device_kind, "attention": None, "sizes": {},
           "fused_attention_on_gpu": attention.fused_on_gpu and device.platform == "gpu"}
    for label, size in sizes(args.tiny).items():
        shape = pipe.latent_shape(*size.pixels)
        tensors = pipe.synthesize(shape, True, False, SEED)
        names = ["none", *size.cached]
        configs = {name: cache_config(name, size.steps) for name in names}
        backends, samples, rows = {}, {}, {n: [] for n in names}
        began = time.perf_counter()
        for name in jax_plans(size):
            backends[name] = RandomWeights({None: model}, SignalPlan.from_config(configs[name]))
            samples[name] = make_sample(backends[name], pipe, tensors, shape, image=False, seed=SEED)
        if "none" not in backends:
            backends["none"], samples["none"] = backends["deepcache"], samples["deepcache"]
        weights_s = time.perf_counter() - began
        out["attention"] = backends["none"].attention
        for r in range(size.rounds):
            for name in names:  # interleaved: each round runs every configuration once
                traj = sample_once(backends[name], configs[name], samples[name], solver=pipe.solver,
                                   steps=size.steps, shift=pipe.shift,
                                   warmup_rounds=1 if r == 0 else 0, step_sync=True)
                rows[name].append(trajectory_row(traj, backends[name], steps=size.steps))
        runs = {name: summarise(rows[name]) for name in names}
        peak = _jax_peak(device)
        # compile from the persistent cache: the in-memory programs dropped, the same warm-up again
        jax.clear_caches()
        traj = sample_once(backends["none"], configs["none"], samples["none"], solver=pipe.solver,
                           steps=size.steps, shift=pipe.shift, warmup_rounds=1, step_sync=True)
        warm = traj.warmup_compiles
        out["sizes"][label] = dict(
            tokens=pipe.tokens(shape), steps=size.steps, weights_s=weights_s, runs=runs,
            peak_bytes=peak, warm_compile_s=traj.warmup_seconds,
            warm_compiled=None if warm is None else warm.backend - warm.cache_hits)
        save_partial(args, out)
        del backends, samples
    return out


@functools.cache
def _normal():
    """normal(key, mean, std, shape=, dtype=): mean + std * N(0, 1) of `shape` in `dtype`, drawn
    on the device (one compile per shape); built on first use, as JAX is imported in the phase."""
    import jax

    @functools.partial(jax.jit, static_argnames=("shape", "dtype"))
    def normal(key, mean, std, *, shape, dtype):
        return (mean + std * jax.random.normal(key, shape)).astype(dtype)
    return normal


def _jax_peak(device) -> int | None:
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a platform without memory stats (the CPU)
        return None
    return None if not stats else stats.get("peak_bytes_in_use")


# --- phase: torch (real size, ours eager and compiled, diffusers) ------------------------------

def phase_torch(args) -> dict:
    import torch

    from bench.gpu import torch_wan_step as tws
    from commands.stage2_backend import make_backend
    from sampling.pipelines import get_pipeline
    from sampling.run import make_sample, sample_once
    from sampling.run_spec import Launch
    from sampling.stages import SignalPlan

    pipe = get_pipeline(TINY if args.tiny else REAL)
    device = torch.device("cpu" if args.tiny else "cuda")
    model = tws.random_bf16_model(pipe.experts[0][1], device, SEED)
    try:
        ref = tws.diffusers_wan(model, device)
    except SystemExit as exc:  # diffusers missing: our runs still time
        ref, missing = None, str(exc)
    else:
        missing = None
    out = {"device": tws.device_name(device), "diffusers_missing": missing, "sizes": {}}
    for label, size in sizes(args.tiny).items():
        shape = pipe.latent_shape(*size.pixels)
        setup = dict(pipe=pipe, device=device, size=size.pixels, shape=shape,
                     tensors=pipe.synthesize(shape, True, False, SEED))
        opts = SimpleNamespace(steps=size.steps, image=False, seed=SEED)
        runs = torch_runs(size)
        rows = {f"torch {m} {c}": [] for m, c in runs}
        peaks = {}
        if ref is not None:
            rows["diffusers none"] = []
        # one backend a run, kept over the rounds: a new one would run torch.compile again
        built = {}
        for mode, name in runs:
            config = cache_config(name, size.steps)
            launch = Launch(backend="torch", device=str(device), torch_compile=mode == "compiled")
            backend = make_backend(launch, {None: model}, SignalPlan.from_config(config))
            built[mode, name] = (config, backend, make_sample(backend, pipe, setup["tensors"], shape,
                                                              image=False, seed=SEED))
        for r in range(size.rounds):
            for mode, name in runs:
                config, backend, sample = built[mode, name]
                tws.start_peak(device)
                traj = sample_once(backend, config, sample, solver=pipe.solver, steps=size.steps,
                                   shift=pipe.shift, warmup_rounds=1 if r == 0 else 0,
                                   step_sync=True)
                key = f"torch {mode} {name}"
                rows[key].append(trajectory_row(traj, backend, steps=size.steps))
                peaks[key] = tws.peak_bytes(device)
            if ref is not None:
                row = tws.run_diffusers(ref, setup, opts)
                rows["diffusers none"].append(dict(
                    step_seconds=row.step_seconds, computed=row.step_computed, wall_s=row.wall_seconds,
                    warmup_s=None, loop_compiles=None, ideal=1.0))
                peaks["diffusers none"] = row.peak_bytes
        del built
        entry = dict(tokens=pipe.tokens(shape), steps=size.steps,
                     runs={k: summarise(v) for k, v in rows.items()}, peak_bytes=peaks)
        if ref is not None:
            entry["ours_vs_diffusers_one_call"] = tws.one_call_error(model, ref, setup, opts)
        out["sizes"][label] = entry
        save_partial(args, out)
    return out


def save_partial(args, out: dict) -> None:
    """A timing phase's figures so far, after each size: a phase cut off by its time limit
    keeps the sizes it finished."""
    args.result.write_text(json.dumps(dict(out, partial=True), indent=1, default=str))


PHASE_FUNCS = {"smoke": phase_smoke, "check": phase_check, "jax": phase_jax, "torch": phase_torch,
               "adapter": phase_adapter}


# --- the command: phases in processes, then the page --------------------------------------------

def phase_timeouts(tiny: bool) -> dict[str, int]:
    """Seconds each phase may take: on the GPU its share of the 8-minute plan with room to
    spare, so the whole command stays under the device tool's 10 minutes a command; on the
    CPU (tiny) a generous bound."""
    if tiny:
        return dict.fromkeys(PHASES, 900)
    # 560 s in all: the device tool stops a command at 600 s, the wheels' install included
    return {"smoke": 50, "check": 80, "jax": 230, "torch": 200, "adapter": 400}


def run_phases(args, after_phase=lambda results: None) -> dict:
    """Every phase of args.phases in its own process; `after_phase(results)` after each one that
    followed a passed smoke phase (the page is rewritten then, so a kill keeps what finished)."""
    results = {"tiny": args.tiny, "date": time.strftime("%Y-%m-%d %H:%M %Z"), "phases": {},
               "plan": plan(args.tiny), "asked": list(args.phases)}
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",  # torch and JAX share the card
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.tiny:
        env.setdefault("JAX_PLATFORMS", "cpu")
    timeouts = phase_timeouts(args.tiny)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        for phase in args.phases:
            path = Path(tmp) / f"{phase}.json"
            argv = [sys.executable, "-m", "bench.gpu", "--phase", phase, "--result", str(path)]
            argv += ["--tiny"] if args.tiny else []
            fused = results["phases"].get("smoke", {}).get("fused_attention")
            if isinstance(fused, dict) and not fused.get("ok"):
                argv += ["--no_fused"]  # the kernel failed or disagreed on this card: XLA's
            print(f"[bench.gpu] {phase} ...", file=sys.stderr, flush=True)
            began = time.perf_counter()
            try:
                done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                                      timeout=timeouts[phase])
                failure = None if done.returncode == 0 else \
                    f"exit {done.returncode}: {(done.stderr or done.stdout)[-3000:]}"
            except subprocess.TimeoutExpired:
                failure = f"timed out after {timeouts[phase]} s"
            entry = json.loads(path.read_text()) if path.exists() else {}
            if failure is not None:
                entry["error"] = failure  # what a timed-out phase finished stays beside it
            entry["phase_s"] = time.perf_counter() - began
            results["phases"][phase] = entry
            print(f"[bench.gpu] {phase}: {'ok' if failure is None else failure.splitlines()[0]} "
                  f"({entry['phase_s']:.0f} s)", file=sys.stderr, flush=True)
            if failure is not None and phase == "smoke":
                print(failure, file=sys.stderr)
                break
            after_phase(results)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true",
                    help=f"the CPU, {TINY} for the real-size runs (what the test suite runs)")
    ap.add_argument("--phases", default=",".join(DEFAULT_PHASES),
                    help=f"comma-separated, in order, among {', '.join(PHASES)}")
    ap.add_argument("--out", type=Path, help="folder for gpu.json and gpu.md (default "
                    "bench/results; none with --tiny unless given)")
    ap.add_argument("--plan_only", action="store_true",
                    help="write the page's plan with 'not run yet', touching no device")
    ap.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--no_fused", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase:  # one phase, inside its own process
        try:
            result = PHASE_FUNCS[args.phase](args)
        except SmokeError as exc:
            print(f"smoke: {exc}", file=sys.stderr)
            return 1
        args.result.write_text(json.dumps(result, indent=1, default=str))
        return 0
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in phases if p not in PHASES]
    if unknown or not phases:
        ap.error(f"--phases {args.phases!r}: unknown {unknown}; expected a comma-separated list "
                 f"among {', '.join(PHASES)}")
    args.phases = phases
    out = args.out or (None if args.tiny else ROOT / "bench" / "results")
    from bench.gpu.page import write
    if args.plan_only:
        write(out or ROOT / "bench" / "results", None, plan(args.tiny))
        return 0
    results = run_phases(args, (lambda r: write(out, r, r["plan"])) if out is not None else
                         (lambda r: None))
    smoke = results["phases"].get("smoke", {})
    if "error" in smoke:
        print("[bench.gpu] the smoke phase failed: nothing written", file=sys.stderr)
    from bench.gpu.verdicts import under_ideal, verdicts
    print(json.dumps(verdicts(results), indent=1))
    for label in results["phases"].get("jax", {}).get("sizes", {}):
        for key, share in under_ideal(results, label):
            print(f"[bench.gpu] {label}: {key} at {share:.0%} of its schedule ideal"
                  + (" (a CPU run: --tiny times the CPU, not a GPU)" if args.tiny else ""),
                  file=sys.stderr)
    return 0 if "error" not in smoke and all(
        "error" not in p for p in results["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Presets side by side: computed fraction, wall-time speedup and fidelity against uncached, on
models whose TeaCache signals move on scales 100x apart (issue 16: the names must hold on all).

    python bench/presets.py [--steps 50] [--blocks 16] [--scales quiet,benchmark,loud]
                            [--backend jax|torch] [--plot bench/results/presets_trace.png]

Tiny-but-deep random-weight models of both families, made smooth in t (bench/workload.py) at
three settings of `SIGNAL_SCALES`, run with CFG. The reference is TeaCache at threshold 0 (it
computes every call, bit-identical to caching off, and measures the signal: `signal` is the
median per-step rel of the cond branch). For each preset (and DeepCache 11/45/4) it prints:
  calls    fraction of model calls that ran the block stack
  blocks   fraction of block evaluations the run performed (reused calls run Fn + Bn blocks)
  wall     reference loop time / the preset's loop time (a CPU figure: small programs, 2 cores)
  PSNR, rel L2, rel/disp   the final latents against the reference's; rel/disp divides the
           error by how far the reference moved from the initial noise (benchmark_workload.md)
and whether safe >= balanced >= turbo in PSNR on each model. It draws each run's per-step
change, accumulator, threshold and reused steps for the cond branch of the benchmark-scale
models into --plot (matplotlib, in requirements-dev.txt).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.workload import SIGNAL_SCALES, signal_scale, smooth_in_t  # noqa: E402
from cache import CMConfig, DeepCacheConfig, TeaCacheConfig  # noqa: E402
from cache.flags import add_cache_arguments, config_from_args  # noqa: E402
from cache.preset import PRESETS  # noqa: E402
from modules import hunyuan_video15, wan  # noqa: E402
from modules.registry import build_model  # noqa: E402
from sampling.fidelity import fidelity  # noqa: E402
from sampling.pipelines import PIPELINES  # noqa: E402
from sampling.run import make_sample, sample_once  # noqa: E402
from sampling.stages import SignalPlan  # noqa: E402

ORDERED = ("safe", "balanced", "turbo")  # most faithful first, as the names promise
REFERENCE = CMConfig(teacache=TeaCacheConfig(threshold=0.0))  # computes every call


def preset_config(name: str) -> CMConfig:
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    return config_from_args(parser.parse_args(["--preset", name]))


class _Pipeline:
    """A named tiny pipeline pointed at a deeper config of the same family."""

    def __new__(cls, name, config):
        base = PIPELINES[name]

        class Deep(type(base)):
            @property
            def config(self):
                return config

        return Deep(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})


def cases(blocks: int):
    hy = dataclasses.replace(hunyuan_video15.CONFIGS["hunyuanvideo-tiny"], num_layers=blocks,
                             hidden_size=64, num_heads=4, rope_axes=(4, 6, 6))
    wn = dataclasses.replace(wan.CONFIGS["wan-tiny-ti2v"], num_layers=blocks, dim=48, ffn_dim=96,
                             num_heads=4)
    yield "HunyuanVideo-1.5 (euler)", _Pipeline("hunyuanvideo-tiny", hy), hy
    yield "Wan2.2 TI2V (unipc)", _Pipeline("wan-tiny-ti2v", wn), wn


def blocks_fraction(traj, num_blocks, plan) -> float:
    rows = traj.gate.telemetry.trace
    run = sum(num_blocks if r["action"] == "compute" else plan.fn_blocks + plan.reuse_tail_blocks
              for r in rows)
    return run / (len(rows) * num_blocks)


def calls_fraction(traj) -> float:
    rows = traj.gate.telemetry.trace
    return sum(r["action"] == "compute" for r in rows) / len(rows)


def make_backend(kind, model, plan):
    if kind == "torch":
        from torch_backend.backend import TorchBackend
        return TorchBackend({None: model}, plan)
    from tpu.backend import JaxBackend
    return JaxBackend({None: model}, plan)


def measure(pipe, cfg, scale, runs, *, steps, backend="jax", repeats=2):
    """{run: {"traj", "calls", "blocks", "wall", fidelity...}} for one model; the reference
    under "reference" (with "signal", the median per-step rel)."""
    torch.manual_seed(0)
    model = smooth_in_t(build_model(cfg), **SIGNAL_SCALES[scale])
    shape = pipe.latent_shape(*pipe.size)
    tensors = pipe.synthesize(shape, True, False, 0)
    out, base = {}, None
    for name, config in {"reference": REFERENCE, **runs}.items():
        plan = SignalPlan.from_config(config)
        be = make_backend(backend, model, plan)
        sample = make_sample(be, pipe, tensors, shape, image=False, seed=0)
        best = None
        for _ in range(repeats):  # best of `repeats`, after warm-up
            traj = sample_once(be, config, sample, solver=pipe.solver, steps=steps,
                               shift=pipe.shift, step_sync=False, warmup_rounds=0 if best else 1)
            best = traj if best is None or traj.stats.wall_seconds < best.stats.wall_seconds else best
        latents = be.get(best.latents)
        row = {"traj": best, "calls": calls_fraction(best),
               "blocks": blocks_fraction(best, cfg.num_layers, plan)}
        if base is None:
            base = (latents, best.stats.wall_seconds, be.get(sample.noise))
            row.update(wall=1.0, signal=signal_scale(best.gate.telemetry.trace))
        else:
            row.update(wall=base[1] / best.stats.wall_seconds, **fidelity(latents, base[0], base[2]))
        out[name] = row
    return out


def measure_trained(pipe, runs, *, steps, backend="jax", prompts=12, checkpoint=None):
    """The same runs on a model trained here (issue 28, the pipeline's committed checkpoint, or
    the trained tiny model at `checkpoint` with the pipeline's sampling),
    each on `prompts` held-out prompts (bench/pareto.py's draws), pooled: PSNR and rel L2 over
    all of them against the reference's, and prompt following per attribute."""
    from bench.fixtures import analyser
    from bench.pareto_workload import FOLLOW_SEEDS, held_out_clip, prompt_tensors, shown_clip
    from modules.checkpoint import load_model
    from sampling.run import noise_for

    model = load_model(checkpoint or pipe.builtin_path)[0].eval()
    shape = pipe.latent_shape(*pipe.size)
    seeds = FOLLOW_SEEDS[:prompts]
    draws = {seed: prompt_tensors(pipe, seed) for seed in seeds}
    noise = torch.cat([noise_for(shape, seed) for seed in seeds])
    out, base = {}, None
    for name, config in {"reference": REFERENCE, **runs}.items():
        plan = SignalPlan.from_config(config)
        be = make_backend(backend, model, plan)
        latents, hits, calls, blocks, wall = [], [], [], [], 0.0
        for k, seed in enumerate(seeds):
            sample = make_sample(be, pipe, draws[seed], shape, image=False, seed=seed)
            traj = sample_once(be, config, sample, solver=pipe.solver, steps=steps,
                               shift=pipe.shift, step_sync=False, warmup_rounds=1 if k == 0 else 0)
            z = be.get(traj.latents).float()
            latents.append(z)
            hits.append(analyser.score(shown_clip(pipe, z), held_out_clip(seed)))
            calls.append(calls_fraction(traj))
            blocks.append(blocks_fraction(traj, pipe.config.num_layers, plan))
            wall += traj.stats.wall_seconds
        latents = torch.cat(latents)
        row = {"traj": traj, "calls": sum(calls) / len(calls), "blocks": sum(blocks) / len(blocks),
               **{a: sum(h[a] for h in hits) / len(hits) for a in analyser.ATTRIBUTES}}
        if base is None:
            base = (latents, wall)
            row.update(wall=1.0, signal=signal_scale(traj.gate.telemetry.trace))
        else:
            row.update(wall=base[1] / wall, **fidelity(latents, base[0], noise))
        out[name] = row
    return out


def in_order(results) -> bool:
    """safe >= balanced >= turbo in PSNR (the names' promise)."""
    psnr = [results[p]["psnr_db"] for p in ORDERED]
    return all(a >= b for a, b in zip(psnr, psnr[1:], strict=False))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--scales", default=",".join(SIGNAL_SCALES),
                    help=f"comma-separated among {', '.join(SIGNAL_SCALES)}")
    ap.add_argument("--backend", choices=("jax", "torch"), default="jax")
    ap.add_argument("--weights", choices=("random", "trained"), default="random",
                    help="trained: the tiny models trained here (issue 28), each run pooled over "
                         "--prompts held-out prompts, with prompt following")
    ap.add_argument("--prompts", type=int, default=12, help="held-out prompts (trained weights)")
    ap.add_argument("--checkpoint", help="trained weights: a trained tiny model of one family in "
                    "place of its committed one (the further held-out model, or one trained "
                    "elsewhere)")
    ap.add_argument("--plot", default="bench/results/presets_trace.png",
                    help="PNG path for the per-step trace plot ('' for none)")
    args = ap.parse_args()
    if args.backend == "torch":
        torch.set_num_threads(1)  # 2 shared cores: more threads spin-wait under contention
    runs = {**{p: preset_config(p) for p in PRESETS},
            "deepcache 11/45/4": CMConfig(deepcache=DeepCacheConfig())}
    if args.checkpoint is not None and (args.weights != "trained"
                                        or not os.path.exists(args.checkpoint)):
        ap.error(f"--checkpoint {args.checkpoint}: expected an existing trained model's folder, "
                 "with --weights trained")
    if args.weights == "trained":
        return main_trained(args, runs)
    traces, verdicts = {}, []
    print(f"init: smooth in t (bench/workload.py), signal scales {args.scales}, seed 0; CFG on; "
          f"fp32; {args.backend} backend on CPU")
    for title, pipe, cfg in cases(args.blocks):
        for scale in args.scales.split(","):
            results = measure(pipe, cfg, scale, runs, steps=args.steps, backend=args.backend)
            ref = results["reference"]
            shape = pipe.latent_shape(*pipe.size)
            print(f"\n{title}, {scale} ({SIGNAL_SCALES[scale]}): {args.blocks} blocks, latent "
                  f"{list(shape)} ({pipe.tokens(shape)} tokens), {args.steps} steps; signal: "
                  f"median TeaCache rel {ref['signal']:.2e} per step")
            print(f"{'run':20s} {'calls':>6s} {'blocks':>7s} {'wall':>6s} {'PSNR dB':>8s} "
                  f"{'rel L2':>9s} {'rel/disp':>9s}")
            print(f"{'reference':20s} {1.0:6.3f} {1.0:7.3f} {1.0:5.2f}x {'-':>8s} {'-':>9s} {'-':>9s}")
            for name in runs:
                r = results[name]
                print(f"{name:20s} {r['calls']:6.3f} {r['blocks']:7.3f} {r['wall']:5.2f}x "
                      f"{r['psnr_db']:8.1f} {r['rel_l2']:9.2e} {r['rel_to_displacement']:9.2e}")
                if scale == "benchmark":
                    traces[(title, name)] = r["traj"].gate.telemetry.trace
            verdicts.append((f"{title}, {scale}", ref["signal"], in_order(results),
                             [results[p]["psnr_db"] for p in ORDERED]))
    print("\nsafe >= balanced >= turbo in PSNR:")
    for model, signal, ok, psnr in verdicts:
        print(f"  {model:38s} signal {signal:.1e}  {'yes' if ok else 'NO '}  "
              + " >= ".join(f"{v:.1f}" for v in psnr))
    if args.plot and traces:
        from sampling.sinks import plot_traces
        print(f"plot: {plot_traces({f'{t}: {n}': rows for (t, n), rows in traces.items()}, args.plot)}")


def main_trained(args, runs):
    from bench.fixtures.analyser import ATTRIBUTES
    from bench.pareto_workload import trained_families
    print(f"weights: trained here (issue 28), {args.prompts} held-out prompts per run, pooled; "
          f"CFG on; fp32; {args.backend} backend on CPU")
    verdicts = []
    for family in trained_families(args.checkpoint).values():  # --checkpoint: its family only
        name, pipe = family.pipeline, PIPELINES[family.pipeline]
        results = measure_trained(pipe, runs, steps=args.steps, backend=args.backend,
                                  prompts=args.prompts, checkpoint=family.checkpoint)
        ref = results["reference"]
        print(f"\n{name} ({args.checkpoint or pipe.builtin}): {pipe.config.num_layers} blocks, "
              f"{args.steps} steps "
              f"{pipe.solver}; signal: median TeaCache rel {ref['signal']:.2e} per step")
        print(f"{'run':20s} {'calls':>6s} {'blocks':>7s} {'wall':>6s} {'PSNR dB':>8s} "
              f"{'rel L2':>9s}  prompt following ({', '.join(ATTRIBUTES)})")
        for key in ("reference", *runs):
            r = results[key]
            fid = ("       -         -" if key == "reference"
                   else f"{r['psnr_db']:8.1f} {r['rel_l2']:9.2e}")
            print(f"{key:20s} {r['calls']:6.3f} {r['blocks']:7.3f} {r['wall']:5.2f}x {fid}  "
                  + " ".join(f"{r[a]:4.0%}" for a in ATTRIBUTES))
        verdicts.append((name, ref["signal"], in_order(results),
                         [results[p]["psnr_db"] for p in ORDERED]))
    print("\nsafe >= balanced >= turbo in PSNR:")
    for model, signal, ok, psnr in verdicts:
        print(f"  {model:38s} signal {signal:.1e}  {'yes' if ok else 'NO '}  "
              + " >= ".join(f"{v:.1f}" for v in psnr))


if __name__ == "__main__":
    main()

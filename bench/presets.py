"""Presets side by side: computed-block fraction, wall-time speedup and fidelity against uncached.

    python bench/presets.py [--steps 50] [--blocks 16] [--plot bench/results/presets_trace.png]

Tiny-but-deep random-weight models of both families, made smooth in t (bench/workload.py), run
on the JAX backend with CFG. For each preset (and DeepCache 11/45/4 for reference) it prints:
  blocks   fraction of block evaluations the run performed (reused calls run Fn + Bn blocks)
  wall     uncached loop time / the preset's loop time (a CPU figure: small programs, 2 cores)
  PSNR, rel L2, rel/disp   the final latents against the uncached run's; rel/disp divides the
           error by how far the uncached run moved from the initial noise (benchmark_workload.md)
It draws each run's per-step change, accumulator and reused steps for the cond branch into
--plot (default bench/results/presets_trace.png; matplotlib, in requirements-dev.txt).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.workload import smooth_in_t  # noqa: E402
from cache import CMConfig, DeepCacheConfig  # noqa: E402
from cache.flags import add_cache_arguments, config_from_args  # noqa: E402
from cache.preset import PRESETS  # noqa: E402
from modules import hunyuan_video15, wan  # noqa: E402
from modules.registry import build_model  # noqa: E402
from sampling.fidelity import fidelity  # noqa: E402
from sampling.pipelines import PIPELINES  # noqa: E402
from sampling.run import make_sample, sample_once  # noqa: E402
from sampling.sinks import plot_traces  # noqa: E402
from sampling.stages import SignalPlan  # noqa: E402
from tpu.backend import JaxBackend  # noqa: E402


def preset_config(name: str) -> CMConfig:
    import argparse as ap
    parser = ap.ArgumentParser()
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--plot", default="bench/results/presets_trace.png",
                    help="PNG path for the per-step trace plot ('' for none)")
    args = ap.parse_args()
    runs = {**{p: preset_config(p) for p in PRESETS},
            "deepcache 11/45/4": CMConfig(deepcache=DeepCacheConfig())}
    traces = {}
    print("init: smooth in t (bench/workload.py: low-pass period 300 timesteps, modulation x3), "
          "seed 0; CFG on; fp32; JAX backend on CPU")
    for title, pipe, cfg in cases(args.blocks):
        torch.manual_seed(0)
        model = smooth_in_t(build_model(cfg))
        shape = pipe.latent_shape(*pipe.size)
        tensors = pipe.synthesize(shape, True, False, 0)
        print(f"\n{title}: {args.blocks} blocks, latent {list(shape)} "
              f"({pipe.tokens(shape)} tokens), {args.steps} steps")
        print(f"{'run':20s} {'blocks':>7s} {'wall':>6s} {'PSNR dB':>8s} {'rel L2':>9s} {'rel/disp':>9s}")
        base = None
        for name, config in {"uncached": CMConfig(), **runs}.items():
            plan = SignalPlan.from_config(config)
            backend = JaxBackend({None: model}, plan)
            sample = make_sample(backend, pipe, tensors, shape, image=False, seed=0)
            best = None
            for _ in range(2):  # best of two, after warm-up
                traj = sample_once(backend, config, sample, solver=pipe.solver, steps=args.steps,
                                   shift=pipe.shift, step_sync=False,
                                   warmup_rounds=0 if best else 1)
                best = traj if best is None or traj.stats.wall_seconds < best.stats.wall_seconds else best
            latents = backend.get(best.latents)
            if base is None:
                base = (latents, best.stats.wall_seconds, backend.get(sample.noise))
                print(f"{name:20s} {1.0:7.3f} {1.0:5.2f}x {'-':>8s} {'-':>9s} {'-':>9s}")
                continue
            f = fidelity(latents, base[0], base[2])
            print(f"{name:20s} {blocks_fraction(best, cfg.num_layers, plan):7.3f} "
                  f"{base[1] / best.stats.wall_seconds:5.2f}x {f['psnr_db']:8.1f} "
                  f"{f['rel_l2']:9.2e} {f['rel_to_displacement']:9.2e}")
            traces[(title, name)] = best.gate.telemetry.trace
    if args.plot:
        print(f"plot: {plot_traces({f'{t}: {n}': rows for (t, n), rows in traces.items()}, args.plot)}")


if __name__ == "__main__":
    main()

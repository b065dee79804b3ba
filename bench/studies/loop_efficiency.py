"""Loop efficiency of the JAX backend: DeepCache 11/45/4 on a tiny-but-deep HunyuanVideo-1.5.

    python -m bench.studies.loop_efficiency [--hidden 64] [--tokens-hw 8 10] [--repeats 3]

Prints, for 54 double-stream blocks (the real depth) at a small width:
  measured speedup  = uncached loop wall time / cached loop wall time (same inputs, CFG 6.0)
  ideal speedup     = the same ratio from a program-only replay of the same 50 steps (both
                      branches of probe, middle + residual sub or residual add, tail, issued
                      back to back as the loop does; no gate, scheduler, CFG combination)
  loop efficiency   = measured / ideal (what the Python loop, the gate and the host lose)
  layer-count ideal = 55 x 50 / (25 x 55 + 25 x 2) = 1.93x, the figure seed 003 compares with.
Loops and replays run without per-step syncs (one at the end), after warm-up, interleaved;
best of --repeats each.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import torch  # noqa: E402

from cache import CMConfig, DeepCacheConfig  # noqa: E402
from commands.stage2_backend import make_backend  # noqa: E402
from modules.hunyuan_video15 import CONFIGS  # noqa: E402
from modules.registry import build_model  # noqa: E402
from sampling.pipelines import PIPELINES  # noqa: E402
from sampling.run import (  # noqa: E402
    layer_ideal,  # noqa: E402
    make_sample,
    sample_once,
)
from sampling.run_spec import Launch  # noqa: E402
from sampling.stages import SignalPlan  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--tokens-hw", type=int, nargs=2, default=(8, 10), metavar=("H", "W"))
    ap.add_argument("--frames", type=int, default=3, help="latent frames")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    cfg = dataclasses.replace(CONFIGS["hunyuanvideo-tiny"], num_layers=54, hidden_size=args.hidden,
                              num_heads=args.hidden // 16, rope_axes=(4, 6, 6))
    torch.manual_seed(0)
    model = build_model(cfg)
    pipe = dataclasses.replace(PIPELINES["hunyuanvideo-tiny"], experts=((None, "bench"),))
    pipe = _with_config(pipe, cfg)
    h, w = args.tokens_hw
    shape = (1, cfg.in_channels, args.frames, h, w)
    tensors = pipe.synthesize(shape, True, False, seed=0)
    dc = CMConfig(deepcache=DeepCacheConfig(start=11, end=45, interval=4))
    plan = SignalPlan.from_config(dc)
    # stage 2's JAX backend, without the persistent compile cache (as this bench always ran)
    backend = make_backend(Launch(backend="jax", compile_cache_dir="none"), {None: model}, plan)
    sample = make_sample(backend, pipe, tensors, shape, image=False, seed=0)
    common = dict(solver="euler", steps=args.steps, shift=5.0, step_sync=False)

    sample_once(backend, dc, sample, **common)  # warm-up: compiles every program
    plan_steps = sample_once(backend, dc, sample, warmup_rounds=0, **common).stats.step_computed

    # Program-only replay of the same step sequence: both CFG branches issued back to back as
    # the loop does, each step depending on the last; no gate, scheduler, CFG combination or
    # per-step Python beyond the calls themselves.
    t = backend.put(torch.tensor([500.0]))
    conds = sample.conds["cond"]
    hidden, ctx, _, _ = backend.probe(None, sample.noise, t, conds, None)
    residual = backend.ops.sub(backend.middle(None, hidden, ctx), hidden)

    def call(x, computes, uncached):
        h, c, _, _ = backend.probe(None, x, t, conds, None)
        if not computes:
            return backend.tail(None, backend.ops.add(h, residual), c)
        after = backend.middle(None, h, c)
        if not uncached:
            backend.ops.sub(after, h)  # the residual a computed step stores
        return backend.tail(None, after, c)

    def replay(steps, uncached):
        x = sample.noise
        t0 = time.perf_counter()
        for computes in steps:
            call(x, computes, uncached)  # cond and uncond read the same latent
            x = call(x, computes, uncached)
        jax.block_until_ready(x)
        return time.perf_counter() - t0

    runs = {k: [] for k in ("uncached", "deepcache", "replay_uncached", "replay_deepcache")}
    trajs = {}
    for _ in range(args.repeats):  # interleaved, best of each: this machine is noisy
        for name, config in (("uncached", CMConfig()), ("deepcache", dc)):
            trajs[name] = sample_once(backend, config, sample, warmup_rounds=0, **common)
            runs[name].append(trajs[name].stats.wall_seconds)
        runs["replay_uncached"].append(replay([True] * args.steps, uncached=True))
        runs["replay_deepcache"].append(replay(plan_steps, uncached=False))
    best = {k: min(v) for k, v in runs.items()}
    computed = sum(plan_steps)
    reused = len(plan_steps) - computed
    ideal = best["replay_uncached"] / best["replay_deepcache"]
    measured = best["uncached"] / best["deepcache"]
    prog = {"uncached": best["replay_uncached"] / args.steps,
            "deepcache": best["replay_deepcache"] / args.steps}
    loop_compiles = trajs["deepcache"].loop_compiles

    print(f"device: {jax.devices()[0].device_kind} ({os.cpu_count()} cpus), jax {jax.__version__}")
    print(f"model: HunyuanVideo-1.5 shape, 54 double blocks, hidden {cfg.hidden_size}, "
          f"{cfg.num_heads} heads; {args.frames}x{h}x{w} = {args.frames * h * w} image tokens + "
          f"{cfg.context_len} context; CFG on (2 calls/step); {args.steps} euler steps; fp32")
    print("program-only replay, ms/step: " + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in prog.items()))
    print(f"loop, ms/step: uncached {1e3 * best['uncached'] / args.steps:.2f}, deepcache "
          f"{1e3 * best['deepcache'] / args.steps:.2f}")
    print(f"schedule: DeepCache 11/45/4 -> {computed} computed, {reused} reused steps; "
          f"loop compiles: {loop_compiles.lowered}")
    print(f"loop wall (best of {args.repeats}): uncached {best['uncached']:.3f} s, "
          f"deepcache {best['deepcache']:.3f} s")
    print(f"measured speedup   {measured:.3f}x")
    print(f"ideal (programs)   {ideal:.3f}x")
    print(f"loop efficiency    {measured / ideal:.3f}   (target >= 0.98)")
    print(f"layer-count ideal  {layer_ideal(54, computed, reused, 0, 1):.3f}x")


def _with_config(pipe, cfg):
    """The tiny pipeline, pointed at an unregistered config (the bench's own width)."""

    class BenchPipeline(type(pipe)):
        @property
        def config(self):
            return cfg

    return BenchPipeline(**{f.name: getattr(pipe, f.name) for f in dataclasses.fields(pipe)})


if __name__ == "__main__":
    main()

"""Sequence parallel on emulated CPU devices: per-step time, cache speedup and collectives.

    python -m bench.studies.sp_scaling [--steps 24] [--blocks 12] [--frames 9]
        [--out bench/results/sp_scaling.md]

A tiny-but-deep HunyuanVideo-1.5 (`HIDDEN`, `HEADS`) runs uncached and with DeepCache at
sp = 1, 2, 4, 8 on `DEVICES` emulated CPU devices (XLA_FLAGS set here, before jax starts). It prints the
loop time per step, the cache speedup at each sp, and the collectives one full and one cached
call hold (counted in the compiled programs). An honest caveat: emulated devices share this
machine's cores, so sp > 1 cannot be faster here; the figure that carries over is how much of
the cache speedup survives the extra collectives (peers.md: one peer fell from 2.84x to 1.93x).
Writes the page (`--out`): the command, the machine, jax's version, the date, and the table.
"""

from __future__ import annotations

import os
import sys

DEVICES = 8  # emulated CPU devices
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402

import torch  # noqa: E402

from bench.page import command_line, machine, write_page  # noqa: E402
from bench.studies.presets import deeper_pipeline  # noqa: E402
from cache import CMConfig, DeepCacheConfig  # noqa: E402
from commands.stage2_backend import make_backend  # noqa: E402
from modules import hunyuan_video15  # noqa: E402
from modules.registry import build_model  # noqa: E402
from sampling.run import make_sample, sample_once  # noqa: E402
from sampling.run_spec import Launch  # noqa: E402
from sampling.stages import SignalPlan  # noqa: E402
from sharding.jax_sp import SIGNAL_PSUMS_PER_PROBE  # noqa: E402
from tests.sp_jax_check import collectives  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "sp_scaling.md")
DEFAULTS = {"steps": 24, "blocks": 12, "frames": 9}
HIDDEN, HEADS = 64, 8  # the tiny-deep model's width and attention heads
# the cached run's DeepCache: computed from step DEEPCACHE_START every DEEPCACHE_INTERVAL steps,
# up to DEEPCACHE_END_BEFORE steps before the last
DEEPCACHE_START, DEEPCACHE_INTERVAL, DEEPCACHE_END_BEFORE = 2, 3, 2
# the cached runs here are DeepCache, which reads no signals, so the signal psum is the
# layout's stated count (sharding.jax_sp, checked against the traced count by its test)
FOOTER = (f"(a step is two calls with CFG; the probe's signal reduction is {SIGNAL_PSUMS_PER_PROBE} "
          "of these when the gate reads signals; DeepCache reads none)")


def per_call_collectives(backend, sample, pipe, shape):
    conds = next(iter(sample.conds.values()))
    t = backend.put(pipe.timestep_input(999.0, shape, False))
    w = backend._weights_of
    hidden, ctx, _, _ = backend.probe(None, sample.noise, t, conds, None)
    args = {"probe": (w["probe"][None], sample.noise, t, *backend.rope, backend.zero_reference,
                      sample.noise, *(conds[n] for n in backend.cond_names)),
            "middle": (w["middle"][None], hidden, ctx), "tail": (w["tail"][None], hidden, ctx)}
    counts = {k: sum(collectives(p.lower(*args[k]).compile().as_text()).values())
              for k, p in backend.programs().items() if k in args}
    return counts["probe"] + counts["middle"] + counts["tail"], counts["probe"] + counts["tail"]


def title(cfg, shape, tokens: int, steps: int, deepcache: DeepCacheConfig) -> str:
    """The table's title, from the model config, latent shape and DeepCache config the bench runs."""
    return (f"HunyuanVideo-1.5 tiny-deep: {cfg.num_layers} blocks, hidden {cfg.hidden_size}, "
            f"{cfg.num_heads} heads, latent {list(shape)} ({tokens} tokens), {steps} Euler steps, CFG, "
            f"fp32; DeepCache start {deepcache.start} end {deepcache.end} interval {deepcache.interval}; "
            f"{DEVICES} emulated CPU devices")


def table_header() -> str:
    return (f"{'sp':>3s} {'uncached ms/step':>17s} {'cached ms/step':>15s} {'cache speedup':>14s} "
            f"{'collectives full/cached call':>29s}")


def table_row(r: dict) -> str:
    """r: sp, uncached and cached seconds per step, collectives in a full and a cached call."""
    return (f"{r['sp']:3d} {1000 * r['uncached']:17.1f} {1000 * r['cached']:15.1f} "
            f"{r['uncached'] / r['cached']:13.2f}x {r['full']:>17d} / {r['cached_call']:<d}")


def command(args) -> str:
    return command_line("bench.studies.sp_scaling", args, DEFAULTS)


def page(title: str, rows: list[dict], cmd: str) -> list[str]:
    """The results page; the machine and the date are this run's, so the page says where it was
    measured without a typed line."""
    import jax

    return [
        "# bench/studies/sp_scaling.py", "",
        f"Command: `{cmd}`. Machine: {machine()}; {jax.device_count()} emulated CPU devices "
        f"({os.environ['XLA_FLAGS']}), jax {jax.__version__}, measured "
        f"{datetime.date.today().isoformat()}. Emulated devices share this machine's cores, so sp > 1 "
        "cannot be faster here; what carries over is how much of the cache speedup survives the "
        "collectives, and how many collectives a full and a cached call hold.", "",
        "```", title, table_header(), *(table_row(r) for r in rows), FOOTER, "```",
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    ap.add_argument("--blocks", type=int, default=DEFAULTS["blocks"])
    ap.add_argument("--frames", type=int, default=DEFAULTS["frames"],
                    help="video frames (latent frames = (f-1)/4+1)")
    ap.add_argument("--out", default=OUT, help="the results page to write")
    args = ap.parse_args(argv)
    cfg = dataclasses.replace(hunyuan_video15.CONFIGS["hunyuanvideo-tiny"], num_layers=args.blocks,
                              hidden_size=HIDDEN, num_heads=HEADS, rope_axes=(2, 2, 4))
    pipe = deeper_pipeline("hunyuanvideo-tiny", cfg)
    torch.manual_seed(0)
    model = build_model(cfg)
    shape = pipe.latent_shape(128, 160, args.frames)
    tensors = pipe.synthesize(shape, True, False, 0)
    cached = CMConfig(deepcache=DeepCacheConfig(start=DEEPCACHE_START,
                                                end=args.steps - DEEPCACHE_END_BEFORE,
                                                interval=DEEPCACHE_INTERVAL))
    heading = title(cfg, shape, pipe.tokens(shape), args.steps, cached.deepcache)
    print(heading)
    print(table_header())
    rows = []
    for sp in (1, 2, 4, 8):
        # stage 2's JAX backend at --sp_size sp (mesh: sharding.jax_sp.make_mesh(sp, 1), none at
        # sp 1), without the persistent compile cache, as this bench always ran
        launch = Launch(backend="jax", sp_size=sp, compile_cache_dir="none")
        times, counts = {}, None
        for name, config in (("uncached", CMConfig()), ("cached", cached)):
            backend = make_backend(launch, {None: model}, SignalPlan.from_config(cached))
            sample = make_sample(backend, pipe, tensors, shape, image=False, seed=0)
            # step_sync: with async dispatch, programs with collectives in flight at once
            # deadlocked XLA's CPU rendezvous at sp=8 on this 2-core machine (emulation only)
            best = min((sample_once(backend, config, sample, solver=pipe.solver, steps=args.steps,
                                    shift=pipe.shift, warmup_rounds=1 if r == 0 else 0,
                                    step_sync=True).stats.wall_seconds for r in range(2)))
            times[name] = best / args.steps
            if counts is None:
                counts = per_call_collectives(backend, sample, pipe, shape)
        rows.append({"sp": sp, **times, "full": counts[0], "cached_call": counts[1]})
        print(table_row(rows[-1]), flush=True)
    print(FOOTER)
    write_page(args.out, page(heading, rows, command(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

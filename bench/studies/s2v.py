"""Wan2.2 S2V: computed fraction and fidelity of TeaCache and FBCache, the audio guard on and off.

    python -m bench.studies.s2v [--steps 40] [--blocks 16] [--clips 3] [--out bench/results/s2v.md]

A tiny-but-deep random-weight S2V model (the wan-tiny-s2v layout, 16 blocks of dim 48, audio
injected after blocks 0, 4, 8, 12 and 15), made smooth in t (bench/workload.py), samples 3 clips
of 16 frames clip by clip (sampling/clips.py) with CFG 4.5 and UniPC shift 3, on the torch
backend (eager CPU; the JAX backend takes the same decisions, tests/test_s2v_sampling.py). Two
scenarios, each against its own uncached run:

  official  each clip's speech is fixed while it is sampled (the official pipeline): the guard
            has nothing to see, and must cost nothing;
  revised   clip 1's speech is replaced by other speech at step 16 (a streaming front end revising
            it mid-trajectory): without the guard a reuse may span the change, with it
            (`--ctrl_guard 0.05`) both branches compute at that step.

Per run: computed = fraction of block evaluations run (a reuse runs the probe's Fn and tail's Bn
blocks), calls = fraction of model calls computed, PSNR / rel L2 / rel-to-displacement of all
clips' latents against the uncached run's, and `at change` = what the conditional branch did at
the revised step. TeaCache reads block 0's segmented modulated input (noisy tokens), FBCache
block 0's residual against the last computed one (`residual_tensor_rel_l1`, probe Fn = 1).
Prints the table and writes it to --out with the machine and command.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.studies.presets import blocks_fraction, deeper_pipeline  # noqa: E402
from bench.workload import smooth_in_t  # noqa: E402
from cache import CMConfig, FBCacheConfig, TeaCacheConfig  # noqa: E402
from commands.stage2_backend import make_backend  # noqa: E402
from modules import wan_s2v  # noqa: E402
from modules.registry import build_model  # noqa: E402
from sampling.clips import sample_clips  # noqa: E402
from sampling.fidelity import fidelity  # noqa: E402
from sampling.journal import atomic_write  # noqa: E402
from sampling.run import noise_for  # noqa: E402
from sampling.run_spec import Launch  # noqa: E402
from sampling.stages import SignalPlan  # noqa: E402

GUARD = 0.05  # relative L1 change of a clip's audio features that forces a compute
REVISED_CLIP, REVISED_STEP = 1, 16
_TENSOR = "residual_tensor_rel_l1"  # block 0's residual against the last computed one
METHODS = {  # thresholds spanning this workload's range (its per-step TeaCache rel is ~1e-3)
    "TeaCache 0.005": dict(teacache=TeaCacheConfig(threshold=0.005)),
    "TeaCache 0.01": dict(teacache=TeaCacheConfig(threshold=0.01)),
    "TeaCache 0.02": dict(teacache=TeaCacheConfig(threshold=0.02)),
    "FBCache 0.03": dict(fbcache=FBCacheConfig(metric=_TENSOR, threshold=0.03)),
    "FBCache 0.06": dict(fbcache=FBCacheConfig(metric=_TENSOR, threshold=0.06)),
    "FBCache 0.12": dict(fbcache=FBCacheConfig(metric=_TENSOR, threshold=0.12)),
}


def workload(blocks: int, clips: int):
    cfg = dataclasses.replace(wan_s2v.CONFIGS["wan-tiny-s2v"], num_layers=blocks, dim=48,
                              ffn_dim=96, num_heads=4,
                              audio_inject_layers=(*range(0, blocks - 1, 4), blocks - 1))
    pipe = deeper_pipeline("wan-tiny-s2v", cfg)
    torch.manual_seed(0)
    model = smooth_in_t(build_model(cfg))
    shape = pipe.latent_shape(*pipe.size)
    tensors = pipe.synthesize(shape, True, False, 0)
    per_clip = shape[2] * pipe.vae_stride[0]
    tensors["audio_embeds"] = tensors["audio_embeds"][..., : clips * per_clip]
    # the revision: other speech of the same statistics (seeded), the whole clip window
    other = torch.randn(tensors["audio_embeds"][..., :per_clip].shape,
                        generator=torch.Generator().manual_seed(7))
    return cfg, pipe, model, shape, tensors, {REVISED_CLIP: {REVISED_STEP: other}}


def run(model, pipe, shape, tensors, config, steps, updates):
    backend = make_backend(Launch(backend="torch", device="cpu"), {None: model},
                           SignalPlan.from_config(config))
    began = time.perf_counter()
    clips = sample_clips(backend, config, pipe, tensors, shape, seed=0, solver=pipe.solver,
                         steps=steps, shift=pipe.shift, audio_updates=updates)
    return clips, time.perf_counter() - began


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--clips", type=int, default=3)
    ap.add_argument("--out", default="bench/results/s2v.md", help="markdown table ('' for none)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg, pipe, model, shape, tensors, revision = workload(args.blocks, args.clips)
    noise = torch.cat([noise_for(shape, c) for c in range(args.clips)], dim=2)
    head = (f"Wan2.2 S2V tiny-deep: {cfg.num_layers} blocks, dim {cfg.dim}, audio after blocks "
            f"{list(cfg.audio_inject_layers)}; {args.clips} clips of {shape[2]} latent frames "
            f"({pipe.tokens(shape)} noisy + {model.sequence_length(model.grid(shape)) - pipe.tokens(shape)}"
            f" reference/motion tokens), {args.steps} steps {pipe.solver} shift {pipe.shift}, CFG "
            f"{pipe.guidance}; init smooth in t (bench/workload.py), seed 0; torch eager on "
            f"{platform.processor() or platform.machine()}, 1 thread")
    lines = [head, "",
             "| scenario | method | guard | computed | calls | PSNR dB | rel L2 | rel/disp | at change |",
             "|---|---|---|---|---|---|---|---|---|"]
    print(head)
    for scenario, updates in (("official", None), ("revised", revision)):
        base, seconds = run(model, pipe, shape, tensors, CMConfig(), args.steps, updates)
        print(f"\n{scenario}: uncached {seconds:.1f} s")
        for method, fields in METHODS.items():
            for guard in (0.0, GUARD):
                config = CMConfig(**fields, ctrl_guard=guard)
                clips, seconds = run(model, pipe, shape, tensors, config, args.steps, updates)
                merged = clips.merged()
                rows = merged.gate.telemetry.trace
                plan = SignalPlan.from_config(config)
                computed = blocks_fraction(merged, cfg.num_layers, plan)
                calls = sum(r["action"] == "compute" for r in rows) / len(rows)
                f = fidelity(clips.latents, base.latents, noise)
                at = "-"
                if updates:
                    at = next(r["action"] + (f" ({r['reason']})" if r["action"] == "compute" else "")
                              for r in rows if r["clip"] == REVISED_CLIP
                              and r["step"] == REVISED_STEP and r["branch"] == "cond")
                row = (f"| {scenario} | {method} | {'on' if guard else 'off'} | {computed:.3f} | "
                       f"{calls:.3f} | {f['psnr_db']:.1f} | {f['rel_l2']:.2e} | "
                       f"{f['rel_to_displacement']:.2e} | {at} |")
                print(row)
                lines.append(row)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        text = ("# Wan2.2 S2V: caching with the audio guard on and off\n\n"
                f"`python -m bench.studies.s2v --steps {args.steps} --blocks {args.blocks} --clips "
                f"{args.clips}` ({time.strftime('%Y-%m-%d')})\n\n" + "\n".join(lines) + "\n")
        atomic_write(args.out, lambda f: f.write(text))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

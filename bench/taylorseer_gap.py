"""Trained weights (issue 28): our fixed-interval reuse against diffusers' TaylorSeer, step for step.

    python bench/taylorseer_gap.py [--prompts 12] [--intervals 2,3]

On the trained tiny Wan (assets/tiny-wan-ti2v), held-out prompts pooled (bench/pareto.py's
trained regime): diffusers' TaylorSeer (order 1: every block's attention and FFN outputs
extrapolated, and the current step's modulation applied to them) against our DeepCache schedule
at the same interval, no tail block, with the whole middle residual reused (forecast 0) or
extrapolated linearly (1) or quadratically (2), each plain and remodulated (the residual kept
split by the time gates the blocks share and rebuilt with each step's own gates, each part
forecast as the order says: `--remodulate`, which is TaylorSeer's own form). Two phases of the
schedule: start 1 computes the steps TaylorSeer computes (0, then every interval-th from 1, the
last step included), start 3 others (the last step reused at interval 3). Prints the computed
fraction, the pooled PSNR against the same implementation's uncached run, and held-out
direction and shape accuracy.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import pareto_peers as peers  # noqa: E402
from bench import pareto_workload as pw
from cache import CMConfig, DeepCacheConfig  # noqa: E402
from sampling.fidelity import fidelity  # noqa: E402
from sampling.run import noise_for  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--intervals", default="2,3", help="comma-separated DeepCache intervals")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from diffusers.hooks import TaylorSeerCacheConfig

    wl = pw.build_workload(pw.trained_families()["wan"], 50)
    seeds = pw.FOLLOW_SEEDS[:args.prompts]
    counter = pw.our_counter(wl)
    noise = torch.cat([noise_for(wl.shape, s) for s in seeds])
    ours_base = pw.over_prompts(wl, lambda w: pw.run_ours(w, CMConfig(), counter), seeds)
    their_base = pw.over_prompts(wl, peers.run_diffusers, seeds)

    def show(name, run, base):
        f = fidelity(run.latents, base.latents, noise)
        print(f"{name:42s} computed {run.fraction:.3f}  PSNR {f['psnr_db']:5.1f} dB  direction "
              f"{run.follow['direction']:.0%}  shape {run.follow['shape']:.0%}", flush=True)

    for iv in (int(v) for v in args.intervals.split(",")):
        hook = peers.diffusers_hook(lambda iv=iv: TaylorSeerCacheConfig(
            cache_interval=iv, max_order=1, taylor_factors_dtype=torch.float32,
            cache_identifiers=peers.taylorseer_identifiers(wl)))
        show(f"diffusers TaylorSeer interval {iv}",
             pw.over_prompts(wl, lambda w, h=hook: peers.run_diffusers(w, h), seeds), their_base)
        # TaylorSeer computes step 0 and every iv-th step from step 1 (the last one included):
        # DeepCache start 1 computes the same steps
        for start in (1, 3):
            for forecast in (0, 1, 2):
                for remodulate in (False, True):
                    config = CMConfig(deepcache=DeepCacheConfig(start=start, end=50, interval=iv),
                                      forecast=forecast, bn_blocks=0, last_steps=0,
                                      remodulate=remodulate)
                    show(f"ours DeepCache {start}/50/{iv} B0 forecast {forecast}"
                         + (" remodulated" if remodulate else ""), pw.over_prompts(
                             wl, lambda w, c=config: pw.run_ours(w, c, counter), seeds),
                         ours_base)

if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""VAE decode time on 1, 2 and 4 CPU ranks (gloo, patch parallel, seed 004) for the tiny random
VAEs, and each rank's peak memory.

Time: one decode, barrier before and after (so the slowest rank counts), median over --repeats
after one warm-up decode. The 1-rank row is the plain diffusers decode (no hooks, no gather).
Memory: resource.getrusage(RUSAGE_SELF).ru_maxrss of each rank process (peak resident set, MiB):
`peak` after the last decode, and `+decode` = peak minus the peak before the first decode, i.e.
what decoding added on top of the process baseline (torch, diffusers, weights, latent; ranks fork
from a server that imported torch and diffusers, so the baseline includes those pages).
Ranks run as local processes with cores/ranks threads each (at least 1): 4 ranks on a 2-core
machine are oversubscribed, so read the 4-rank row there as a correctness-at-scale run, not
a speedup figure.

Usage: python -m bench.studies.vae_decode [--vae wan2.1-vae,wan2.2-vae,hunyuanvideo-1.5-vae]
       [--latent FxHxW] [--ranks 1,2,4] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from modules.vae import VAES, build_tiny  # noqa: E402
from vae_parallel import PatchComm, parallel_decode, plain_decode, plan_grid  # noqa: E402
from vae_parallel.launch import run_ranks  # noqa: E402


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def measure(rank, world_size, vae_name, latent, repeats):
    """One rank's decode times and memory; the same on every rank (they synchronise)."""
    spec = VAES[vae_name]
    vae = build_tiny(spec, spec.z_dim)
    f, h, w = latent
    z = torch.randn(1, spec.z_dim, f, h, w, generator=torch.Generator().manual_seed(0))
    before = _peak_mib()
    if world_size == 1:
        grid = None

        def decode():
            with torch.no_grad():
                return plain_decode(vae, z)
    else:
        comm = PatchComm(plan_grid(world_size, h, w))
        grid = comm.grid

        def decode():
            return parallel_decode(vae, z, comm)

    def barrier():
        if world_size > 1:
            dist.barrier()

    video = decode()  # warm-up: allocator, kernels, process groups
    times = []
    for _ in range(repeats):
        barrier()
        start = time.perf_counter()
        video = decode()
        barrier()
        times.append(time.perf_counter() - start)
    return {"times": times, "before": before, "peak": _peak_mib(), "threads": torch.get_num_threads(),
            "grid": None if grid is None else f"{grid.shape[0]}x{grid.shape[1]}",
            "video": None if video is None else list(video.shape[2:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vae", default=",".join(VAES), help="comma-separated VAE names")
    parser.add_argument("--latent", default="3x12x16", help="latent frames x height x width")
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads per rank (default: cores / "
                        "ranks, at least 1); --threads 1 compares ranks at equal threads")
    args = parser.parse_args()
    latent = tuple(int(v) for v in args.latent.lower().split("x"))
    ranks = [int(r) for r in args.ranks.split(",")]
    load = os.getloadavg()[0]
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, gloo; load average {load:.2f} at start; median of {args.repeats}")
    print("# memory: ru_maxrss per rank (MiB); +decode = peak after decoding - peak before")
    print(f"{'vae':22s} {'latent':>10s} {'video':>13s} {'ranks':>5s} {'grid':>4s} {'thr':>3s} "
          f"{'decode s':>9s} {'speedup':>7s}  peak MiB per rank / +decode")
    for name in args.vae.split(","):
        base = None
        for world in ranks:
            per_rank = run_ranks(world, measure, name, latent, args.repeats,
                                 threads=args.threads, timeout=1800)
            median = statistics.median(max(ts) for ts in zip(*(r["times"] for r in per_rank),
                                                             strict=True))
            base = base if base is not None else median
            memory = ", ".join(f"{r['peak']:.0f}/+{r['peak'] - r['before']:.0f}" for r in per_rank)
            video = "x".join(str(v) for v in per_rank[0]["video"])
            print(f"{name:22s} {'x'.join(map(str, latent)):>10s} {video:>13s} {world:5d} "
                  f"{per_rank[0]['grid'] or '-':>4s} {per_rank[0]['threads']:3d} {median:9.3f} "
                  f"{base / median:6.2f}x  {memory}", flush=True)
    print(f"# load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()

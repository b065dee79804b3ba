"""Local CPU ranks for tests and benchmarks: N processes in one gloo group, each running
fn(rank, world_size, *args); returns the results by rank. (Runs on devices use torchrun.)

Processes fork from a forkserver that has imported torch and the diffusers VAEs once: a spawn per
rank would pay the 5 s diffusers import every time."""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import shutil
import tempfile
import time
import traceback

import torch.multiprocessing as mp

PRELOAD = ("torch", "torch.distributed", "diffusers.models.autoencoders.autoencoder_kl_wan",
           "diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15")


class RankFailure(RuntimeError):
    """A rank raised, died or timed out; the message carries its traceback."""


def _rank_main(rank, world_size, store, threads, fn, args, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world_size)
        out = fn(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(out)))  # by value: no shared-memory handles
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, threads: int | None = None,
              timeout: float = 300.0) -> list:
    """fn(rank, world_size, *args) on `world_size` CPU processes (gloo); `fn` must be importable
    (a module-level function). Threads per rank default to the cores shared out."""
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the server first starts
    workdir = tempfile.mkdtemp(prefix="vae-parallel-")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world_size, os.path.join(workdir, "store"), threads, fn, args, results))
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        return _collect(procs, results, world_size, time.monotonic() + timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(5)
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(procs, results, world_size, deadline):
    out = {}
    while len(out) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue_module.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in out]
            if dead:
                raise RankFailure(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
            if time.monotonic() > deadline:
                raise RankFailure(f"ranks {sorted(set(range(world_size)) - set(out))} timed out") from None
            continue
        if not ok:
            raise RankFailure(f"rank {rank} failed:\n{payload}")
        out[rank] = pickle.loads(payload)
    return [out[r] for r in range(world_size)]

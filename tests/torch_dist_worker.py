"""One rank of the torch.distributed tests (tests/test_torch_distributed.py), and the runs they
compare: `python -m tests.torch_dist_worker SPEC.json` under torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or `run(scenario)` in one process.

SPEC: {"grid": [sp, cfg] the launch was made for, "out": dir, "scenarios": [scenario, ...]};
a scenario may run on another grid of the same world (its own process groups). Each rank
writes out/rank<r>.pt: scenario id -> what `run` returned.
"""

from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from cache import CMConfig, FBCacheConfig, TeaCacheConfig
from sampling.pipelines import get_pipeline
from sampling.run import make_sample, sample_once
from sampling.stages import SignalPlan, replicated_key_lengths
from sharding.torch_sp import (
    TorchSequenceLayout,
    close_torch_parallel,
    init_torch_parallel,
    make_groups,
)
from tests.model_inputs import random_model
from torch_backend import backend as torch_backend

CONFIGS = {
    "off": {},
    "teacache": {"teacache": TeaCacheConfig(threshold=0.3)},
    # a strided tensor metric: shards must start on counted tokens (alignment padding)
    "fbcache": {"fbcache": FBCacheConfig(metric="residual_tensor_rel_l1", threshold=1.0,
                                         downsample=4)},
    "fbcache_salient": {"fbcache": FBCacheConfig(metric="residual_tensor_rel_l1", threshold=1.0,
                                                 saliency=0.5)},
    "teacache_strided": {"teacache": TeaCacheConfig(threshold=0.3, downsample=3)},
    "teacache_time": {"teacache": TeaCacheConfig(threshold=0.3, signal="time_embedding")},
    "teacache_projection": {"teacache": TeaCacheConfig(threshold=0.3, signal="time_projection")},
    "teacache_fn2bn1": {"teacache": TeaCacheConfig(threshold=0.3), "fn_blocks": 2, "bn_blocks": 1},
}


def scenario(model: str, config: str, *, grid=(1, 1), size=None, image=False, fused=False,
             steps=8, fail_at=(), avoid=True) -> dict:
    """A trajectory to run on a (sp, cfg) grid of ranks. fail_at: the signal all_reduce calls
    (0-based, warm-up included) that raise; avoid=False: the shard length may equal Wan's text
    length (to show why it must not)."""
    sid = "-".join(str(p) for p in (
        model, config, f"sp{grid[0]}cfg{grid[1]}", "x".join(map(str, size)) if size else "",
        "image" if image else "", "fused" if fused else "",
        "fail" + "_".join(map(str, fail_at)) if fail_at else "", "" if avoid else "collide") if p)
    return dict(id=sid, model=model, config=config, grid=list(grid), size=size, image=image,
                fused=fused, steps=steps, fail_at=list(fail_at), avoid=avoid)


class AllReduceSpy:
    """Wraps dist.all_reduce: counts calls and the size of the group, raises on chosen calls."""

    def __init__(self, fail_at=()):
        self.real, self.fail_at = dist.all_reduce, set(fail_at)
        self.calls, self.group_sizes = 0, []

    def __call__(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        index, self.calls = self.calls, self.calls + 1
        self.group_sizes.append(dist.get_world_size(group))
        if index in self.fail_at:
            raise RuntimeError(f"injected all_reduce failure (call {index})")
        return self.real(tensor, op=op, group=group, async_op=async_op)


def run(spec: dict, layout=None) -> dict:
    pipe = get_pipeline(spec["model"])
    shape = pipe.latent_shape(*(spec["size"] or pipe.size))
    tensors = pipe.synthesize(shape, True, spec["image"], 0)
    models = {e: random_model(c, seed=i, std=0.2) for i, (e, c) in enumerate(pipe.experts)}
    config = CMConfig(**CONFIGS[spec["config"]],
                      cfg_mode="fused" if spec["fused"] else "cond_authoritative")
    if not spec["avoid"]:
        torch_backend.replicated_key_lengths = lambda model: ()
    backend = torch_backend.TorchBackend(models, SignalPlan.from_config(config), layout=layout)
    probes = []
    real_probe = backend.probe

    def probe(*args, **kwargs):  # counts model calls (warm-up included)
        probes.append(1)
        return real_probe(*args, **kwargs)

    backend.probe = probe
    spy = AllReduceSpy(spec["fail_at"]) if layout is not None else None
    if spy is not None:
        dist.all_reduce = spy
    try:
        sample = make_sample(backend, pipe, tensors, shape, image=spec["image"], seed=0,
                             fused_cfg=spec["fused"])
        traj = sample_once(backend, config, sample, solver=pipe.solver, steps=spec["steps"],
                           shift=pipe.shift)
    finally:
        if spy is not None:
            dist.all_reduce = spy.real
        if not spec["avoid"]:
            torch_backend.replicated_key_lengths = replicated_key_lengths
    return {"latents": backend.get(traj.latents), "trace": traj.gate.telemetry.trace,
            "failsafes": traj.gate.summary()["failsafes"], "probes": len(probes),
            "all_reduces": spy.calls if spy else 0,
            "group_sizes": sorted(set(spy.group_sizes)) if spy else [],
            "tokens": None if layout is None else (layout.tokens, layout.local_len)}


def main(path: str) -> None:
    torch.set_num_threads(1)  # the ranks share two cores
    spec = json.loads(Path(path).read_text())
    # a hung collective prints every thread's stack and exits instead of hanging the test
    faulthandler.dump_traceback_later(spec.get("watchdog_s", 300), exit=True)
    sp, cfg = spec["grid"]
    layouts = {(sp, cfg): init_torch_parallel(sp, cfg == 2, timeout_s=120)}
    results = {}
    for s in spec["scenarios"]:
        grid = tuple(s["grid"])
        if grid not in layouts:  # every rank reaches this in the same order: new_group is collective
            layouts[grid] = TorchSequenceLayout(*make_groups(*grid))
        results[s["id"]] = run(s, layouts[grid])
    torch.save(results, Path(spec["out"]) / f"rank{dist.get_rank()}.pt")
    close_torch_parallel()


if __name__ == "__main__":
    main(sys.argv[1])

"""Run by tests/test_sharded_loading.py in a fresh process with 8 emulated CPU devices (the flag
must be set before jax starts). Prints one JSON object of measured facts.

For each case a tiny random checkpoint is written, then placed on a mesh two ways: the old path
(the whole model read by `load_model`, each weight placed as `tpu/backend.py` did before issue
24: whole onto the first device through torchax's fp32 copy, then resharded) and the new one
(`open_checkpoint`: the backend reads each device's rows itself). Both then sample.
"""

import os
import sys

os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                           "--xla_backend_optimization_level=0")  # compiles faster
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from cache import CMConfig, TeaCacheConfig  # noqa: E402
from compat.torchax_compat import import_torchax  # noqa: E402
from modules.checkpoint import load_model, open_checkpoint, save_checkpoint  # noqa: E402
from sampling.pipelines import get_pipeline  # noqa: E402
from sampling.run import make_sample, sample_once  # noqa: E402
from sampling.stages import SignalPlan  # noqa: E402
from sharding.jax_sp import make_mesh  # noqa: E402
from tests.model_inputs import random_model  # noqa: E402
from tpu.backend import JaxBackend  # noqa: E402
from tpu.compile import enable_compile_cache  # noqa: E402

# (pipeline, stored layout, stored dtype, loaded dtype, sp, cfg, weights)
CASES = [
    # the layout conversion (refiner q/k/v rows concatenated, final modulation halves swapped),
    # fp32 stored -> bf16 cast on the host (fp32 islands kept), FSDP over cfg x sp
    ("hunyuanvideo-tiny", "diffusers", torch.float32, torch.bfloat16, 4, 2, "fsdp"),
    # two experts (Wan2.2 I2V-A14B's shape), bf16 stored and kept, every weight replicated
    ("wan-tiny-i2v", "official", torch.bfloat16, torch.bfloat16, 8, 1, "replicated"),
    # fp32 kept, FSDP over sp alone
    ("wan-tiny-ti2v", "official", torch.float32, torch.float32, 8, 1, "fsdp"),
]
STEPS = 4


def old_placement(backend, model):
    """tpu/backend.py `_place_weight` before issue 24 (the reference the new path must equal)."""
    env = import_torchax().default_env()
    out = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            array = env.t2j_copy(p.detach())
            sharding = backend._weight_sharding(name, tuple(p.shape))
            out[f"model.{name}"] = array if sharding is None else jax.device_put(array, sharding)
        # a scanned run's weights are placed stacked (tpu/scan.py): the old ones, stacked
        _, stacks = backend._weight_specs(model)
        for key, members in stacks.items():
            sharding = backend._stacked_sharding(members[0], tuple(model.get_parameter(members[0]).shape))
            out[f"model.{key}"] = jax.device_put(
                jnp.stack([out.pop(f"model.{m}") for m in members]), sharding)
    return out


def same_arrays(a, b) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or not a.sharding.is_equivalent_to(b.sharding, a.ndim):
        return False
    shards_b = {s.device: s for s in b.addressable_shards}
    for s in a.addressable_shards:
        other = shards_b[s.device]
        if s.index != other.index or np.asarray(s.data).tobytes() != np.asarray(other.data).tobytes():
            return False
    return True


def sample(backend, pipe, config, tensors, shape):
    fused = config.cfg_mode == "fused"
    run = make_sample(backend, pipe, tensors, shape, image=pipe.task == "i2v", seed=0,
                      fused_cfg=fused)
    traj = sample_once(backend, config, run, solver=pipe.solver, steps=STEPS, shift=pipe.shift)
    return backend.get(traj.latents), sum(traj.stats.step_computed)


def check(case, root: Path) -> dict:
    name, layout, stored, dtype, sp, cfg, weights = case
    pipe = get_pipeline(name)
    paths = {}
    for i, (expert, config_name) in enumerate(pipe.experts):
        model = random_model(config_name, seed=i, std=0.2)
        paths[expert] = save_checkpoint(model, root / f"{name}-{expert}", layout=layout,
                                        dtype=stored, max_shard_bytes=64 * 1024)
    mesh = make_mesh(sp, cfg)
    config = CMConfig(teacache=TeaCacheConfig(threshold=0.4),
                      **({"cfg_mode": "fused"} if cfg > 1 else {}))
    plan = SignalPlan.from_config(config)
    shape = pipe.latent_shape(*pipe.size)
    tensors = pipe.synthesize(shape, True, pipe.task == "i2v", 0)

    whole = {e: load_model(paths[e], c, dtype=dtype)[0] for e, c in pipe.experts}
    old = JaxBackend(whole, plan, mesh=mesh, weights=weights)
    opened = {e: open_checkpoint(paths[e], c, dtype=dtype) for e, c in pipe.experts}
    new = JaxBackend({e: m for e, (m, _, _) in opened.items()}, plan, mesh=mesh, weights=weights,
                     checkpoints={e: r for e, (_, r, _) in opened.items()})
    for _, reader, _ in opened.values():
        reader.close()

    differ, split = [], 0
    meta = all(p.is_meta for model, _, _ in opened.values() for p in model.parameters())
    for expert, model in whole.items():
        reference = old_placement(old, model)
        for key, ref in reference.items():
            placed = new.params[expert][key]
            split += int(not placed.sharding.is_fully_replicated)
            if not (same_arrays(placed, ref) and same_arrays(old.params[expert][key], ref)):
                differ.append(f"{expert}:{key}")
    latents_old, computed_old = sample(old, pipe, config, tensors, shape)
    latents_new, computed_new = sample(new, pipe, config, tensors, shape)
    return {"case": f"{name} {layout} {stored} -> {dtype} sp{sp} cfg{cfg} {weights}",
            "weights": weights, "meta_models": meta, "weights_differ": differ[:10],
            "weights_compared": sum(len(p) for p in new.params.values()), "split": split,
            "bytes_read": sum(r.bytes_read for _, r, _ in opened.values()),
            "checkpoint_bytes": sum(r.checkpoint_bytes for _, r, _ in opened.values()),
            "latents_equal": torch.equal(latents_old, latents_new),
            "finite": bool(torch.isfinite(latents_new).all()),
            "computed": [computed_old, computed_new], "steps": STEPS}


def main():
    with tempfile.TemporaryDirectory() as tmp:
        # the second backend of a case compiles the same programs: the cache serves them
        enable_compile_cache(os.path.join(tmp, "jax-cache"))
        print(json.dumps({"devices": jax.device_count(),
                          "cases": [check(case, Path(tmp)) for case in CASES]}))


if __name__ == "__main__":
    main()

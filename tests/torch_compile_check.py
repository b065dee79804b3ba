"""Run by tests/test_torch_backend.py in a fresh process: torch.compile (inductor, CPU) of the
stages, with TeaCache on, against eager. A fresh process because torchax, once imported, renames
torch's private device to 'jax' and dynamo then refuses to compile (torchax 0.0.13; recheck when a
newer torchax is pinned). Prints one JSON line."""

import json
import sys

from cache import CMConfig, TeaCacheConfig
from sampling.pipelines import get_pipeline
from sampling.run import make_sample, sample_once
from sampling.stages import SignalPlan
from tests.model_inputs import random_model, rel_err
from torch_backend.backend import TorchBackend


def main():
    assert "torchax" not in sys.modules
    pipe = get_pipeline("hunyuanvideo-tiny")
    models = {None: random_model("hunyuanvideo-tiny", std=0.2)}
    shape = pipe.latent_shape(*pipe.size)
    tensors = pipe.synthesize(shape, True, False, 0)
    config = CMConfig(teacache=TeaCacheConfig(threshold=0.5))
    out = {}
    for compiled in (True, False):
        backend = TorchBackend(models, SignalPlan.from_config(config), compile=compiled)
        sample = make_sample(backend, pipe, tensors, shape, image=False, seed=0)
        traj = sample_once(backend, config, sample, solver="euler", steps=12, shift=5.0)
        out[compiled] = (backend.get(traj.latents),
                         [r["action"] for r in traj.gate.telemetry.trace], traj)
    traj = out[True][2]
    print(json.dumps({
        "warmup_frames": traj.warmup_compiles.lowered, "loop_frames": traj.loop_compiles.lowered,
        "rel_err": rel_err(out[True][0], out[False][0]),
        "same_trace": out[True][1] == out[False][1], "skips": out[True][1].count("skip"),
    }))


if __name__ == "__main__":
    main()

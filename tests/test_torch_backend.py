"""The torch backend: bit-exact stages, decisions equal to JAX's, torch.compile, offload."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cache import CMConfig, DeepCacheConfig, FailSafe, FBCacheConfig, TeaCacheConfig
from sampling.pipelines import get_pipeline
from sampling.run import make_sample, sample_once
from sampling.stages import SignalPlan
from tests.model_inputs import random_model
from torch_backend.backend import TorchBackend, TorchOps
from tpu.backend import JaxBackend

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "deepcache": CMConfig(deepcache=DeepCacheConfig(start=3, end=16, interval=3)),
    "teacache": CMConfig(teacache=TeaCacheConfig(threshold=0.5)),
    "fbcache": CMConfig(fbcache=FBCacheConfig(metric="residual_tensor_rel_l1", threshold=1.0)),
}


def inputs(name, image=None):
    pipe = get_pipeline(name)
    shape = pipe.latent_shape(*pipe.size)
    image = pipe.task == "i2v" if image is None else image
    return pipe, shape, image, pipe.synthesize(shape, True, image, 0)


@pytest.mark.parametrize("name", ["hunyuanvideo-tiny", "wan-tiny-i2v"])
@pytest.mark.parametrize("config", [CMConfig(), CONFIGS["deepcache"], CMConfig(fn_blocks=2, bn_blocks=1)],
                         ids=["off", "bn1", "fn2-bn1"])
def test_stages_with_caching_off_equal_forward_bit_for_bit(name, config):
    pipe, shape, image, tensors = inputs(name)
    model = random_model(pipe.experts[0][1], std=0.2)
    backend = TorchBackend({None: model}, SignalPlan.from_config(config))
    kw, static = pipe.conditions(tensors, "cond", image, shape)
    backend.prepare(tuple(kw), static, shape)
    x, t = torch.randn(shape), torch.tensor([700.0])
    hidden, ctx, _, _ = backend.probe(None, x, t, kw, None)
    got = backend.tail(None, backend.middle(None, hidden, ctx), ctx)
    with torch.no_grad():
        want = model(x, t, **kw, **static)
    assert torch.equal(got, want)


@pytest.mark.parametrize("technique", list(CONFIGS))
@pytest.mark.parametrize("name", ["hunyuanvideo-tiny", "wan-tiny-ti2v"])
def test_decision_traces_equal_the_jax_backend(name, technique):
    config = CONFIGS[technique]
    pipe, shape, image, tensors = inputs(name)
    models = {e: random_model(c, seed=i, std=0.2) for i, (e, c) in enumerate(pipe.experts)}
    traces = []
    for cls in (TorchBackend, JaxBackend):
        backend = cls(models, SignalPlan.from_config(config))
        sample = make_sample(backend, pipe, tensors, shape, image=image, seed=0)
        traj = sample_once(backend, config, sample, solver=pipe.solver, steps=18, shift=pipe.shift)
        traces.append([(r["step"], r["branch"], r["action"], r["reason"])
                       for r in traj.gate.telemetry.trace])
    assert traces[0] == traces[1]
    actions = {a for _, _, a, _ in traces[0]}
    assert actions == {"compute", "skip"}


def test_torch_compile_never_recompiles_in_the_loop_and_matches_eager():
    out = subprocess.run([sys.executable, "-m", "tests.torch_compile_check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["warmup_frames"] == 3  # probe, middle, tail: one graph each
    assert result["loop_frames"] == 0
    assert result["same_trace"] and result["skips"] > 0
    assert result["rel_err"] < 1e-4


class Hosted:
    """A residual parked on the fake host: the gate must move it back before use."""

    def __init__(self, tensor):
        self.tensor = tensor


class FakeHostOps(TorchOps):
    """TorchOps with a host distinct from the compute device, recording every move."""

    def __init__(self, fail_to="never"):
        super().__init__("cpu")
        self.host, self.moves, self.fail_to = "fake-host", [], fail_to

    def _inner(self, x):
        return x.tensor if isinstance(x, Hosted) else x

    def shape(self, x):
        return super().shape(self._inner(x))

    def dtype(self, x):
        return super().dtype(self._inner(x))

    def device(self, x):
        return ("fake-host",) if isinstance(x, Hosted) else super().device(x)

    def move(self, x, device):
        target = "host" if device == "fake-host" else "device"
        self.moves.append(target)
        if self.fail_to in (target, "always"):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return Hosted(self._inner(x).clone()) if target == "host" else self._inner(x)


def offload_run(ops_impl, offload="cpu", offload_model=True):
    pipe, shape, image, tensors = inputs("wan-tiny-i2v")
    models = {e: random_model(c, seed=i, std=0.2) for i, (e, c) in enumerate(pipe.experts)}
    config = CMConfig(teacache=TeaCacheConfig(threshold=0.5), offload=offload)
    backend = TorchBackend(models, SignalPlan.from_config(config), offload_model=offload_model,
                           ops_impl=ops_impl)
    calls = []
    for expert, model in models.items():
        original = model.to
        model.to = lambda device, _e=expert, _to=original: (calls.append((_e, str(device))), _to(device))[1]
    sample = make_sample(backend, pipe, tensors, shape, image=image, seed=0)
    traj = sample_once(backend, config, sample, solver="unipc", steps=14, shift=5.0)
    return backend.get(traj.latents), traj, calls


def test_offloaded_residuals_wait_on_the_host_and_follow_the_model_back():
    ops_impl = FakeHostOps()
    latents, traj, calls = offload_run(ops_impl)
    reference, ref_traj, _ = offload_run(TorchOps("cpu"), offload="gpu", offload_model=False)
    skips = sum(r["action"] == "skip" for r in traj.gate.telemetry.trace)
    assert skips > 0 and "host" in ops_impl.moves and "device" in ops_impl.moves
    assert ops_impl.moves.count("device") == skips  # every reuse fetched its residual back
    assert torch.equal(latents, reference)
    assert traj.gate.summary()["failsafe_count"] == 0
    # the model offload: each expert goes to the device when it runs, the other leaves it
    assert ("high", "cpu") in calls and ("low", "cpu") in calls
    assert calls.index(("low", "cpu")) > 0 and calls[-1][1] == "cpu"


@pytest.mark.parametrize("fail_to", ["host", "device"])
def test_an_out_of_memory_move_drops_the_residual_computes_and_counts(fail_to):
    latents, traj, _ = offload_run(FakeHostOps(fail_to=fail_to))
    summary = traj.gate.summary()
    assert summary["failsafes"][str(FailSafe.OOM_ON_MOVE)] > 0
    assert torch.isfinite(latents).all() and len(traj.stats.step_computed) == 14
    if fail_to == "host":  # nothing could be parked, so nothing was reused
        assert all(r["action"] == "compute" for r in traj.gate.telemetry.trace)

"""Issue 8 mechanisms end to end on tiny models: bn_ids tail runs, token saliency, control guard.

The tail references are the definitions written out with the models' staged API (block by
block); the backends must agree with them and with each other.
"""

import pytest
import torch

from cache import CMConfig, FBCacheConfig, TeaCacheConfig
from sampling.run import make_sample, sample_once
from sampling.stages import SignalPlan, reference_shape, stages_for
from tests.model_inputs import rel_err
from tests.test_stage2_jax import run, setup
from torch_backend.backend import TorchBackend
from tpu.backend import JaxBackend


def _add(a, b):
    return tuple(x + y for x, y in zip(a, b, strict=True)) if isinstance(a, tuple) else a + b


def _sub(a, b):
    return tuple(x - y for x, y in zip(a, b, strict=True)) if isinstance(a, tuple) else a - b


def _close(a, b):
    a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
    return max(rel_err(x, y) for x, y in zip(a, b, strict=True)) < 1e-6


@pytest.mark.parametrize("name", ["hunyuanvideo-tiny", "wan-tiny-i2v"])
def test_tail_runs_store_and_reuse_their_own_residuals(name):
    pipe, models, shape, image, tensors, _ = setup(name)
    model = models[pipe.experts[0][0]]
    config = CMConfig(teacache=TeaCacheConfig(), bn_blocks=3, bn_ids=(1,))
    plan = SignalPlan.from_config(config)
    kw, static = pipe.conditions(tensors, "cond", image, shape)
    grid = model.grid(shape)
    stages = stages_for(model, plan, tuple(kw), static, grid)
    assert set(stages) == {"probe", "middle", "tail", "cached_tail"}
    assert plan.tail_runs == ((0, 1), (2, 3)) and plan.reuse_tail_blocks == 1
    x = torch.randn(shape)
    t = pipe.timestep_input(999.0, shape, image)
    rope = model.rope(grid)
    ref = torch.zeros(1)
    with torch.no_grad():
        hidden, ctx, _, _ = stages["probe"](x, t, *rope, ref, x, *kw.values())
        h = stages["middle"](hidden, ctx)
        out, residuals = stages["tail"](h, ctx)
        mctx = stages["tail"]._ctx(ctx)  # the stages pass the context as a plain tuple
        n = model.num_blocks
        a = model.block(n - 3, h, mctx)
        b = model.block(n - 2, a, mctx)
        e = model.block(n - 1, b, mctx)
        assert _close(residuals[0], _sub(a, h)) and _close(residuals[1], _sub(e, b))
        assert rel_err(out, model.final(e, mctx, grid)) < 1e-6
        # a reuse step on another hidden state: run block n-2 only, the runs add their residuals
        h2 = _add(h, h)
        got = stages["cached_tail"](h2, ctx, *residuals)
        mid = model.block(n - 2, _add(h2, residuals[0]), mctx)
        want = model.final(_add(mid, residuals[1]), mctx, grid)
        assert rel_err(got, want) < 1e-6


def test_bn_ids_end_to_end_agree_between_backends_and_compile_nothing_in_the_loop():
    config = CMConfig(teacache=TeaCacheConfig(threshold=0.3), bn_blocks=3, bn_ids=(1,))
    jax_out, traj, backend = run(JaxBackend, "wan-tiny-i2v", config, steps=20)
    torch_out, ttraj, _ = run(TorchBackend, "wan-tiny-i2v", config, steps=20)
    assert "cached_tail" in backend.programs()
    assert traj.loop_compiles.lowered == 0 and traj.loop_compiles.backend == 0
    assert [r["action"] for r in traj.gate.telemetry.trace] == \
        [r["action"] for r in ttraj.gate.telemetry.trace]
    assert not all(traj.stats.step_computed)
    assert rel_err(jax_out, torch_out) < 1e-5
    # the selection matters: all three tail blocks running gives another result
    all_tail, _, _ = run(JaxBackend, "wan-tiny-i2v",
                         CMConfig(teacache=TeaCacheConfig(threshold=0.3), bn_blocks=3), steps=20)
    assert rel_err(jax_out, all_tail) > 1e-5


def test_saliency_focuses_the_tensor_metric_on_the_tokens_that_changed():
    pipe, models, shape, image, tensors, _ = setup("wan-tiny-ti2v")
    model = models[None]
    kw, static = pipe.conditions(tensors, "cond", image, shape)
    grid = model.grid(shape)
    x = torch.randn(shape)
    t = pipe.timestep_input(700.0, shape, image)

    def signal(tau, reference):
        fb = FBCacheConfig(metric="residual_tensor_rel_l1", saliency=tau)
        probe = stages_for(model, SignalPlan.from_config(CMConfig(fbcache=fb)), tuple(kw),
                           static, grid)["probe"]
        with torch.no_grad():
            _, _, signals, r1 = probe(x, t, *model.rope(grid), reference, x, *kw.values())
        return signals[0, 0].item(), r1

    plan = SignalPlan.from_config(CMConfig(fbcache=FBCacheConfig(metric="residual_tensor_rel_l1")))
    _, r1 = signal(0.0, torch.zeros(reference_shape(model, 1, grid, plan)))
    moved = r1.clone()
    moved[:, :3] *= 3.0  # 3 tokens change a lot, the rest not at all
    full, _ = signal(0.0, moved)
    focused, _ = signal(0.5, moved)
    nothing_salient, _ = signal(1e6, moved)
    # only the moved tokens count: |r - 3r| / |3r| = 2/3, undiluted by the static background
    assert focused == pytest.approx(2 / 3, rel=1e-5) and full < focused / 5
    assert nothing_salient == pytest.approx(full, rel=1e-6)  # no salient token: the full mean


def test_saliency_traces_agree_between_backends():
    config = CMConfig(fbcache=FBCacheConfig(metric="residual_tensor_rel_l1", threshold=0.2,
                                            saliency=0.3))
    _, traj, _ = run(JaxBackend, "hunyuanvideo-tiny", config, steps=12)
    _, ttraj, _ = run(TorchBackend, "hunyuanvideo-tiny", config, steps=12)
    rels = [r["rel"] for r in traj.gate.telemetry.trace]
    assert [r["action"] for r in traj.gate.telemetry.trace] == \
        [r["action"] for r in ttraj.gate.telemetry.trace]
    assert rels[2:] == pytest.approx([r["rel"] for r in ttraj.gate.telemetry.trace][2:], rel=1e-4)


def _control_run(backend_cls, ctrl_guard, change_at=6):
    pipe, models, shape, image, tensors, _ = setup("wan-tiny-i2v")
    config = CMConfig(teacache=TeaCacheConfig(threshold=5.0), ctrl_guard=ctrl_guard)
    backend = backend_cls(models, SignalPlan.from_config(config))
    sample = make_sample(backend, pipe, tensors, shape, image=image, seed=0)
    new_y = {b: {"y": backend.put(torch.randn(sample.conds[b]["y"].shape) * 2)}
             for b in ("cond", "uncond")}
    sample.cond_updates = {change_at: new_y}
    traj = sample_once(backend, config, sample, solver=pipe.solver, steps=12, shift=pipe.shift)
    return traj


@pytest.mark.parametrize("backend_cls", [JaxBackend, TorchBackend])
def test_control_guard_computes_at_a_new_image_latent(backend_cls):
    guarded = _control_run(backend_cls, 0.1)
    rows = [r for r in guarded.gate.telemetry.trace if r["step"] == 6]
    assert [r["action"] for r in rows] == ["compute", "compute"]
    assert rows[0]["reason"] == "control_change" and rows[0]["signal_control_delta"] > 0.1
    unguarded = _control_run(backend_cls, 0.0)
    assert [r["action"] for r in unguarded.gate.telemetry.trace if r["step"] == 6] == ["skip", "skip"]
    if backend_cls is JaxBackend:
        assert guarded.loop_compiles.lowered == 0  # warm-up compiled the change measure too


def test_bad_condition_updates_are_refused_before_sampling():
    pipe, models, shape, image, tensors, _ = setup("wan-tiny-i2v")
    backend = TorchBackend(models, SignalPlan.from_config(CMConfig()))
    sample = make_sample(backend, pipe, tensors, shape, image=image, seed=0)
    for updates, message in (({99: {"cond": {}}}, r"\[0, 12\)"), ({1: {"pair": {}}}, "branch"),
                             ({1: {"cond": {"z": sample.noise}}}, "does not take")):
        sample.cond_updates = updates
        with pytest.raises(ValueError, match=message):
            sample_once(backend, CMConfig(), sample, solver=pipe.solver, steps=12, shift=pipe.shift)

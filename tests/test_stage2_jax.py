"""Stage 2 on JAX: the jitted stage programs against torch, compile discipline, experts, TI2V.

References are written out plainly here: model.forward (caching off) or the staged torch API with
the DeepCache reuse rule, driven by the shared scheduler (itself checked against diffusers).
"""

import pytest
import torch

from cache import CMConfig, DeepCacheConfig, FBCacheConfig, TeaCacheConfig
from cache.deepcache import schedule
from sampling.pipelines import get_pipeline
from sampling.run import make_sample, noise_for, sample_once
from sampling.schedulers import make_scheduler
from sampling.stages import SignalPlan
from tests.model_inputs import random_model, rel_err
from torch_backend.backend import TorchBackend
from tpu.backend import JaxBackend


def setup(name, *, steps=None, image=None, seed=0):
    pipe = get_pipeline(name)
    models = {e: random_model(c, seed=i, std=0.2) for i, (e, c) in enumerate(pipe.experts)}
    shape = pipe.latent_shape(*pipe.size)
    image = pipe.task == "i2v" if image is None else image
    tensors = pipe.synthesize(shape, True, image, seed)
    return pipe, models, shape, image, tensors, steps or pipe.steps


def run(backend_cls, name, config, steps=None, image=None, **kw):
    pipe, models, shape, image, tensors, steps = setup(name, steps=steps, image=image)
    backend = backend_cls(models, SignalPlan.from_config(config), **kw)
    sample = make_sample(backend, pipe, tensors, shape, image=image, seed=0)
    traj = sample_once(backend, config, sample, solver=pipe.solver, steps=steps, shift=pipe.shift)
    return backend.get(traj.latents), traj, backend


def forward_reference(name, steps, image=None):
    """Caching off: plain model.forward per branch, CFG, the scheduler; nothing of the loop."""
    pipe, models, shape, image, tensors, steps = setup(name, steps=steps, image=image)
    sched = make_scheduler(pipe.solver, steps, pipe.shift)
    x = noise_for(shape, 0)
    frame = pipe.first_frame(tensors, image)
    conds = {b: pipe.conditions(tensors, b, image, shape) for b in ("cond", "uncond")}
    with torch.no_grad():
        for i, t in enumerate(sched.timesteps):
            if frame is not None:
                x[:, :, :1] = frame
            expert = pipe.expert_at(t)
            g = pipe.guidance_for(expert)
            tt = pipe.timestep_input(t, shape, image)
            out = {b: models[expert](x, tt, **kw, **static) for b, (kw, static) in conds.items()}
            v = out["uncond"] + g * (out["cond"] - out["uncond"])
            x = sched.step(i, v, x, lambda terms: sum(w * t for w, t in terms))
        if frame is not None:
            x[:, :, :1] = frame
    return x


@pytest.mark.parametrize("name", ["hunyuanvideo-tiny", "wan-tiny-ti2v", "wan-tiny-i2v"])
def test_caching_off_jax_equals_torch_forward(name):
    ref = forward_reference(name, steps=8)
    eager, _, _ = run(TorchBackend, name, CMConfig(), steps=8)
    jax_out, traj, _ = run(JaxBackend, name, CMConfig(), steps=8)
    assert rel_err(eager, ref) < 1e-5  # same torch maths, staged (CFG summed in another order)
    assert rel_err(jax_out, ref) < 1e-5
    assert all(traj.stats.step_computed)


def deepcache_reference(name, config):
    """The staged torch model with the DeepCache rule: on reuse steps the entry hidden state plus
    the residual of blocks [0, N - 1) stored at the last computed step, then the last block."""
    pipe, models, shape, image, tensors, steps = setup(name)
    model = models[None]
    sched = make_scheduler(pipe.solver, steps, pipe.shift)
    computes = schedule(config.deepcache, steps)
    x, grid, residual = noise_for(shape, 0), model.grid(shape), {}
    conds = {b: pipe.conditions(tensors, b, image, shape) for b in ("cond", "uncond")}
    n = model.num_blocks
    with torch.no_grad():
        for i, t in enumerate(sched.timesteps):
            out = {}
            for b, (kw, static) in conds.items():
                h, ctx = model.prepare(x, torch.tensor([t]), **kw, **static)
                if computes[i] or i < config.warmup or i >= steps - config.last_steps:
                    entry = h
                    for k in range(n - 1):
                        h = model.block(k, h, ctx)
                    residual[b] = tuple(a - e for a, e in zip(h, entry, strict=True))
                else:
                    h = tuple(e + r for e, r in zip(h, residual[b], strict=True))
                out[b] = model.final(model.block(n - 1, h, ctx), ctx, grid)
            g = pipe.guidance_for(None)
            v = out["uncond"] + g * (out["cond"] - out["uncond"])
            x = sched.step(i, v, x, lambda terms: sum(w * t for w, t in terms))
    return x


def test_deepcache_11_45_4_computes_25_of_50_and_matches_the_staged_reference():
    config = CMConfig(deepcache=DeepCacheConfig(start=11, end=45, interval=4))
    latents, traj, _ = run(JaxBackend, "hunyuanvideo-tiny", config)
    branches = traj.gate.summary()["branches"]
    for b in ("cond", "uncond"):
        assert branches[b]["total"] == 50 and branches[b]["skipped"] == 25
    assert sum(traj.stats.step_computed) == 25
    assert traj.stats.signal_reads == 0  # a schedule reads nothing from the device
    ref = deepcache_reference("hunyuanvideo-tiny", config)
    uncached = forward_reference("hunyuanvideo-tiny", 50)
    assert rel_err(latents, ref) < 1e-5
    assert rel_err(latents, uncached) > 1e-4  # the reuse really changed the result


@pytest.mark.parametrize("config", [
    CMConfig(deepcache=DeepCacheConfig()),
    CMConfig(teacache=TeaCacheConfig(threshold=0.2)),
    CMConfig(fbcache=FBCacheConfig(metric="residual_tensor_rel_l1", threshold=1.0, downsample=2)),
], ids=["deepcache", "teacache", "fbcache-tensor"])
def test_each_program_compiles_once_in_warmup_and_never_in_the_loop(config):
    _, traj, backend = run(JaxBackend, "hunyuanvideo-tiny", config, steps=20)
    assert traj.loop_compiles.lowered == 0 and traj.loop_compiles.backend == 0
    for name, program in backend.programs().items():
        assert program._cache_size() == 1, name
    assert traj.warmup_compiles.lowered >= 3
    skipped = traj.gate.summary()["branches"]["cond"]["skipped"]
    assert 0 < skipped < 20  # every path (compute, reuse) ran in the loop


def test_adaptive_gates_agree_between_jax_and_torch():
    """Same weights and inputs: the same decision trace on both backends (TeaCache, FBCache)."""
    for config in (CMConfig(teacache=TeaCacheConfig(threshold=0.2)),
                   CMConfig(fbcache=FBCacheConfig(metric="residual_tensor_rel_l1", threshold=1.0))):
        a, ja, _ = run(JaxBackend, "wan-tiny-ti2v", config, steps=20)
        b, tb, _ = run(TorchBackend, "wan-tiny-ti2v", config, steps=20)
        actions = [[(r["step"], r["branch"], r["action"]) for r in t.gate.telemetry.trace]
                   for t in (ja, tb)]
        assert actions[0] == actions[1]
        assert any(a[2] == "skip" for a in actions[0]) and any(a[2] == "compute" for a in actions[0])
        assert rel_err(a, b) < 1e-5


def test_wan_i2v_experts_switch_at_the_boundary_with_their_own_programs_weights_and_gate():
    config = CMConfig(teacache=TeaCacheConfig(threshold=0.3))
    latents, traj, backend = run(JaxBackend, "wan-tiny-i2v", config, steps=12)
    pipe = get_pipeline("wan-tiny-i2v")
    sched = make_scheduler(pipe.solver, 12, pipe.shift)
    want = ["high" if t >= 900 else "low" for t in sched.timesteps]
    assert traj.stats.step_expert == want and "high" in want and "low" in want
    summary = traj.gate.summary()
    assert summary["expert_switches"] == 1 and set(summary["experts"]) == {"high", "low"}
    # the first step of each expert phase computes (fresh gate state, warm-up)
    rows = [r for r in traj.gate.telemetry.trace if r["branch"] == "cond"]
    assert rows[want.index("low")]["reason"] == "warmup"
    # one compiled program serves both experts: the weights are arguments
    assert all(p._cache_size() == 1 for p in backend.programs().values())
    assert backend.params["high"] is not backend.params["low"]


def test_wan_i2v_guidance_pair_is_low_then_high():
    pipe, models, shape, image, tensors, _ = setup("wan-tiny-i2v")
    outs = {}
    for guidance in ((1.5, 5.0), (5.0, 1.5)):
        backend = TorchBackend(models, SignalPlan.from_config(CMConfig()))
        sample = make_sample(backend, pipe, tensors, shape, image=image, seed=0, guidance=guidance)
        traj = sample_once(backend, CMConfig(), sample, solver="unipc", steps=4, shift=5.0)
        outs[guidance] = traj.latents
    assert rel_err(outs[(1.5, 5.0)], outs[(5.0, 1.5)]) > 1e-3
    assert pipe.guidance_for("high", (1.5, 5.0)) == 5.0 and pipe.guidance_for("low", (1.5, 5.0)) == 1.5


def test_ti2v_image_mode_keeps_the_first_frame_and_feeds_per_token_timesteps():
    latents, _, _ = run(JaxBackend, "wan-tiny-ti2v", CMConfig(), steps=6, image=True)
    pipe, _, shape, _, tensors, _ = setup("wan-tiny-ti2v", image=True)
    assert torch.equal(latents[:, :, :1], tensors["image_latents"])
    t = pipe.timestep_input(700.0, shape, True)
    assert t.shape == (1, pipe.tokens(shape)) and (t[0, : pipe.tokens(shape) // shape[2]] == 0).all()
    ref = forward_reference("wan-tiny-ti2v", 6, image=True)
    assert rel_err(latents, ref) < 1e-5


def test_meanflow_feeds_the_next_timestep():
    a, _, _ = run(JaxBackend, "hunyuanvideo-tiny-meanflow", CMConfig(), steps=4)
    b, _, _ = run(TorchBackend, "hunyuanvideo-tiny-meanflow", CMConfig(), steps=4)
    assert rel_err(a, b) < 1e-5


def test_fused_cfg_is_one_batch_2_call_with_the_same_result():
    """--cfg_mode fused: cond and uncond in one call; caching off it equals two calls, and the
    pair's decisions agree between backends."""
    pipe, models, shape, image, tensors, _ = setup("wan-tiny-ti2v")
    out = {}
    for name, config, cls in (("separate", CMConfig(), JaxBackend),
                              ("fused", CMConfig(cfg_mode="fused"), JaxBackend),
                              ("fused-tc", CMConfig(cfg_mode="fused",
                                                    teacache=TeaCacheConfig(threshold=0.5)), JaxBackend),
                              ("fused-tc-torch", CMConfig(cfg_mode="fused",
                                                          teacache=TeaCacheConfig(threshold=0.5)),
                               TorchBackend)):
        backend = cls(models, SignalPlan.from_config(config))
        sample = make_sample(backend, pipe, tensors, shape, image=False, seed=0,
                             fused_cfg=config.cfg_mode == "fused")
        traj = sample_once(backend, config, sample, solver=pipe.solver, steps=10, shift=pipe.shift)
        out[name] = (backend.get(traj.latents), traj)
    assert rel_err(out["fused"][0], out["separate"][0]) < 1e-5
    assert out["fused"][1].stats.model_calls == 10 and out["separate"][1].stats.model_calls == 20
    traces = [[(r["step"], r["branch"], r["action"]) for r in out[k][1].gate.telemetry.trace]
              for k in ("fused-tc", "fused-tc-torch")]
    assert traces[0] == traces[1] and {b for _, b, _ in traces[0]} == {"pair"}
    assert {a for _, _, a in traces[0]} == {"compute", "skip"}
    assert out["fused-tc"][1].loop_compiles.lowered == 0


def test_fused_cfg_takes_a_negative_prompt_of_another_length():
    """Was: a traceback (torch.cat of [1, 16, D] and [1, 7, D]) for fused or cfg-parallel CFG
    when stage 1's negative prompt is shorter than the prompt. The conditions are zero-padded to
    text_len as the model pads them itself: the same numbers as the unpadded branch."""
    pipe, models, shape, _, tensors, _ = setup("wan-tiny-ti2v")
    tensors = {**tensors, "negative_prompt_embeds": tensors["negative_prompt_embeds"][:, :7]}
    conds, _ = pipe.conditions(tensors, "uncond", False, shape)
    assert conds["context"].shape[1] == pipe.config.text_len
    assert torch.equal(conds["context"][:, :7], tensors["negative_prompt_embeds"].float())
    model = models[pipe.experts[0][0]]
    x, t = torch.randn(shape), torch.tensor([500.0])
    with torch.no_grad():
        assert torch.equal(model(x, t, context=conds["context"]),
                           model(x, t, context=tensors["negative_prompt_embeds"].float()))
    out = {}
    for mode in ("separate", "fused"):
        backend = JaxBackend(models, SignalPlan.from_config(CMConfig(cfg_mode=mode)))
        sample = make_sample(backend, pipe, tensors, shape, image=False, seed=0,
                             fused_cfg=mode == "fused")
        traj = sample_once(backend, CMConfig(cfg_mode=mode), sample, solver=pipe.solver, steps=4,
                           shift=pipe.shift)
        out[mode] = backend.get(traj.latents)
    assert rel_err(out["fused"], out["separate"]) < 1e-5


def test_dry_run_samples_exactly_uncached_and_records_prospective_skips():
    off, _, _ = run(JaxBackend, "hunyuanvideo-tiny", CMConfig(teacache=TeaCacheConfig(threshold=0.0)),
                    steps=12)
    config = CMConfig(teacache=TeaCacheConfig(threshold=0.5, ema=0.3), noise_adapt="linear",
                      dry_run=True)
    dry, traj, _ = run(JaxBackend, "hunyuanvideo-tiny", config, steps=12)
    assert torch.equal(dry, off) and all(traj.stats.step_computed)
    assert any(r["action"] == "skip" for r in traj.gate.telemetry.trace)


@pytest.mark.parametrize("order", [1, 2])
def test_forecasting_runs_on_both_backends_without_loop_compiles(order):
    config = CMConfig(deepcache=DeepCacheConfig(start=3, end=16, interval=3), forecast=order)
    a, ta, _ = run(JaxBackend, "hunyuanvideo-tiny", config, steps=18)
    b, _, _ = run(TorchBackend, "hunyuanvideo-tiny", config, steps=18)
    plain, _, _ = run(JaxBackend, "hunyuanvideo-tiny", CMConfig(deepcache=config.deepcache), steps=18)
    assert ta.loop_compiles.lowered == 0 and rel_err(a, b) < 1e-5
    assert rel_err(a, plain) > 1e-6  # the forecast changed what the reuse steps added


def test_forecast_gate_runs_on_both_backends_without_loop_compiles():
    """The probe's reference is a forecast (a combination of stored first-block residuals):
    warm-up compiles it, both backends take the same decisions, and it changes them."""
    # the tiny random model is not smooth in t: its block-0 residual changes by about 1 a step
    fb = FBCacheConfig(threshold=2.5, metric="residual_tensor_rel_l1", accumulate=True)
    config = CMConfig(fbcache=fb, forecast=2, forecast_gate=True)
    a, ta, _ = run(JaxBackend, "wan-tiny-ti2v", config, steps=16)
    b, tb, _ = run(TorchBackend, "wan-tiny-ti2v", config, steps=16)
    actions = [[r["action"] for r in t.gate.telemetry.trace] for t in (ta, tb)]
    assert actions[0] == actions[1] and "skip" in actions[0]
    assert ta.loop_compiles.lowered == 0 and rel_err(a, b) < 1e-5
    _, plain, _ = run(TorchBackend, "wan-tiny-ti2v", CMConfig(fbcache=fb, forecast=2), steps=16)
    assert [r["rel"] for r in plain.gate.telemetry.trace] != [r["rel"] for r in tb.gate.telemetry.trace]


def test_scene_guard_reads_the_latent_change_on_both_backends():
    config = CMConfig(deepcache=DeepCacheConfig(start=2, end=18, interval=4), scene_guard=0.1)
    a, ta, _ = run(JaxBackend, "wan-tiny-ti2v", config, steps=20)
    b, tb, _ = run(TorchBackend, "wan-tiny-ti2v", config, steps=20)
    reasons = [[r["reason"] for r in t.gate.telemetry.trace] for t in (ta, tb)]
    assert reasons[0] == reasons[1] and "scene_change" in reasons[0] and "schedule_skip" in reasons[0]
    assert ta.loop_compiles.lowered == 0 and ta.stats.signal_reads == 40 and rel_err(a, b) < 1e-5

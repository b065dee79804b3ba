"""Remodulated reuse (CMConfig.remodulate): the middle's residual kept split by the time gates its
blocks share, rebuilt on a reuse step with that step's gates.

The oracle for what a reuse step should add is the model's own forward with each block's
self-attention, cross-attention and FFN outputs replaced (forward hooks) by those recorded at the
computed step: per-sub-layer reuse, what a per-module TaylorSeer of order 0 does.
"""

import dataclasses

import numpy as np
import pytest
import torch

from cache import CacheManager, CMConfig, ConfigError, DeepCacheConfig, Signals
from cache.flags import config_of
from cache.residuals import NumpyOps
from sampling.cache_cli import add_cache_arguments, cache_flags
from sampling.stages import Middle, SignalPlan, check_remodulate, local_context, remodulated
from tests.model_inputs import random_model, rel_err, wan_inputs
from tests.test_stage2_jax import run
from torch_backend.backend import TorchBackend
from tpu.backend import JaxBackend

PLAN = SignalPlan(fn_blocks=1, bn_blocks=1, remodulate=True)
SUBLAYERS = ("self_attn", "cross_attn", "ffn")


def _middle(model, x, t, context, y):
    """(hidden entering the window, ctx, hidden leaving it, parts) of one call."""
    with torch.no_grad():
        hidden, ctx = model.prepare(x, t, context, y)
        hidden = model.block(0, hidden, ctx)  # the probe block
        after, parts = Middle(model, PLAN)(hidden, tuple(ctx))
    return hidden, ctx, after, parts


@pytest.mark.parametrize("name,per_token", [("wan-tiny-ti2v", False), ("wan-tiny-ti2v", True),
                                             ("wan-tiny-i2v", False)])
def test_the_parts_rebuild_the_residual_of_their_own_step(name, per_token):
    model = random_model(name)
    x, t, context, y = wan_inputs(model.config, per_token=per_token)
    hidden, ctx, after, parts = _middle(model, x, t, context, y)
    assert len(parts) == 3 and all(p.shape == hidden.shape for p in parts)
    with torch.no_grad():
        assert rel_err(remodulated(model, hidden, ctx, parts), after) < 1e-6


def test_a_reuse_step_adds_what_per_sublayer_reuse_with_its_own_gates_adds():
    model = random_model("wan-tiny-ti2v")
    x, t, context, _ = wan_inputs(model.config, per_token=False)
    window = range(PLAN.fn_blocks, model.num_blocks - PLAN.bn_blocks)
    recorded, hooks = {}, []
    for i in window:
        for name in SUBLAYERS:
            module = getattr(model.blocks[i], name)
            hooks.append(module.register_forward_hook(
                lambda m, a, out, key=(i, name): recorded.__setitem__(key, out)))
    hidden_a, _, after_a, parts = _middle(model, x, t, context, None)
    for h in hooks:
        h.remove()
    # a later step: another latent, another timestep (so other gates)
    x_b, t_b = x * 0.7 + 0.1, t * 0.6
    for i in window:
        for name in SUBLAYERS:
            getattr(model.blocks[i], name).register_forward_hook(
                lambda m, a, out, key=(i, name): recorded[key])
    with torch.no_grad():
        hidden_b, ctx_b = model.prepare(x_b, t_b, context)
        hidden_b = model.block(0, hidden_b, ctx_b)
        oracle = hidden_b
        for i in window:
            oracle = model.block(i, oracle, ctx_b)
        ours = remodulated(model, hidden_b, ctx_b, parts)
    assert rel_err(ours, oracle) < 1e-5
    # plain reuse adds the residual with the computed step's gates: not the same
    assert rel_err(hidden_b + (after_a - hidden_a), oracle) > 1e-3


def test_s2v_parts_rebuild_the_residual_audio_injections_included():
    from tests.test_wan_s2v import TINY, s2v_inputs
    model = random_model(TINY)
    assert model.config.audio_inject_layers
    with torch.no_grad():
        hidden, ctx = model.prepare(**s2v_inputs(model.config))
        plan = SignalPlan(fn_blocks=0, bn_blocks=0, remodulate=True)
        after, parts = Middle(model, plan)(hidden, tuple(ctx))
        assert rel_err(remodulated(model, hidden, local_context(ctx), parts), after) < 1e-6


def test_a_model_with_per_block_gates_is_refused():
    with pytest.raises(ValueError, match="--remodulate.*HunyuanVideo15DiT"):
        check_remodulate(random_model("hunyuanvideo-tiny"))
    with pytest.raises(ValueError, match="--remodulate"):
        Middle(random_model("hunyuanvideo-tiny"), PLAN)
    check_remodulate(random_model("wan-tiny-ti2v"))  # the Wan family is accepted


def test_the_gate_stores_the_parts_and_hands_their_forecast_to_the_tail():
    """Golden: parts (k * step for k = 1, 2, 3) stored at steps 0 and 2 (DeepCache every 2);
    the reuse at step 1 gets step 0's as they are, the one at step 3 each part extrapolated
    linearly (3k), and both keep x as it is (the tail adds the rebuilt residual)."""
    config = CMConfig(deepcache=DeepCacheConfig(start=0, end=4, interval=2), forecast=1,
                      remodulate=True, warmup=0, last_steps=0, bn_blocks=0)
    gate = CacheManager(config, NumpyOps())
    gate.attach(4)
    x = np.zeros(3)
    actions, handed = [], {}
    for step in range(4):
        gate.begin_step("cond")
        applied = gate.apply(gate.decide(Signals()), x)
        actions.append("S" if applied.decision.skip else "C")
        if applied.decision.skip:
            assert applied.x is x and len(applied.tail) == 1
            handed[step] = [float(p[0]) for p in applied.tail[0]]
        else:
            parts = tuple(np.full(3, float(step * k)) for k in (1, 2, 3))
            gate.update(applied.decision, x, x + 1, residual=parts)
    assert "".join(actions) == "CSCS"
    assert handed == {1: [0.0, 0.0, 0.0], 3: pytest.approx([3.0, 6.0, 9.0])}


def test_parts_of_another_shape_fall_back_to_compute():
    config = CMConfig(deepcache=DeepCacheConfig(start=0, end=4, interval=2), remodulate=True,
                      warmup=0, last_steps=0, bn_blocks=0)
    gate = CacheManager(config, NumpyOps())
    gate.attach(4)
    gate.begin_step("cond")
    d = gate.decide(Signals())
    gate.update(gate.apply(d, np.zeros(3)).decision, np.zeros(3), np.ones(3),
                residual=(np.zeros(3), np.zeros(3), np.zeros(3)))
    gate.begin_step("cond")
    applied = gate.apply(gate.decide(Signals()), np.zeros(5))  # another token count
    assert not applied.decision.skip and applied.decision.failsafe is not None


def test_flag_and_config():
    import argparse
    ap = argparse.ArgumentParser()
    add_cache_arguments(ap)
    args = ap.parse_args(["--enable_cache", "--cache_type", "deepcache", "--remodulate", "true"])
    assert config_of(cache_flags(args)).remodulate is True
    with pytest.raises(ConfigError, match="remodulate"):
        CMConfig(remodulate="yes")


@pytest.mark.parametrize("config", [
    CMConfig(deepcache=DeepCacheConfig(start=3, end=16, interval=3), forecast=1, remodulate=True),
    CMConfig(deepcache=DeepCacheConfig(start=3, end=16, interval=3), remodulate=True,
             bn_blocks=2, bn_ids=(1,)),
], ids=["forecast1", "bn_ids"])
def test_remodulated_reuse_runs_on_both_backends_without_loop_compiles(config):
    a, ta, _ = run(JaxBackend, "wan-tiny-ti2v", config, steps=18)
    b, tb, _ = run(TorchBackend, "wan-tiny-ti2v", config, steps=18)
    assert ta.loop_compiles.lowered == 0 and ta.loop_compiles.backend == 0
    assert rel_err(a, b) < 1e-5
    assert [r["action"] for r in ta.gate.telemetry.trace].count("skip") > 0
    unrolled, _, _ = run(JaxBackend, "wan-tiny-ti2v", config, steps=18, scan_blocks=False)
    assert torch.equal(a, unrolled)  # the scanned middle carries the sums
    plain, _, _ = run(TorchBackend, "wan-tiny-ti2v", dataclasses.replace(config, remodulate=False),
                      steps=18)
    assert rel_err(b, plain) > 1e-6  # the reuse steps added something else


def test_stage2_refuses_it_for_hunyuanvideo_before_any_work(tmp_path, capsys):
    import stage2_transformer_flax_deepcache as stage2
    from tests.test_refusals import refused
    out = tmp_path / "out"
    refused(stage2.main, ["--model", "hunyuanvideo-tiny", "--enable_cache", "--remodulate", "true",
                          "--output_dir", str(out)], capsys,
            "hunyuanvideo-tiny: --remodulate", "Wan2.2 family", "leave --remodulate off")
    assert not out.exists()

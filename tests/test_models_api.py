"""The staged API, input checks, real-size configs on the meta device, and traceability."""

from __future__ import annotations

import pytest
import torch

from modules.layers import ModelConfigError
from modules.registry import MODEL_NAMES, build_model, get_config
from tests.model_inputs import Positional, hy_inputs, random_model, rel_err, wan_inputs


def test_wan_forward_is_the_stages_in_order():
    model = random_model("wan-tiny-ti2v")
    x, t, context, y = wan_inputs(model.config, per_token=True)
    with torch.no_grad():
        want = model(x, t, context, y)
        grid = model.grid(x.shape)
        h, ctx = model.prepare(x, t, context, y, rope=model.rope(grid))
        assert h.dtype == torch.float32 and ctx.e0.shape == (2, 18, 6, 24)
        for i in range(model.num_blocks):
            h = model.block(i, h, ctx)
        got = model.final(h, ctx, grid)
    assert torch.equal(got, want)


def test_hunyuan_forward_is_the_stages_in_order():
    model = random_model("hunyuanvideo-tiny")
    kw = hy_inputs(model.config, i2v=True)
    with torch.no_grad():
        want = model(**kw)
        grid = model.grid(kw["x"].shape)
        hidden, ctx = model.prepare(**kw)
        img, txt = hidden
        assert img.shape == (2, 60, 16) and txt.shape == (2, model.config.context_len, 16)
        assert ctx.key_mask.shape == (2, 60 + model.config.context_len)
        for i in range(model.num_blocks):
            hidden = model.block(i, hidden, ctx)
        got = model.final(hidden, ctx, grid)
    assert torch.equal(got, want)


def test_signatures():
    wan = random_model("wan-tiny-i2v")
    x, t, context, y = wan_inputs(wan.config, per_token=False)
    with torch.no_grad():
        h, ctx = wan.prepare(x, t, context, y)
        assert wan.signature("modulated_input", h, ctx).shape == h.shape
        assert wan.signature("time_embedding", h, ctx) is ctx.e
        assert wan.signature("time_projection", h, ctx) is ctx.e0
        # The modulated input depends on t through block 0's modulation.
        h2, ctx2 = wan.prepare(x, t - 100, context, y)
        assert not torch.equal(wan.signature("modulated_input", h2, ctx2),
                               wan.signature("modulated_input", h, ctx))
    with pytest.raises(ModelConfigError, match="unknown signature 'bogus'"):
        wan.signature("bogus", h, ctx)
    hy = random_model("hunyuanvideo-tiny")
    with torch.no_grad():
        hidden, ctx = hy.prepare(**hy_inputs(hy.config, i2v=False))
        assert hy.signature("modulated_input", hidden, ctx).shape == hidden[0].shape


def test_signature_names_match_the_gate():
    from cache.teacache_profiles import PROFILES
    wan = random_model("wan-tiny-ti2v")
    hy = random_model("hunyuanvideo-tiny")
    x, t, context, y = wan_inputs(wan.config, per_token=True)
    with torch.no_grad():
        wan_state = wan.prepare(x, t, context, y)
        hy_state = hy.prepare(**hy_inputs(hy.config, i2v=False))
    for name, profile in PROFILES.items():
        model, state = (hy, hy_state) if name.startswith("hunyuan") else (wan, wan_state)
        assert model.signature(profile.signal, *state) is not None


def test_t2v_ignores_vision_and_i2v_needs_it():
    model = random_model("hunyuanvideo-tiny")
    kw = hy_inputs(model.config, i2v=False)
    with torch.no_grad():
        out = model(**kw)
    assert torch.isfinite(out).all()
    with pytest.raises(ModelConfigError, match="i2v=True needs cond"):
        model(**{**kw, "i2v": True})


@pytest.mark.parametrize("change, message", [
    (dict(x=torch.zeros(2, 5, 3, 4, 6)), r"expected \[B, 12, F, H, W\]"),
    (dict(y=None), "I2V needs y"),
    (dict(t=torch.zeros(2, 7)), r"expected \[2\] or \[2, 18\]"),
    (dict(context=torch.zeros(2, 17, 16)), r"expected \[2, <= 16, 16\]"),
    (dict(x=torch.zeros(2, 4, 3, 5, 6), y=torch.zeros(2, 8, 3, 5, 6)), "multiples of the patch"),
])
def test_wan_rejects_bad_shapes(change, message):
    model = build_model("wan-tiny-i2v")
    x, t, context, y = wan_inputs(model.config, per_token=False)
    kw = dict(x=x, t=t, context=context, y=y) | change
    with pytest.raises(ModelConfigError, match=message):
        model(**kw)


def test_hunyuan_rejects_bad_shapes():
    model = build_model("hunyuanvideo-tiny")
    kw = hy_inputs(model.config, i2v=False)
    with pytest.raises(ModelConfigError, match=r"expected \[2, 10, 16\]"):
        model(**{**kw, "text": torch.zeros(2, 9, 16)})
    with pytest.raises(ModelConfigError, match="timestep_r is required by, and only by"):
        model(**{**kw, "timestep_r": torch.zeros(2)})


@pytest.mark.parametrize("name, keys, params", [
    ("wan2.2-ti2v-5b", 825, 5.00e9),
    ("wan2.2-i2v-a14b-high", 1095, 14.29e9),
    ("wan2.2-i2v-a14b-low", 1095, 14.29e9),
    ("hunyuanvideo-1.5-720p_t2v", 1793, 8.33e9),
    ("hunyuanvideo-1.5-480p_i2v_step_distilled", 1797, 8.33e9),
])
def test_real_size_configs_on_meta(name, keys, params):
    model = build_model(name, meta=True)
    assert len(model.state_dict()) == keys
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - params) / params < 0.005
    assert all(p.is_meta for p in model.parameters())


def test_every_named_config_builds():
    for name in MODEL_NAMES:
        assert build_model(name, meta=True).config == get_config(name)
    with pytest.raises(ModelConfigError, match="unknown model 'wan3'"):
        get_config("wan3")


def test_models_trace_under_torchax():
    """jax.jit of whole forwards: no .item(), boolean indexing, complex or random op inside."""
    from compat.torchax_compat import import_torchax
    torchax = import_torchax()
    env = torchax.default_env()

    names = ("x", "t", "text", "text_mask", "byt5", "byt5_mask", "cond", "vision")

    wan = random_model("wan-tiny-ti2v")
    wan_args = wan_inputs(wan.config, per_token=True)[:3]
    hy = random_model("hunyuanvideo-tiny")
    kw = hy_inputs(hy.config, i2v=True)
    cases = ((Positional(wan, ("x", "t", "context")), wan_args),
             (Positional(hy, names, i2v=True), tuple(kw[n] for n in names)))
    for module, args in cases:
        with torch.no_grad():
            want = module(*args)
        jitted = torchax.compile(module)
        with env, torch.no_grad():
            jitted.params, jitted.buffers = env.to_xla(jitted.params), env.to_xla(jitted.buffers)
            got = jitted(*env.to_xla(args)).torch()
        assert got.shape == want.shape and rel_err(got, want) < 1e-5

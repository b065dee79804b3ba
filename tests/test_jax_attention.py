"""The JAX attention lowerings (tpu/attention.py) against ops._attention_reference, on CPU.

Splash runs in the Pallas interpreter here; on a TPU the same code runs compiled.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
import torch

from compat.torchax_compat import import_torchax
from modules import ops
from tests.model_inputs import Positional, hy_inputs, random_model, rel_err, wan_inputs
from tpu import attention

torchax = import_torchax()
env = torchax.default_env()

# Small blocks so that short sequences span several kv blocks (online softmax across blocks,
# a fully masked block in the middle).
SMALL_BLOCKS = dict(block_q=128, block_kv=256, block_kv_compute=128)

LOWERINGS = {
    "jax_dpa": attention.dot_product_attention,
    "splash_interpret": functools.partial(attention.splash_attention, interpret=True),
    "splash_interpret_small_blocks": functools.partial(attention.splash_attention,
                                                       interpret=True, **SMALL_BLOCKS),
}


@pytest.fixture
def registry_restored():
    """Install the lowerings; afterwards the attention registry is as it was found."""
    names, chosen = ops.implementations("attention"), ops.active()
    attention.install()
    yield
    for name in set(ops.implementations("attention")) - set(names):
        ops.unregister("attention", name)
    ops.select(**chosen)


def qkv_mask(q_len, kv_len, mask, *, batch=2, heads=2, head_dim=16, seed=0):
    """CPU q, k, v [B, L|S, N, H] and a key mask: None, "all", or "holes" (differs per sample)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_len, heads, head_dim, generator=gen)
    k = torch.randn(batch, kv_len, heads, head_dim, generator=gen)
    v = torch.randn(batch, kv_len, heads, head_dim, generator=gen)
    if mask is None:
        return q, k, v, None
    key_mask = torch.ones(batch, kv_len, dtype=torch.bool)
    if mask == "holes":
        key_mask = torch.rand(batch, kv_len, generator=gen) > 0.4
        key_mask[:, 0] = True  # every row keeps a valid key (the ops.attention contract)
        key_mask[0, kv_len // 3: 2 * kv_len // 3] = False  # a run of padding in the middle
    return q, k, v, key_mask


CASES = {
    "holes": (40, 40, "holes"),
    "all_true": (40, 40, "all"),
    "none": (40, 40, None),
    "cross_text16": (30, 16, None),  # Wan cross-attention: 16 text tokens
    "cross_text16_holes": (30, 16, "holes"),
    "not_128_multiples": (200, 300, "holes"),  # several kv blocks with SMALL_BLOCKS
    "not_128_multiples_none": (300, 200, None),
}


# Small blocks only matter where a sequence is longer than 128.
LOWERING_CASES = [(lowering, case) for lowering in LOWERINGS for case in CASES
                  if lowering != "splash_interpret_small_blocks" or case.startswith("not_128")]


@pytest.mark.parametrize("lowering, case", LOWERING_CASES)
def test_lowering_matches_reference(lowering, case):
    q, k, v, key_mask = qkv_mask(*CASES[case])
    want = ops._attention_reference(q, k, v, key_mask)
    with env:
        got = LOWERINGS[lowering](*env.to_xla((q, k, v, key_mask))).torch()
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_lowering_inside_a_jitted_torchax_function(lowering):
    q, k, v, key_mask = qkv_mask(*CASES["not_128_multiples"])
    want = ops._attention_reference(q, k, v, key_mask)

    def attend_then_scale(q, k, v, key_mask):
        return LOWERINGS[lowering](q, k, v, key_mask) * 2.0

    jitted = torchax.interop.jax_jit(attend_then_scale)
    with env:
        got = jitted(*env.to_xla((q, k, v, key_mask))).torch()
    assert rel_err(got, 2.0 * want) < 1e-5


def test_plain_cpu_tensors_are_refused_with_a_hint():
    q, k, v, key_mask = qkv_mask(8, 8, "holes")
    with pytest.raises(TypeError, match="torchax tensors"):
        attention.dot_product_attention(q, k, v, key_mask)


def test_splash_plan_pads_little_and_validates():
    # Short sequences: one block, clamped to the 128-padded length.
    assert attention.splash_plan(30, 16) == attention.SplashPlan(128, 128, 128, 128, 128)
    # 3000 queries: two balanced 1536-row blocks rather than two of 2048.
    assert attention.splash_plan(3000, 3000).block_q == 1536
    assert attention.splash_plan(3000, 3000).padded_q_len == 3072
    for q_len, kv_len in ((1, 1), (300, 200), (4097, 13000), (75348, 75348)):
        plan = attention.splash_plan(q_len, kv_len)
        assert plan.padded_q_len % plan.block_q == 0 and plan.padded_kv_len % plan.block_kv == 0
        assert plan.block_kv % plan.block_kv_compute == 0
        assert all(b % 128 == 0 for b in plan[:3])
        assert plan.block_q <= attention.BLOCK_Q and plan.block_kv <= attention.BLOCK_KV
        assert q_len <= plan.padded_q_len < q_len + 128 * (plan.padded_q_len // plan.block_q)
    with pytest.raises(ValueError, match="multiple of 128"):
        attention.splash_plan(10, 10, block_q=100)
    with pytest.raises(ValueError, match="multiple of block_kv_compute"):
        attention.splash_plan(10, 10, block_kv=384, block_kv_compute=256)


def test_install_is_idempotent_and_leaves_defaults(registry_restored):
    attention.install()
    names = ops.implementations("attention")
    assert {"jax_dpa", "splash", "splash_interpret"} <= set(names)
    assert len(names) == len(set(names))
    with ops.use(attention="splash_interpret"):
        assert ops.active()["attention"] == "splash_interpret"
    assert ops.active()["attention"] == ops.DEFAULTS["attention"]
    assert attention.default_attention() == "jax_dpa"  # CPU here; "splash" on a TPU


def _wan_case():
    wan = random_model("wan-tiny-ti2v")
    return Positional(wan, ("x", "t", "context")), wan_inputs(wan.config, per_token=True)[:3]


def _hy_case():
    hy = random_model("hunyuanvideo-tiny")
    kw = hy_inputs(hy.config, i2v=True)  # key masks [image | vision | byT5 | text] with holes
    names = ("x", "t", "text", "text_mask", "byt5", "byt5_mask", "cond", "vision")
    return Positional(hy, names, i2v=True), tuple(kw[n] for n in names)


@pytest.mark.parametrize("model_case, impl", [
    (_wan_case, "jax_dpa"), (_hy_case, "jax_dpa"), (_hy_case, "splash_interpret")])
def test_jitted_model_forward_matches_torch_eager(registry_restored, monkeypatch, model_case, impl):
    kernel = {"jax_dpa": "_dot_product_attention_jax",
              "splash_interpret": "_splash_attention_jax"}[impl]
    traced = []
    inner = getattr(attention, kernel)
    monkeypatch.setattr(attention, kernel, lambda *a, **kw: traced.append(1) or inner(*a, **kw))
    module, args = model_case()
    with torch.no_grad():
        want = module(*args)
    jitted = torchax.compile(module)
    with env, torch.no_grad(), ops.use(attention=impl):  # chosen when the forward is traced
        jitted.params, jitted.buffers = env.to_xla(jitted.params), env.to_xla(jitted.buffers)
        got = jitted(*env.to_xla(args)).torch()
    assert traced, f"{impl} was not called: the forward did not dispatch through ops.attention"
    assert got.shape == want.shape and rel_err(got, want) < 1e-5


def test_the_fused_cudnn_kernel_is_chosen_on_a_gpu_only_where_it_applies(monkeypatch):
    """cuDNN flash for an unmasked bf16/fp16 call with a head dim it tiles, on a GPU; XLA for the
    rest (fp32, a key mask, a head dim over 128 or not a multiple of 8, the CPU, or turned off)."""
    def q(dtype=jnp.bfloat16, head_dim=128):
        return jax.ShapeDtypeStruct((1, 16, 2, head_dim), dtype)

    mask = jnp.ones((1, 16), jnp.bool_)
    assert attention.implementation_for(q(), None, "gpu") == "cudnn"
    assert attention.implementation_for(q(jnp.float16, 64), None, "gpu") == "cudnn"
    assert attention.implementation_for(q(jnp.float32), None, "gpu") is None
    assert attention.implementation_for(q(), mask, "gpu") is None
    assert attention.implementation_for(q(head_dim=256), None, "gpu") is None
    assert attention.implementation_for(q(head_dim=60), None, "gpu") is None
    assert attention.implementation_for(q(), None, "cpu") is None
    assert attention.implementation_for(q(), None) is None  # this machine's JAX: the CPU
    monkeypatch.setattr(attention, "fused_on_gpu", False)
    assert attention.implementation_for(q(), None, "gpu") is None

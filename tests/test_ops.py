"""Every dispatched op: each registered implementation agrees with the reference on CPU."""

from __future__ import annotations

import pytest
import torch

from modules import ops


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _inputs(op):
    g = _gen()
    x = torch.randn(2, 7, 3, 8, generator=g)  # [B, L, N, H] or [B, L, D] below
    if op == "rms_norm":
        return (torch.randn(2, 7, 24, generator=g), torch.randn(24, generator=g), 1e-6)
    if op == "layer_norm":
        return (torch.randn(2, 7, 24, generator=g) * 3 + 1, torch.randn(24, generator=g),
                torch.randn(24, generator=g), 1e-6)
    if op == "layer_norm_modulate":  # per-token modulation, as TI2V has
        return (torch.randn(2, 7, 24, generator=g) * 3 + 1, torch.randn(2, 7, 24, generator=g),
                torch.randn(2, 7, 24, generator=g), 1e-6)
    if op == "rope":
        angle = torch.rand(7, 4, generator=g) * 20
        return (x, angle.cos(), angle.sin())
    if op == "attention":
        mask = torch.ones(2, 5, dtype=torch.bool)
        mask[1, 3:] = False
        return (x, torch.randn(2, 5, 3, 8, generator=g), torch.randn(2, 5, 3, 8, generator=g), mask)
    raise AssertionError(op)


CASES = [(op, name) for op in ops.OPS for name in ops.implementations(op) if name != "reference"]


@pytest.mark.parametrize("op, name", CASES)
def test_implementation_agrees_with_reference(op, name):
    args = _inputs(op)
    fn = getattr(ops, op)
    with ops.use(**{op: "reference"}):
        want = fn(*args)
    with ops.use(**{op: name}):
        got = fn(*args)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_every_op_has_a_reference_and_a_fused_formulation():
    for op in ops.OPS:
        assert "reference" in ops.implementations(op)
        assert len(ops.implementations(op)) >= 2, op


def test_layer_norm_modulate_single_vector_uses_the_layer_norm_weight_path():
    """Batch 1 with one modulation vector: weight = 1 + scale, bias = shift (seed 004)."""
    g = _gen(3)
    x = torch.randn(1, 9, 24, generator=g)
    shift, scale = torch.randn(1, 1, 24, generator=g), torch.randn(1, 1, 24, generator=g)
    with ops.use(layer_norm_modulate="reference"):
        want = ops.layer_norm_modulate(x, shift, scale, 1e-6)
    with ops.use(layer_norm_modulate="fused"):
        got = ops.layer_norm_modulate(x, shift, scale, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rope_rotates_interleaved_pairs():
    """Pair (0, 1) at angle pi/2 maps (a, b) to (-b, a); an unrotated pair is unchanged."""
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
    cos = torch.tensor([[0.0, 1.0]])
    sin = torch.tensor([[1.0, 0.0]])
    for name in ops.implementations("rope"):
        with ops.use(rope=name):
            out = ops.rope(x, cos, sin)
        torch.testing.assert_close(out.flatten(), torch.tensor([-2.0, 1.0, 3.0, 4.0]))


def test_masked_keys_do_not_contribute():
    g = _gen(5)
    q, k, v = (torch.randn(1, 4, 2, 8, generator=g) for _ in range(3))
    mask = torch.tensor([[True, True, False, False]])
    for name in ops.implementations("attention"):
        if ops.implementation("attention", name).__module__.startswith(("tpu.", "sharding.")):
            continue  # JAX lowerings take torchax tensors (tests/test_jax_attention.py)
        with ops.use(attention=name):
            full = ops.attention(q, k[:, :2], v[:, :2])
            masked = ops.attention(q, k, v * torch.tensor([1, 1, 1e6, -1e6])[None, :, None, None],
                                   mask)
        torch.testing.assert_close(masked, full, rtol=1e-5, atol=1e-5)


def test_selection_errors_and_scoping():
    before = ops.active()
    assert before == ops.DEFAULTS
    with pytest.raises(ops.OpError, match="no implementation 'flash9' of op 'attention'"):
        ops.select(attention="flash9")
    with pytest.raises(ops.OpError, match="unknown op 'gelu'"):
        ops.select(gelu="reference")
    with ops.use(attention="reference", rope="fused"):
        assert ops.active()["attention"] == "reference"
        assert ops.active()["rope"] == "fused"
    assert ops.active() == before


def test_accelerate_picks_registered_kernels_only():
    try:
        assert ops.accelerate("cpu") == ops.DEFAULTS  # nothing faster registered for CPU
        chosen = ops.accelerate("cuda")
        assert chosen["rms_norm"] == "fused" and chosen["attention"] == "sdpa"
        chosen = ops.accelerate("npu")  # without torch_npu nothing changes
        assert chosen["rope"] == ("npu" if ops.NPU_AVAILABLE else "reference")
    finally:
        ops.reset()


def test_a_backend_can_register_its_own_lowering():
    calls = []

    def counting_attention(q, k, v, key_mask):
        calls.append(q.shape)
        return torch.zeros_like(q)

    ops.register("attention", "test-double", counting_attention)
    try:
        with ops.use(attention="test-double"):
            out = ops.attention(*_inputs("attention"))
        assert calls == [(2, 7, 3, 8)] and not out.any()
    finally:
        ops.unregister("attention", "test-double")

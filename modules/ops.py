"""One dispatch point per hot op, so fused kernels plug in without touching the model files.

The models call `rms_norm`, `layer_norm`, `layer_norm_modulate`, `rope` and `attention` from here.
Each op has a `reference` torch implementation (the official code's maths, fp32 inside) and a
`fused` formulation: the maths a fused kernel computes (F.rms_norm, LayerNorm with weight =
1 + scale and bias = shift as in seed 004, multiply-by-rotated RoPE as `npu_rotary_mul`, SDPA).
Ascend kernels register when `torch_npu` imports; the JAX backend registers its lowering itself.

Tensor names carry their layout: B batch, L tokens, N heads, H head dim, D model dim,
P = H/2 rotary pairs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

OPS = ("rms_norm", "layer_norm", "layer_norm_modulate", "rope", "attention")

# The one place the default implementation of each op is chosen.
DEFAULTS = {
    "rms_norm": "reference",
    "layer_norm": "reference",
    "layer_norm_modulate": "reference",
    "rope": "reference",
    # SDPA never materialises the L x L score matrix on CUDA/NPU-capable builds; on CPU it
    # agrees with the reference to float rounding (tests/test_ops.py).
    "attention": "sdpa",
}

_IMPLS: dict[str, dict[str, Callable]] = {op: {} for op in OPS}
_ACTIVE: dict[str, Callable] = {}


class OpError(ValueError):
    """An unknown op or implementation name."""


def register(op: str, name: str, fn: Callable) -> None:
    """Add an implementation of `op` under `name` (a backend calls this for its kernels)."""
    _check_op(op)
    _IMPLS[op][name] = fn


def unregister(op: str, name: str) -> None:
    """Remove an implementation; if it was in use, the op goes back to its default."""
    _check_op(op)
    fn = _IMPLS[op].pop(name, None)
    if fn is not None and _ACTIVE.get(op) is fn:
        select(**{op: DEFAULTS[op]})


def implementation(op: str, name: str) -> Callable:
    """The function registered as `name` for `op` (a wrapper calls it around its own work)."""
    _check_op(op)
    if name not in _IMPLS[op]:
        raise OpError(f"no implementation {name!r} of op {op!r}; registered: {sorted(_IMPLS[op])}")
    return _IMPLS[op][name]


def implementations(op: str) -> tuple[str, ...]:
    _check_op(op)
    return tuple(_IMPLS[op])


def active() -> dict[str, str]:
    """op -> name of the implementation in use."""
    names = {}
    for op, fn in _ACTIVE.items():
        names[op] = next(n for n, f in _IMPLS[op].items() if f is fn)
    return names


def select(**choices: str) -> None:
    """Use these implementations from now on, e.g. `select(attention="reference")`."""
    resolved = {}
    for op, name in choices.items():
        _check_op(op)
        if name not in _IMPLS[op]:
            raise OpError(f"no implementation {name!r} of op {op!r}; registered: "
                          f"{sorted(_IMPLS[op])}")
        resolved[op] = _IMPLS[op][name]
    _ACTIVE.update(resolved)


@contextlib.contextmanager
def use(**choices: str) -> Iterator[None]:
    """`select` for the duration of a `with` block."""
    before = dict(_ACTIVE)
    select(**choices)
    try:
        yield
    finally:
        _ACTIVE.clear()
        _ACTIVE.update(before)


def reset() -> None:
    select(**DEFAULTS)


def _check_op(op: str) -> None:
    if op not in _IMPLS:
        raise OpError(f"unknown op {op!r}; expected one of {OPS}")


# --- the dispatch points the models call -------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, statistics in fp32, result in x's dtype."""
    return _ACTIVE["rms_norm"](x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """LayerNorm over the last dim in fp32; returns fp32 (the models' fp32 islands)."""
    return _ACTIVE["layer_norm"](x, weight, bias, eps)


def layer_norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """LN(x) * (1 + scale) + shift, no affine LN, fp32 result; shift/scale broadcast to x."""
    return _ACTIVE["layer_norm_modulate"](x, shift, scale, eps)


def rope(x_BLNH: torch.Tensor, cos_LP: torch.Tensor, sin_LP: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotary embedding: pair (2i, 2i+1) rotates by the angle of column i."""
    return _ACTIVE["rope"](x_BLNH, cos_LP, sin_LP)


def attention(q_BLNH: torch.Tensor, k_BSNH: torch.Tensor, v_BSNH: torch.Tensor,
              key_mask_BS: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(H)) v over keys whose mask is True; [B, L, N, H] in q's dtype.

    Only a key-padding mask exists: padded query rows produce finite values nobody reads
    (model_spec trap T21), and every row keeps at least one valid key.
    """
    return _ACTIVE["attention"](q_BLNH, k_BSNH, v_BSNH, key_mask_BS)


# --- reference implementations (the official maths) --------------------------------------------

def _rms_norm_reference(x, weight, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.type_as(x) * weight


def _layer_norm_reference(x, weight, bias, eps):
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps)


def _layer_norm_modulate_reference(x, shift, scale, eps):
    return F.layer_norm(x.float(), (x.shape[-1],), None, None, eps) * (1 + scale) + shift


def _rope_reference(x, cos, sin):
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    c, s = cos[None, :, None, :].float(), sin[None, :, None, :].float()
    out = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    return out.type_as(x)


def _additive_key_mask(key_mask, dtype):
    # finfo.min rather than -inf: a row with no valid key stays finite (T21).
    return torch.where(key_mask, 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None, :]


def _attention_reference(q, k, v, key_mask):
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("blnh,bsnh->bnls", q.float(), k.float()) * scale
    if key_mask is not None:
        scores = scores + _additive_key_mask(key_mask, scores.dtype)
    probs = scores.softmax(dim=-1)
    return torch.einsum("bnls,bsnh->blnh", probs, v.float()).to(q.dtype)


# --- fused formulations -------------------------------------------------------------------------

def _rms_norm_fused(x, weight, eps):
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).type_as(x) * weight


def _layer_norm_fused(x, weight, bias, eps):
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y


def _layer_norm_modulate_fused(x, shift, scale, eps):
    """Seed 004: one LayerNorm with weight = 1 + scale and bias = shift.

    A LayerNorm kernel takes a [D] weight, so this path applies when one modulation vector
    serves every token (batch 1, per-sample timestep); otherwise the same maths, decomposed.
    """
    d = x.shape[-1]
    if scale.numel() == d and shift.numel() == d:
        return F.layer_norm(x.float(), (d,), (1 + scale.float()).reshape(d),
                            shift.float().reshape(d), eps)
    return _layer_norm_fused(x, None, None, eps) * (1 + scale) + shift


def _rope_fused(x, cos, sin):
    """`x * cos + rotate(x) * sin` with pair-repeated tables (npu_rotary_mul, interleave mode)."""
    xf = x.float()
    c = cos.float().repeat_interleave(2, dim=-1)[None, :, None, :]
    s = sin.float().repeat_interleave(2, dim=-1)[None, :, None, :]
    rotated = torch.stack([-xf[..., 1::2], xf[..., 0::2]], dim=-1).flatten(-2)
    return (xf * c + rotated * s).type_as(x)


def _attention_sdpa(q, k, v, key_mask):
    mask = None if key_mask is None else key_mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


for _op, _name, _fn in (
    ("rms_norm", "reference", _rms_norm_reference),
    ("rms_norm", "fused", _rms_norm_fused),
    ("layer_norm", "reference", _layer_norm_reference),
    ("layer_norm", "fused", _layer_norm_fused),
    ("layer_norm_modulate", "reference", _layer_norm_modulate_reference),
    ("layer_norm_modulate", "fused", _layer_norm_modulate_fused),
    ("rope", "reference", _rope_reference),
    ("rope", "fused", _rope_fused),
    ("attention", "reference", _attention_reference),
    ("attention", "sdpa", _attention_sdpa),
):
    register(_op, _name, _fn)


# --- Ascend kernels (seed 004), registered only where torch_npu imports ------------------------

def _register_npu() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers the npu device with torch)

    def rms_norm_npu(x, weight, eps):
        return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]

    def layer_norm_npu(x, weight, bias, eps):
        d = x.shape[-1]
        return torch_npu.npu_layer_norm_eval(x.float(), normalized_shape=[d], weight=weight,
                                             bias=bias, eps=eps)

    def layer_norm_modulate_npu(x, shift, scale, eps):
        d = x.shape[-1]
        if scale.numel() != d or shift.numel() != d:
            return _layer_norm_modulate_fused(x, shift, scale, eps)
        return torch_npu.npu_layer_norm_eval(x.float(), normalized_shape=[d],
                                             weight=(1 + scale.float()).reshape(d),
                                             bias=shift.float().reshape(d), eps=eps)

    def rope_npu(x, cos, sin):
        c = cos.repeat_interleave(2, dim=-1)[None, :, None, :].to(x.dtype)
        s = sin.repeat_interleave(2, dim=-1)[None, :, None, :].to(x.dtype)
        return torch_npu.npu_rotary_mul(x.contiguous(), c, s, rotary_mode="interleave")

    def attention_npu(q, k, v, key_mask):
        n = q.shape[2]
        # npu_fusion_attention masks where the mask is True: invert the key-valid mask.
        mask = None if key_mask is None else (~key_mask)[:, None, None, :].expand(
            -1, 1, q.shape[1], -1)
        return torch_npu.npu_fusion_attention(
            q, k, v, head_num=n, input_layout="BSND", atten_mask=mask,
            scale=1.0 / math.sqrt(q.shape[-1]), pre_tockens=2147483647,
            next_tockens=2147483647, sparse_mode=0)[0]

    register("rms_norm", "npu", rms_norm_npu)
    register("layer_norm", "npu", layer_norm_npu)
    register("layer_norm_modulate", "npu", layer_norm_modulate_npu)
    register("rope", "npu", rope_npu)
    register("attention", "npu", attention_npu)
    return True


NPU_AVAILABLE = _register_npu()

# What `accelerate(device_type)` switches to, per device type, when registered.
ACCELERATED = {
    "cuda": {"rms_norm": "fused", "layer_norm": "reference", "rope": "reference",
             "layer_norm_modulate": "reference", "attention": "sdpa"},
    "npu": {op: "npu" for op in OPS},
}


def accelerate(device_type: str) -> dict[str, str]:
    """Select the fastest registered implementation of each op for a device type.

    Unknown device types and unregistered kernels keep the current choice. Returns the
    resulting `active()` map so a backend can log it.
    """
    wanted = ACCELERATED.get(device_type, {})
    select(**{op: name for op, name in wanted.items() if name in _IMPLS[op]})
    return active()


reset()

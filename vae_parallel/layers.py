"""Patch-parallel versions of a VAE decoder's spatial layers, installed from outside on the
diffusers modules for the duration of a decode (forward pre-hooks, padding attributes set to 0,
instance forward overrides) and removed afterwards. The weights and the forward code are the
module's own; nothing of the VAE is copied.

What crosses a patch border, and the rule for it:
- convolutions k > 1 (nn.Conv2d/3d, WanCausalConv3d with its temporal cache,
  HunyuanVideo15CausalConv3d): (k - 1) / 2 pixels -> halo exchange, the layer's own spatial
  padding set to 0 while installed, zeros or replicate at the frame's edge as the layer pads;
- nn.GroupNorm: statistics of the whole frame -> all-reduce of per-group sums (float64, two passes);
- nn.Upsample (bi/tri)linear or bicubic: 1 (bicubic 2) input pixels -> extend the borders by that
  halo, upsample, crop halo x scale; nearest with an integer scale needs nothing (output pixel i
  reads input pixel i // s);
- VAE attention (Wan's per frame, HunyuanVideo-1.5's frame-causal): every key -> local queries,
  K/V all-gathered, the frame-block mask rebuilt for the gathered keys;
- RMS norms over channels, SiLU, 1x1 convolutions, pixel shuffles, clamp: nothing.

A torch-function mode stays active during the decode and refuses what no rule covers (attention
outside a known block, non-nearest interpolation outside nn.Upsample, functional group norm,
pooling), so an unsupported VAE fails loudly instead of decoding seams.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .comm import PatchComm
from .grid import PatchGridError

_LINEAR_HALO = {"linear": 1, "bilinear": 1, "trilinear": 1, "bicubic": 2}
_NEAREST = ("nearest", "nearest-exact")
_POOLS = (nn.AvgPool2d, nn.AvgPool3d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveAvgPool2d,
          nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.BatchNorm2d,
          nn.BatchNorm3d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_REFUSED = {F.group_norm: "functional group_norm", F.avg_pool2d: "avg_pool2d",
            F.avg_pool3d: "avg_pool3d", F.max_pool2d: "max_pool2d", F.max_pool3d: "max_pool3d",
            F.adaptive_avg_pool2d: "adaptive_avg_pool2d", F.adaptive_avg_pool3d: "adaptive_avg_pool3d"}


@dataclass(frozen=True)
class Layer:
    """One planned layer: its name in the model, the rule, the halo it needs (pixels)."""

    name: str
    module: nn.Module
    kind: str
    halo: int = 0


def _diffusers_layer_types() -> dict[str, type]:
    """The diffusers classes with rules of their own (none if diffusers is absent)."""
    found = {}
    try:
        from diffusers.models.autoencoders import autoencoder_kl_wan as wan
        found.update(wan_causal_conv=wan.WanCausalConv3d, wan_attention=wan.WanAttentionBlock)
    except ImportError:
        pass
    try:
        from diffusers.models.autoencoders import autoencoder_kl_hunyuanvideo15 as hy
        found.update(hy_causal_conv=hy.HunyuanVideo15CausalConv3d, hy_attention=hy.HunyuanVideo15AttnBlock)
    except ImportError:
        pass
    return found


def _spatial_pairs(values) -> tuple[int, int]:
    return tuple(values[-2:]) if isinstance(values, tuple | list) else (values, values)


def _conv_halo(name, conv: nn.Conv2d | nn.Conv3d, pad_h: int, pad_w: int) -> int:
    """The halo a stride-1 'same' convolution needs; anything else cannot run on patches."""
    kh, kw = _spatial_pairs(conv.kernel_size)
    sh, sw = _spatial_pairs(conv.stride)
    dh, dw = _spatial_pairs(conv.dilation)
    if (sh, sw) != (1, 1):
        raise PatchGridError(f"{name}: spatial stride {(sh, sw)}; patch parallel runs decoders, "
                             "whose convolutions keep the size (stride 1)")
    if 2 * pad_h != dh * (kh - 1) or 2 * pad_w != dw * (kw - 1):
        raise PatchGridError(f"{name}: kernel {(kh, kw)} with padding {(pad_h, pad_w)} changes the "
                             "frame size; expected 'same' padding (k - 1) / 2")
    return max(pad_h, pad_w)


def plan_layers(modules: list[nn.Module]) -> list[Layer]:
    """Every layer of `modules` that needs a rule; raises on layers no rule covers."""
    types = _diffusers_layer_types()
    plan, covered = [], set()
    for root in modules:
        for name, m in root.named_modules():
            if id(m) in covered:
                continue
            layer = _classify(name or type(m).__name__, m, types, covered)
            if layer is not None:
                plan.append(layer)
    return plan


def _classify(name, m, types, covered):
    if "wan_causal_conv" in types and isinstance(m, types["wan_causal_conv"]):
        w0, w1, h0, h1 = m._padding[:4]
        if (w0, h0) != (w1, h1):
            raise PatchGridError(f"{name}: asymmetric spatial padding {m._padding[:4]}")
        halo = _conv_halo(name, m, h0, w0)
        return Layer(name, m, "wan_causal_conv", halo) if halo else None
    if "hy_causal_conv" in types and isinstance(m, types["hy_causal_conv"]):
        covered.add(id(m.conv))  # its inner nn.Conv3d pads nothing itself
        w0, w1, h0, h1 = m.time_causal_padding[:4]
        if (w0, h0) != (w1, h1) or any(_spatial_pairs(m.conv.padding)):
            raise PatchGridError(f"{name}: unexpected padding {m.time_causal_padding}")
        if m.pad_mode not in ("replicate", "constant"):
            raise PatchGridError(f"{name}: pad_mode {m.pad_mode!r}; expected replicate or constant")
        halo = _conv_halo(name, m.conv, h0, w0)
        return Layer(name, m, "hy_causal_conv", halo) if halo else None
    if isinstance(m, nn.Conv2d | nn.Conv3d):
        if isinstance(m.padding, str):
            raise PatchGridError(f"{name}: padding {m.padding!r}; expected explicit integers")
        if m.padding_mode not in ("zeros", "replicate"):
            raise PatchGridError(f"{name}: padding_mode {m.padding_mode!r}; expected zeros or replicate")
        pad_h, pad_w = _spatial_pairs(m.padding)
        halo = _conv_halo(name, m, pad_h, pad_w)
        return Layer(name, m, "conv", halo) if halo else None
    if isinstance(m, nn.GroupNorm):
        return Layer(name, m, "group_norm")
    if isinstance(m, nn.Upsample):
        return _classify_upsample(name, m)
    for key in ("wan_attention", "hy_attention"):
        if key in types and isinstance(m, types[key]):
            return Layer(name, m, "attention")
    if isinstance(m, _POOLS):
        raise PatchGridError(f"{name}: {type(m).__name__} mixes pixels across patches and has no "
                             "patch-parallel rule")
    return None


def _classify_upsample(name, m):
    if m.size is not None or m.scale_factor is None:
        raise PatchGridError(f"{name}: upsampling to a fixed size; expected a scale factor")
    scales = m.scale_factor if isinstance(m.scale_factor, tuple) else (m.scale_factor,) * 2
    if any(float(s) != int(s) for s in scales[-2:]):
        raise PatchGridError(f"{name}: scale {scales}; patches need integer spatial scales")
    if m.mode in _NEAREST:
        return None  # output pixel i reads input pixel i // s: local on any patch
    if m.mode not in _LINEAR_HALO or m.align_corners:
        raise PatchGridError(f"{name}: mode {m.mode!r} align_corners={m.align_corners}; expected "
                             f"nearest or one of {', '.join(_LINEAR_HALO)} without align_corners")
    return Layer(name, m, "upsample", _LINEAR_HALO[m.mode])


# --- rules: install returns the undo ------------------------------------------------------------

def _hooked(m, padding: dict, hook, *, with_kwargs: bool = False):
    """Set the padding attributes to their new values and register the forward pre-hook that
    exchanges the halo instead; the undo removes the hook and restores the attributes."""
    saved = {name: getattr(m, name) for name in padding}
    for name, value in padding.items():
        setattr(m, name, value)
    handle = m.register_forward_pre_hook(hook, with_kwargs=with_kwargs)

    def undo():
        handle.remove()
        for name, value in saved.items():
            setattr(m, name, value)
    return undo


def _install_conv(layer, comm, mode):
    m, halo = layer.module, layer.halo
    reversed_padding = m._reversed_padding_repeated_twice  # (w, w, h, h, t, t)
    border = "zeros" if m.padding_mode == "zeros" else "replicate"
    padding = {"padding": tuple(m.padding[:-2]) + (0, 0),
               "_reversed_padding_repeated_twice": [0, 0, 0, 0] + list(reversed_padding[4:])}
    return _hooked(m, padding,
                   lambda _, args: (comm.halo(args[0], halo, halo, halo, halo, border), *args[1:]))


def _install_wan_causal_conv(layer, comm, mode):
    m = layer.module
    saved = m._padding
    w0, w1, h0, h1 = saved[:4]

    def pre_hook(_, args, kwargs):
        x, rest = args[0], args[1:]
        cache = rest[0] if rest else kwargs.get("cache_x")
        if cache is not None and saved[4] > 0:
            # the layer prepends the cached frames in time: one exchange covers both
            n = cache.shape[2]
            both = comm.halo(torch.cat([cache.to(x.device), x], 2), h0, h1, w0, w1, "zeros")
            cache, x = both[:, :, :n], both[:, :, n:]
        else:
            x = comm.halo(x, h0, h1, w0, w1, "zeros")
        if rest:
            return (x, cache, *rest[1:]), kwargs
        if "cache_x" in kwargs:
            kwargs = {**kwargs, "cache_x": cache}
        return (x,), kwargs

    return _hooked(m, {"_padding": (0, 0, 0, 0, *saved[4:])}, pre_hook, with_kwargs=True)


def _install_hy_causal_conv(layer, comm, mode):
    m = layer.module
    saved = m.time_causal_padding
    w0, w1, h0, h1 = saved[:4]
    border = "replicate" if m.pad_mode == "replicate" else "zeros"
    return _hooked(m, {"time_causal_padding": (0, 0, 0, 0, *saved[4:])},
                   lambda _, args: (comm.halo(args[0], h0, h1, w0, w1, border), *args[1:]))


def _install_group_norm(layer, comm, mode):
    m = layer.module

    def forward(x):
        b, c = x.shape[:2]
        xg = x.reshape(b, m.num_groups, -1)
        # Two passes (mean, then squared deviations) avoid the cancellation of E[x^2] - E[x]^2.
        local = torch.stack([xg.sum(-1, dtype=torch.float64),
                             torch.full((b, m.num_groups), xg.shape[-1], dtype=torch.float64,
                                        device=x.device)], -1)
        total = comm.all_reduce_sum(local)
        mean = (total[..., 0] / total[..., 1]).to(x.dtype)[..., None]
        squares = ((xg - mean) ** 2).sum(-1, dtype=torch.float64)
        var = comm.all_reduce_sum(squares) / total[..., 1]
        y = ((xg - mean) * torch.rsqrt(var + m.eps).to(x.dtype)[..., None]).reshape(x.shape)
        if m.affine:
            shape = (1, c) + (1,) * (x.dim() - 2)
            y = y * m.weight.view(shape) + m.bias.view(shape)
        return y

    m.forward = forward
    return lambda: delattr(m, "forward")


def _install_upsample(layer, comm, mode):
    m, halo = layer.module, layer.halo
    original = m.forward
    scales = m.scale_factor if isinstance(m.scale_factor, tuple) else (m.scale_factor,) * 2
    sh, sw = (int(s) for s in scales[-2:])

    def forward(x):
        # Beyond the frame, (bi/tri)linear and bicubic clamp to the edge pixel: replicate.
        extended = comm.halo(x, halo, halo, halo, halo, "replicate")
        with mode.allow("interpolate"):
            y = original(extended)
        return y[..., halo * sh: y.shape[-2] - halo * sh, halo * sw: y.shape[-1] - halo * sw]

    m.forward = forward
    return lambda: delattr(m, "forward")


def _install_attention(layer, comm, mode):
    m = layer.module
    original = m.forward

    def forward(x, *args, **kwargs):
        with mode.attention(x.shape[-2], x.shape[-1]):
            return original(x, *args, **kwargs)

    m.forward = forward
    return lambda: delattr(m, "forward")


INSTALL: dict[str, Callable] = {
    "conv": _install_conv, "wan_causal_conv": _install_wan_causal_conv,
    "hy_causal_conv": _install_hy_causal_conv, "group_norm": _install_group_norm,
    "upsample": _install_upsample, "attention": _install_attention,
}


# --- attention and the guard ---------------------------------------------------------------------

class PatchParallelMode(TorchFunctionMode):
    """Active during a patch-parallel decode: runs attention of the known blocks with gathered
    K/V, and refuses the functional ops that would silently mix pixels across patches."""

    def __init__(self, comm: PatchComm):
        super().__init__()
        self.comm = comm
        self.patch = None  # (height, width) of the attention block's input, inside one
        self.allowed = set()

    @contextmanager
    def attention(self, height, width):
        self.patch = (height, width)
        try:
            yield
        finally:
            self.patch = None

    @contextmanager
    def allow(self, what):
        self.allowed.add(what)
        try:
            yield
        finally:
            self.allowed.discard(what)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            if self.patch is None:
                raise PatchGridError("scaled_dot_product_attention outside a known VAE attention "
                                     "block (WanAttentionBlock, HunyuanVideo15AttnBlock); patch "
                                     "parallel cannot gather its keys")
            return gathered_attention(self.comm, self.patch, *args, **kwargs)
        if func is F.interpolate and "interpolate" not in self.allowed:
            _check_local_interpolate(*args, **kwargs)
        elif func in _REFUSED:
            raise PatchGridError(f"{_REFUSED[func]} mixes pixels across patches and has no "
                                 "patch-parallel rule")
        return func(*args, **kwargs)


def _check_local_interpolate(input, size=None, scale_factor=None, mode="nearest", *args, **kwargs):
    scales = scale_factor if isinstance(scale_factor, tuple | list) else (scale_factor,) * 2
    if (mode not in _NEAREST or size is not None
            or any(s is None or float(s) != int(s) for s in scales[-2:])):
        raise PatchGridError(f"interpolate(mode={mode!r}, size={size}, scale_factor={scale_factor}) "
                             "outside nn.Upsample; only nearest with integer scales is local to a patch")


def gathered_attention(comm: PatchComm, patch, query, key, value, attn_mask=None, dropout_p=0.0,
                       is_causal=False, scale=None, enable_gqa=False):
    """Attention of this patch's queries over every patch's keys. Tokens are the patch's pixels
    (frames folded into the batch: Wan) or frames x pixels (HunyuanVideo-1.5); K and V travel in
    one all-gather. Key order differs from the single-device run (patch by patch), which the
    softmax sum does not see beyond rounding."""
    if is_causal:
        raise PatchGridError("token-causal attention cannot be split by patches")
    pixels = patch[0] * patch[1]
    if query.shape[-2] % pixels or key.shape[-2] != query.shape[-2]:
        raise PatchGridError(f"attention over {query.shape[-2]} tokens on a {patch} patch; "
                             "expected a whole number of frames of the patch's pixels")
    frames = query.shape[-2] // pixels
    dk = key.shape[-1]
    parts = comm.all_gather_varlen(torch.cat([key, value], -1), dim=-2)
    key = torch.cat([p[..., :dk] for p in parts], -2)
    value = torch.cat([p[..., dk:] for p in parts], -2)
    if attn_mask is not None:
        attn_mask = _gathered_mask(attn_mask, frames, pixels, [p.shape[-2] // frames for p in parts])
    extra = {"enable_gqa": True} if enable_gqa else {}
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                          dropout_p=dropout_p, scale=scale, **extra)


def _gathered_mask(mask, frames, pixels, pixels_per_rank):
    """The mask for local queries x gathered keys, from the local one, which must depend only on
    (query frame, key frame), as HunyuanVideo-1.5's frame-causal mask does."""
    per_frame = mask[..., ::pixels, ::pixels]
    if per_frame.shape[-2:] != (frames, frames) or not torch.equal(
            per_frame.repeat_interleave(pixels, -2).repeat_interleave(pixels, -1), mask):
        raise PatchGridError("the attention mask varies within a frame; patch parallel rebuilds "
                             "only masks that are constant over each frame's pixels")
    rows = per_frame.repeat_interleave(pixels, -2)
    return torch.cat([rows.repeat_interleave(n, -1) for n in pixels_per_rank], -1)


@contextmanager
def patch_parallel(modules: list[nn.Module], comm: PatchComm):
    """Run `modules` patch-parallel inside the block (yields the plan); restored afterwards,
    also on error."""
    plan = plan_layers(modules)
    mode = PatchParallelMode(comm)
    undo = []
    try:
        for layer in plan:
            undo.append(INSTALL[layer.kind](layer, comm, mode))
        with mode:
            yield plan
    finally:
        for restore in reversed(undo):
            restore()

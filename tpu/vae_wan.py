"""Wan2.1 / Wan2.2 VAE (AutoencoderKLWan) decode plan (`WanPlan`): diffusers' feat_cache made
fixed-shape, each call a chain of block programs, the convs' operands rounded where a TPU rounds
them, the frame run as strips.

diffusers decodes frame by frame with `feat_cache`, a list of the last 2 input frames of each
causal conv. After frame 0 an entry holds one frame, after frame 1 two, and 3-D upsamplers hold
"Rep" (no cache yet). The first call returns every entry as 2 frames, a zero frame in front
(and zeros for "Rep"): a causal conv pads time with zeros, so the steady call, given those,
computes what diffusers' second call does, and from then on the shapes are fixed.

Each call runs as a chain of programs (`wan_steps`, tpu/vae_chain.py): the post-quant conv with
conv_in, every residual block, the mid-block attention, every upsampler with its block's
shortcut, and the head, each on its own causal convs' cache entries. Residual blocks alike (same
channels, same frame size) share one compiled program: as one program a call took libtpu 4-6
minutes to compile on a 2-core host. A steady call
may take several latent frames (`frames_per_call`: the convs are causal, so the last call's
missing frames are zeros and their video is dropped); default one (WAN_FRAMES_PER_CALL: on v6e-8
two moved fewer bytes accessed per frame but more HBM traffic, measured before the halo took its
present form).

Convolution operands (`conv_operands`): a TPU computes a float32 convolution at XLA's DEFAULT
precision in one bfloat16 pass (operands rounded to bfloat16, products summed in float32). On a
TPU the Wan decoders state that rounding in the program: each conv's input and weight are
rounded where they are made, so the weights, the carried causal caches (only convs read them)
and every pad and relayout in front of a conv move half the bytes, and the numbers should be the
ones the float32 program gives there (not yet compared on a TPU). Elsewhere (CPU, GPU) convs
stay float32 as stored.

With the strips (tpu/vae_strips.py) go two reformulations (the same numbers, fewer relayouts on
a TPU): the upsamplers' 3x3 convs run on [B, C, T, h, w] as 1x3x3 3-D convs (diffusers folds the
frames into the batch around them), and Wan2.2's shortcut upsampler (DupUp3D) moves channels into
frames and repeats pixels instead of transposing its whole output.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import torch
import torch.nn.functional as F

from .vae_plan import ChunkedPlan, routed
from .vae_strips import frame_strips

WAN_FRAMES_PER_CALL = 1  # latent frames a Wan decoder's steady call decodes


# --- the convs, upsamplers and attention, routed -------------------------------------------------

def conv_operand_dtype(dtype: torch.dtype, platform: str) -> torch.dtype | None:
    """The dtype a decoder of `dtype` rounds its conv operands to on `platform` (a jax device's
    platform), or None for as stored: bfloat16 for float32 on a TPU, where XLA's DEFAULT
    precision computes a float32 conv from bfloat16 operands anyway."""
    return torch.bfloat16 if dtype == torch.float32 and platform == "tpu" else None


def rounded_conv(x, weight, bias, stride, padding, dilation, groups, operands=None):
    """F.conv2d/conv3d (zero padding `padding` per spatial dim); with `operands`, input and
    weight rounded to that dtype and the products summed into float32, as a TPU's DEFAULT
    precision does for a float32 conv (a torch conv of bfloat16 tensors would round its
    result to bfloat16 too)."""
    if operands is None:
        conv = F.conv3d if x.ndim == 5 else F.conv2d
        return conv(x, weight, bias, stride, padding, dilation, groups)
    from torchax.interop import call_jax

    dims = x.ndim - 2
    layout = ("NCDHW", "OIDHW", "NCDHW") if dims == 3 else ("NCHW", "OIHW", "NCHW")

    def conv(x, w):
        return jax.lax.conv_general_dilated(
            x, w, tuple(stride), [(p, p) for p in padding], rhs_dilation=tuple(dilation),
            dimension_numbers=layout, feature_group_count=groups,
            preferred_element_type=jax.numpy.float32)

    y = call_jax(conv, x.to(operands), weight.to(operands))  # no-ops where already rounded
    return y if bias is None else y + bias.float().reshape(1, -1, *[1] * dims)


def _causal_conv(m, x, cache_x=None, operands=None, strips=None):
    """WanCausalConv3d.forward, its spatial zero padding left to the convolution, or on strips
    (`Strips`) made each strip's halo. operands: see `rounded_conv`; the input is rounded before
    the cache goes in front, the time padding and the halo, so those move rounded values."""
    pw, _, ph, _, pt, _ = m._padding
    if operands is not None:
        x = x.to(operands)
    if cache_x is not None and pt > 0:
        x = torch.cat([cache_x.to(device=x.device, dtype=x.dtype), x], dim=2)
        pt -= cache_x.shape[2]
    x = F.pad(x, (0, 0, 0, 0, pt, 0))
    return _padded_conv(x, m.weight, m.bias, m.stride, ph, pw, m.dilation, m.groups, operands,
                        strips)


def _padded_conv(x, weight, bias, stride, ph, pw, dilation, groups, operands, strips):
    """`rounded_conv` of [B, C, T, h, w] with `ph` rows and `pw` columns of zero padding, on
    strips as each strip's halo (made of operands already rounded)."""
    if operands is not None:
        x = x.to(operands)
    if strips is not None and (ph or pw):
        x, ph, pw = strips.torch(strips.halo, x, ph=ph, pw=pw), 0, 0
    return rounded_conv(x, weight, bias, stride, (0, ph, pw), dilation, groups, operands)


def _conv2d(m, x, operands=None, strips=None):
    """nn.Conv2d (the mid-block attention's 1x1 projections, on the joined frame; the
    upsamplers' 3x3 convs go through `_resample`) through `rounded_conv`, which pads with zeros
    by a number per side (every Wan decoder's Conv2d does)."""
    if m.padding_mode != "zeros" or isinstance(m.padding, str):
        raise ValueError(f"the Wan decode's 2-D convs take zero padding by numbers; this Conv2d "
                         f"pads {m.padding!r} in mode {m.padding_mode!r}")
    if strips is not None and any(m.padding):
        raise ValueError(f"a padded Conv2d ({m.padding!r}) outside a Wan upsampler; on strips "
                         "only the upsamplers' (`_resample`) take a halo")
    return rounded_conv(x, m.weight, m.bias, m.stride, tuple(m.padding), m.dilation, m.groups,
                        operands)


def _resample(m, x, feat_cache=None, feat_idx=(0,), *, operands=None, strips=None):
    """WanResample; an upsampler's 2x nearest upsample and 3x3 conv on [B, C, T, h, w] (the conv
    a 1x3x3 3-D conv), where diffusers folds the frames into the batch around them: on a TPU the
    conv's output was copied back from the folded layout. The time upsampling and its cache run
    as diffusers runs them (the resample swapped for an identity meanwhile)."""
    if m.mode not in ("upsample2d", "upsample3d"):
        return type(m).forward(m, x, feat_cache, feat_idx)
    resample = m.resample
    up, conv = resample
    if tuple(up.scale_factor) != (2.0, 2.0) or up.mode != "nearest-exact":
        raise ValueError(f"a Wan upsampler scales 2x by nearest-exact; this one {up.mode} "
                         f"{up.scale_factor}")
    if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        raise ValueError(f"a Wan upsampler's conv pads with zeros by numbers; this one pads "
                         f"{conv.padding!r} in mode {conv.padding_mode!r}")
    m._modules["resample"] = torch.nn.Identity()
    try:
        x = type(m).forward(m, x, feat_cache, feat_idx)
    finally:
        m._modules["resample"] = resample
    # each pixel repeated (nearest-exact 2x): where XLA lowers the index gather by moving the
    # frame (split over devices, it first all-gathered the whole frame onto every device)
    x = x.repeat_interleave(2, dim=-2).repeat_interleave(2, dim=-1)
    return _padded_conv(x, conv.weight.unsqueeze(2), conv.bias, (1, *conv.stride), *conv.padding,
                        (1, *conv.dilation), conv.groups, operands, strips)


def dup_up(m, x, first_chunk=False):
    """DupUp3D (Wan2.2's up blocks' shortcut: channels repeated, then moved into ft x fs x fs
    sub-positions of frames, rows and columns). Where `repeats` is a multiple of fs * fs, each
    pixel's fs x fs sub-positions take one channel, and where it is a multiple of fs, each
    column sub-position does: the same numbers as the channels moved into frames (and rows) and
    then each pixel repeated. The repeat fuses into its reader, where the transpose of the whole
    upsampled tensor was copied (on a TPU, per steady call of the TI2V-5B decode, 0.46 GB in
    one up block alone)."""
    ft, fs, repeats = m.factor_t, m.factor_s, m.repeats
    shared = fs * fs if repeats % (fs * fs) == 0 else fs if repeats % fs == 0 else 1
    if shared == 1:
        return type(m).forward(m, x, first_chunk)
    b, _, t, h, w = x.shape
    # channel (co * ft + i) * (fs * fs // shared) + j of this is the one that sub-frame i (and
    # sub-row j) of channel co takes
    x = x.repeat_interleave(repeats // shared, dim=1)
    if shared == fs * fs:
        x = x.view(b, m.out_channels, ft, t, h, w).transpose(2, 3).reshape(b, -1, t * ft, h, w)
        x = x.repeat_interleave(fs, dim=-2)
    else:  # the rows from channels too
        x = x.view(b, m.out_channels, ft, fs, t, h, w).permute(0, 1, 4, 2, 5, 3, 6)
        x = x.reshape(b, -1, t * ft, h * fs, w)
    x = x.repeat_interleave(fs, dim=-1)
    return x[:, :, ft - 1:] if first_chunk else x


def _attention(m, x, strips):
    """WanAttentionBlock (each frame's pixels attend to each other) on the whole frame."""
    frame = type(m).forward(m, strips.torch(strips.join, x))
    return strips.torch(strips.cut, frame)


# --- the decoder through them: the first frame and the steady ones -----------------------------

@contextlib.contextmanager
def _routes(vae, operands=None, strips=None):
    """The decoder's causal convs, 2-D convs, resamplers and Wan2.2's shortcut upsamplers
    routed through `_causal_conv`/`_conv2d`/`_resample`/`dup_up`, its mid-block attention
    through `_attention` (the post-quant conv is a causal 1x1x1 conv outside the decoder)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import DupUp3D, WanAttentionBlock, WanResample

    causal, conv2d = _conv_types()
    routes = {causal: functools.partial(_causal_conv, operands=operands, strips=strips),
              conv2d: functools.partial(_conv2d, operands=operands, strips=strips),
              DupUp3D: dup_up,
              WanResample: functools.partial(_resample, operands=operands, strips=strips)}
    if strips is not None:
        routes[WanAttentionBlock] = functools.partial(_attention, strips=strips)
    with routed(vae.decoder, routes), routed(vae.post_quant_conv, routes):
        yield


def _conv_types() -> tuple[type, type]:
    """The conv modules `_routes` convolves with rounded operands: causal 3-D, plain 2-D."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    return WanCausalConv3d, torch.nn.Conv2d


def conv_weights(vae) -> set[str]:
    """The names (in tpu.vae's "vae.*" terms) of the weights `_routes` convolves with
    rounded operands: they can be stored rounded."""
    return {".".join(filter(None, ("vae", part, name, "weight")))
            for part in ("decoder", "post_quant_conv")
            for name, m in getattr(vae, part).named_modules()
            if isinstance(m, _conv_types())}


# --- the decoder as a chain of block programs (tpu/vae_chain.py) ---------------------------------

CACHE_T = 2  # the frames a causal conv's cache holds (diffusers' CACHE_T)
# Between block programs a [B, C, T, h, w] activation or cache entry travels as [T, h, w, B, C]:
# a program's arguments and results take the device's default layout for their shape, and in
# that order it is the layout libtpu gives them inside (channels minor, the strips beside them);
# as [B, C, T, h, w] each program copied its inputs and outputs into and out of it (the
# TI2V-5B steady call: 12.9 GB of HBM traffic against 9.3 GB as one program).
BOUNDARY = (2, 3, 4, 0, 1)
_INSIDE = tuple(BOUNDARY.index(d) for d in range(5))


def to_boundary(x):
    return x.permute(*BOUNDARY)


def from_boundary(x):
    return x.permute(*_INSIDE)


def boundary_sharding(sharding):
    """The sharding of a [B, C, T, h, w] array's boundary form (`BOUNDARY`)."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (5 - len(sharding.spec))
    return jax.sharding.NamedSharding(sharding.mesh,
                                      jax.sharding.PartitionSpec(*[spec[d] for d in BOUNDARY]))


def _at_boundary(fn, takes_latents=False, gives_video=False):
    """fn(p, *inputs, cache) on [B, C, T, h, w] tensors, taking and giving them in their
    boundary form (the latents and the video as they are)."""
    def wrapped(p, *rest):
        *inputs, cache = rest
        if not takes_latents:
            inputs = [from_boundary(a) for a in inputs]
        out, cache = fn(p, *inputs, [None if c is None else from_boundary(c) for c in cache])
        return (out if gives_video else to_boundary(out)), [to_boundary(c) for c in cache]
    return wrapped


def _cached(conv, x, cache):
    """The decoder's conv_in/conv_out with its cache slot (WanDecoder3d.forward's, for one)."""
    cache_x = x[:, :, -CACHE_T:].clone()
    if cache_x.shape[2] < 2 and cache[0] is not None:
        cache_x = torch.cat([cache[0][:, :, -1:].to(cache_x.device), cache_x], dim=2)
    x = conv(x, cache[0])
    cache[0] = cache_x
    return x


def _steady_shaped(cache, first, rep_input=None):
    """After the first call a cache entry holds one frame, a 3-D upsampler's "Rep" (no frame
    yet): each made 2 frames, a zero frame in front (zeros for "Rep": a causal conv pads time
    with zeros), so that every steady call takes the same shapes and computes what diffusers'
    second call does."""
    if not first:
        return cache
    out = []
    for entry in cache:
        if isinstance(entry, str):
            entry = torch.zeros_like(rep_input[:, :, :1]).expand(-1, -1, CACHE_T, -1, -1)
        elif entry.shape[2] < CACHE_T:
            entry = torch.cat([torch.zeros_like(entry), entry], dim=2)
        out.append(entry)
    return out


def wan_steps(vae, operands=None, strips=None, first: bool = False):
    """The decoder's call as `Step`s, in diffusers' order (post-quant conv and conv_in, the mid
    block's residual blocks and attention, each up block's residual blocks and its upsampler
    with the shortcut, the head), each block's causal convs on their own state slots; returns
    (steps, slots). first: the clip's first latent frame (its state starts empty)."""
    from .vae_chain import Step

    def finish(cache, rep_input=None):
        return _stored(_steady_shaped(cache, first, rep_input), operands)

    def conv_in(p, z, cache):
        cache = list(cache)
        with _routes(vae, operands, strips):
            x = _cached(p.conv, p.pqc(_cut(z, strips)), cache)
        return x, finish(cache)

    def residual(p, x, cache):
        cache = list(cache)
        with _routes(vae, operands, strips):
            x = p.res(x, feat_cache=cache, feat_idx=[0])
        return x, finish(cache)

    def attention(p, x, cache):
        with _routes(vae, operands, strips):
            return p.attn(x), []

    def upsample(p, x, *rest):
        *shortcut, cache = rest
        cache, x_in = list(cache), x
        with _routes(vae, operands, strips):
            if hasattr(p, "up"):
                x = p.up(x, feat_cache=cache, feat_idx=[0])
            if shortcut:
                x = x + p.short(shortcut[0], first_chunk=first)
        return x, finish(cache, x_in)

    def head(p, x, cache):
        cache = list(cache)
        with _routes(vae, operands, strips):
            x = _cached(p.conv, vae.decoder.nonlinearity(p.norm(x)), cache)
        return _video(vae, x, strips).float(), finish(cache)

    steps, slot = [], 0

    def add(kind, parts, fn, cached, **kw):
        nonlocal slot
        fn = _at_boundary(fn, takes_latents=kind.startswith("in-"),
                          gives_video=kind.startswith("head-"))
        steps.append(Step(kind, parts, fn, tuple(range(slot, slot + cached)), **kw))
        slot += cached

    mode = "first" if first else "steady"
    add(f"in-{mode}", (("pqc", "post_quant_conv"), ("conv", "decoder.conv_in")), conv_in, 1,
        inputs=("z",))
    mid = vae.decoder.mid_block
    add(f"res-{mode}", (("res", "decoder.mid_block.resnets.0"),), residual, 2)
    for j, attn in enumerate(mid.attentions):
        if attn is not None:
            add("attn", (("attn", f"decoder.mid_block.attentions.{j}"),), attention, 0)
        add(f"res-{mode}", (("res", f"decoder.mid_block.resnets.{j + 1}"),), residual, 2)
    for i, block in enumerate(vae.decoder.up_blocks):
        path = f"decoder.up_blocks.{i}"
        shortcut = getattr(block, "avg_shortcut", None)
        for j in range(len(block.resnets)):
            add(f"res-{mode}", (("res", f"{path}.resnets.{j}"),), residual, 2,
                keep=f"block{i}" if j == 0 and shortcut is not None else None)
        up = getattr(block, "upsampler", None)
        up_path = f"{path}.upsampler"
        if up is None and getattr(block, "upsamplers", None) is not None:
            up, up_path = block.upsamplers[0], f"{path}.upsamplers.0"
        parts = ((("up", up_path),) if up is not None else ()) + \
            ((("short", f"{path}.avg_shortcut"),) if shortcut is not None else ())
        if parts:
            add(f"up-{mode}", parts, upsample, 1 if up is not None and up.mode == "upsample3d" else 0,
                inputs=("x", f"block{i}") if shortcut is not None else ("x",))
    add(f"head-{mode}", (("norm", "decoder.norm_out"), ("conv", "decoder.conv_out")), head, 1)
    return steps, slot


def _cut(z, strips):
    return z if strips is None else strips.torch(strips.cut, z)


def _stored(state, operands):
    return state if operands is None else [
        s.to(operands) if isinstance(s, torch.Tensor) else s for s in state]


def _video(vae, out, strips=None):
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    if vae.config.patch_size is not None:
        out = unpatchify(out, patch_size=vae.config.patch_size)
    out = torch.clamp(out, min=-1.0, max=1.0)
    return out if strips is None else strips.torch(strips.join, out)


# --- the plan ------------------------------------------------------------------------------------

class WanPlan(ChunkedPlan):
    """The Wan decoders: a first call and a steady one of `per_call` latent frames, each a chain
    of block programs (`wan_steps`), the causal convs' caches carried between calls; conv
    operands rounded (`conv_operand_dtype` on "auto"), the frame cut into strips (`strip_grid`
    on "auto")."""

    vae_class, family = "AutoencoderKLWan", "wan"

    def resolve_operands(self, name, conv_operands, dtype, platform):
        return conv_operand_dtype(dtype, platform) if conv_operands == "auto" else conv_operands

    def check_strips(self, strips):
        if strips != "auto" and (len(strips) != 2 or min(strips) < 1):
            super().check_strips(strips)

    def resolve_frames_per_call(self, frames_per_call) -> int:
        if frames_per_call == "auto":
            frames_per_call = WAN_FRAMES_PER_CALL
        if not isinstance(frames_per_call, int) or frames_per_call < 1:
            raise ValueError(f"frames_per_call={frames_per_call!r}: expected 'auto' or a positive "
                             "integer (above 1 for a Wan VAE only)")
        return frames_per_call

    def rounded_weights(self, vae) -> set[str]:
        return conv_weights(vae) if self.operands is not None else set()

    def strips(self, latent_height, latent_width, mesh, split):
        return frame_strips(latent_height, latent_width, mesh, split, self.platform, self.grid)

    def steps(self, vae, placement, latent_shape, first):
        return wan_steps(vae, self.operands, placement.strips, first)

    def between(self, placement):
        """Activations and cache entries cross between programs in their boundary form."""
        return lambda abstract: boundary_sharding(placement.state(abstract))

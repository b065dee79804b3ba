"""Stage 3 on JAX: the diffusers video VAEs' decoders as static programs, traced through torchax
from the same torch modules, a latent frame per call (Wan: or a few) with the causal caches
carried between calls as explicit inputs and outputs.

Two programs per decode, compiled ahead of the loop (`prepare`): the first latent frame (it
decodes to one video frame: the temporal upsamplers skip it) and a steady frame (four video
frames). A clip of any length runs the first program once and the steady one F - 1 times; the
loop calls the compiled executables, so it can compile nothing.

    Wan2.1 / Wan2.2 VAE (AutoencoderKLWan): diffusers decodes frame by frame with `feat_cache`,
        a list of the last 2 input frames of each causal conv. After frame 0 an entry holds one
        frame, after frame 1 two, and 3-D upsamplers hold "Rep" (no cache yet). The first program
        returns every entry as 2 frames, a zero frame in front (and zeros for "Rep"): a causal
        conv pads time with zeros, so the steady program, given those, computes what diffusers'
        second call does, and from then on the shapes are fixed. A steady call may take several
        latent frames (`frames_per_call`: the convs are causal, so the last call's missing
        frames are zeros and their video is dropped); default one (WAN_FRAMES_PER_CALL: on
        v6e-8 two moved fewer bytes accessed per frame but more HBM traffic, measured before
        the halo took its present form).
    HunyuanVideo-1.5 VAE (AutoencoderKLHunyuanVideo15): diffusers decodes the whole clip at once.
        Its convs pad time with the first frame replicated and its mid-block attention is
        frame-causal over every earlier latent frame, so the chunked decode carries each causal
        conv's last 2 input frames and the mid-block K/V of all earlier frames, in buffers of
        `kv_frames` latent frames (the clip's count rounded up to a multiple of KV_BUCKET, so
        clips of 1-8 latent frames share programs, 9-16 the next pair, ...), masked by frame.
    PixelLatents (the pixel-space tiny model): the clamp, one program of the whole clip.

Convolution operands (`conv_operands`): a TPU computes a float32 convolution at XLA's DEFAULT
precision in one bfloat16 pass (operands rounded to bfloat16, products summed in float32). On a
TPU the Wan decoders state that rounding in the program: each conv's input and weight are
rounded where they are made, so the weights, the carried causal caches (only convs read them)
and every pad and relayout in front of a conv move half the bytes, and the numbers should be the
ones the float32 program gives there (not yet compared on a TPU). Elsewhere (CPU, GPU) convs
stay float32 as stored.

On a mesh of several devices (1-D, axis "s") the latent frame, every cached frame and the video
are split by rows, or by columns where the rows do not divide (`split_plan`), the weights
replicated. The mesh takes a divisor of the device count: a TPU compile refuses collectives over
groups that do not tile the devices (libtpu: "total_device_count % num_participants_per_group ==
0"), so Wan2.2 I2V-A14B's 90 latent rows at 720p split over 8 chips by their 160 columns, not
over 6 by rows. HunyuanVideo-1.5: XLA partitions the convolutions (GSPMD: each 3x3 conv
exchanges a line of halo with its neighbours by collective-permute).

Wan: strips (`_Strips`). Each device's band of the frame is cut into a grid of strips stacked on
the batch axis, and the decoder runs on them as on a batch (all but its 3x3 convs and its
mid-block attention is per pixel); each conv's zero padding becomes the strip's halo, its
neighbours' border lines (collective-permute of those lines across a band's edge), and the
attention joins the strips into the frame. On a TPU a band is cut into at least 8 strips
(`strip_grid`): of a conv with a batch under 8, libtpu's space-to-batch pass makes 8 batches of
the width, and every conv's input is padded and relaid out into them and its output copied back
(about a quarter of the TI2V-5B decode's HBM traffic); one such conv with the width taken off the
pass (its spatial order changed) compiled 7x slower, as a batch of 8 strips it compiles faster
than before. Elsewhere a band is one strip (a grid of 1 x 1: on one device, the whole frame).
With the strips go two reformulations (the same numbers, fewer relayouts on a TPU): the
upsamplers' 3x3 convs run on [B, C, T, h, w] as 1x3x3 3-D convs (diffusers folds the frames into
the batch around them), and Wan2.2's shortcut upsampler (DupUp3D) moves channels into frames and
repeats pixels instead of transposing its whole output.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import types

import jax
import numpy as np
import torch
import torch.nn.functional as F
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from compat.torchax_compat import import_torchax

from .compile import compile_counts

AXIS = "s"  # the mesh axis the frame's rows (or columns) are split over
KV_BUCKET = 8  # HunyuanVideo-1.5: the mid-block K/V buffers hold a multiple of 8 latent frames
ROWS, COLUMNS = 3, 4  # the split dimension of [B, C, T, H, W]
# A TPU convolution of a batch of 8 or more runs as written; of fewer, libtpu's space-to-batch
# pass cuts the frame's width into 8 batches and every conv's input and output are padded and
# relaid out around it (measured on v6e-8: batches of 4 are cut, of 8 are not), so on a TPU the
# Wan decoders cut each device's band of the frame into at least 8 strips (`strip_grid`).
MIN_STRIPS = 8
WAN_UPSCALE = 8  # a Wan decoder's last convs run at 8x the latent's rows and columns
WAN_FRAMES_PER_CALL = 1  # latent frames a Wan decoder's steady call decodes
# The compiled programs of this process, by architecture (class, config, dtype), devices and
# shape: the weights are arguments, so another decoder of the same VAE (the next run of a job,
# another checkpoint) reuses them and compiles nothing.
_COMPILED: dict = {}
_ENCODER = ("vae.encoder.", "vae.quant_conv.")  # weights no decode reads


def make_mesh(devices: int | None = None) -> Mesh:
    """A 1-D mesh over the first `devices` of this process's devices (default: all of them)."""
    devs = jax.local_devices()[: devices or len(jax.local_devices())]
    return Mesh(np.array(devs), (AXIS,))


def split_plan(latent_height: int, latent_width: int, devices: int) -> tuple[int, int]:
    """(devices to use, ROWS or COLUMNS): the largest divisor of `devices` that splits the
    latent rows or columns evenly, rows when both do."""
    for n in sorted((d for d in range(1, devices + 1) if devices % d == 0), reverse=True):
        if latent_height % n == 0:
            return n, ROWS
        if latent_width % n == 0:
            return n, COLUMNS
    raise AssertionError("unreachable: 1 divides everything")


def mesh_size(latent_height: int, latent_width: int, devices: int) -> int:
    return split_plan(latent_height, latent_width, devices)[0]


def family(vae) -> str:
    name = type(vae).__name__
    if name == "AutoencoderKLWan":
        return "wan"
    if name == "AutoencoderKLHunyuanVideo15":
        return "hunyuan"
    if name == "PixelLatents":
        return "pixels"
    raise ValueError(f"no JAX decode for {name}; expected AutoencoderKLWan, "
                     "AutoencoderKLHunyuanVideo15 or PixelLatents")


class _Decode(torch.nn.Module):
    """The VAE as one module, so that functional_call binds its weights by name ("vae.*")."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, fn, *args):
        return fn(self.vae, *args)


# --- Wan: diffusers' feat_cache, made fixed-shape ---------------------------------------------

def conv_operand_dtype(dtype: torch.dtype, platform: str) -> torch.dtype | None:
    """The dtype a decoder of `dtype` rounds its conv operands to on `platform` (a jax device's
    platform), or None for as stored: bfloat16 for float32 on a TPU, where XLA's DEFAULT
    precision computes a float32 conv from bfloat16 operands anyway."""
    return torch.bfloat16 if dtype == torch.float32 and platform == "tpu" else None


def _conv(x, weight, bias, stride, padding, dilation, groups, operands=None):
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


def _wan_conv(m, x, cache_x=None, operands=None, strips=None):
    """WanCausalConv3d.forward, its spatial zero padding left to the convolution, or on strips
    (`_Strips`) made each strip's halo. operands: see `_conv`; the input is rounded before the
    cache goes in front, the time padding and the halo, so those move rounded values."""
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
    """`_conv` of [B, C, T, h, w] with `ph` rows and `pw` columns of zero padding, on strips as
    each strip's halo (made of operands already rounded)."""
    if operands is not None:
        x = x.to(operands)
    if strips is not None and (ph or pw):
        x, ph, pw = strips.torch(strips.halo, x, ph=ph, pw=pw), 0, 0
    return _conv(x, weight, bias, stride, (0, ph, pw), dilation, groups, operands)


def _conv2d(m, x, operands=None, strips=None):
    """nn.Conv2d (the mid-block attention's 1x1 projections, on the joined frame; the
    upsamplers' 3x3 convs go through `_wan_resample`) through `_conv`, which pads with zeros by
    a number per side (every Wan decoder's Conv2d does)."""
    if m.padding_mode != "zeros" or isinstance(m.padding, str):
        raise ValueError(f"the Wan decode's 2-D convs take zero padding by numbers; this Conv2d "
                         f"pads {m.padding!r} in mode {m.padding_mode!r}")
    if strips is not None and any(m.padding):
        raise ValueError(f"a padded Conv2d ({m.padding!r}) outside a Wan upsampler; on strips "
                         "only the upsamplers' (`_wan_resample`) take a halo")
    return _conv(x, m.weight, m.bias, m.stride, tuple(m.padding), m.dilation, m.groups, operands)


def _wan_resample(m, x, feat_cache=None, feat_idx=(0,), *, operands=None, strips=None):
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


def _wan_dup_up(m, x, first_chunk=False):
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


def _wan_attention(m, x, strips):
    """WanAttentionBlock (each frame's pixels attend to each other) on the whole frame."""
    frame = type(m).forward(m, strips.torch(strips.join, x))
    return strips.torch(strips.cut, frame)


# --- Wan: the frame as strips on the batch axis ----------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def strip_grid(band_height: int, band_width: int, platform: str) -> tuple[int, int]:
    """(rows, columns) of strips each device cuts its band of the latent frame (band_height x
    band_width latent pixels) into for the Wan decoders: on a TPU the grid of at least
    MIN_STRIPS strips whose halos (one line around each strip, at the last convs' 8x size) add
    the fewest pixels, on a tie fewer strips, then wider ones; (1, 1) where none divides or
    off a TPU."""
    if platform != "tpu":
        return 1, 1
    best, best_cost = (1, 1), None
    for r in _divisors(band_height):
        for c in _divisors(band_width):
            if r * c < MIN_STRIPS:
                continue
            h, w = WAN_UPSCALE * band_height // r, WAN_UPSCALE * band_width // c
            cost = ((h + 2) * (w + 2) / (h * w), r * c, c)
            if best_cost is None or cost < best_cost:
                best, best_cost = (r, c), cost
    return best


@dataclasses.dataclass(frozen=True)
class _Strips:
    """The frame over `n` devices (its rows or columns split: `split`), each device's band cut
    into `rows` x `cols` strips, all stacked on the batch axis: [n*rows*cols, C, T, h, w],
    device-major, sharded over the mesh by that axis. Every op of a Wan decoder but its 3x3
    convs and its mid-block attention is per pixel, so the decoder runs on the strips as on a
    batch; `halo` gives each conv its neighbours' border lines, `join`/`cut` give the attention
    the whole frame."""

    n: int
    split: int
    rows: int
    cols: int
    mesh: Mesh | None

    @property
    def batch(self) -> int:
        return self.n * self.rows * self.cols

    def _local(self, fn, band_in: bool, band_out: bool):
        """fn on each device's part: its band of a [1, C, T, H, W] frame, or its strips."""
        if self.mesh is None:
            return fn
        band = [None] * 5
        band[self.split] = AXIS
        spec = (lambda is_band: P(*band) if is_band else P(AXIS))
        return jax.shard_map(fn, mesh=self.mesh, in_specs=spec(band_in), out_specs=spec(band_out))

    def cut(self, x):
        """[1, C, T, H, W] (jax) -> the strips [B, C, T, h, w]."""
        def local(x):
            _, c, t, hh, ww = x.shape
            h, w = hh // self.rows, ww // self.cols
            g = x.reshape(c, t, self.rows, h, self.cols, w).transpose(2, 4, 0, 1, 3, 5)
            return g.reshape(self.rows * self.cols, c, t, h, w)
        return self._local(local, True, False)(x)

    def join(self, x):
        """The strips [B, C, T, h, w] (jax) -> [1, C, T, H, W]."""
        def local(x):
            _, c, t, h, w = x.shape
            g = x.reshape(self.rows, self.cols, c, t, h, w).transpose(2, 3, 0, 4, 1, 5)
            return g.reshape(1, c, t, self.rows * h, self.cols * w)
        return self._local(local, False, True)(x)

    def halo(self, x, ph: int, pw: int):
        """Strips [B, ..., h, w] (jax) -> each with `ph` rows and `pw` columns of its
        neighbours' around it, zeros at the frame's edges (a conv's zero padding); across a
        band's edge they come from the adjacent device (collective-permute of those lines
        only). The neighbours' lines are gathered by strip index from the border lines alone
        and the strip written once with them: the batch axis stays whole (split into the grid
        it is tiled with the channels on a TPU, and was relaid out, several times a conv)."""
        jnp = jax.numpy

        def local(x):
            left, right = self._lines(x, pw, -1, 1, self.split == COLUMNS)
            if pw:
                x = jnp.concatenate([left, x, right], axis=-1)
            # the rows' halo from the strips with their columns': the corners come with it
            up, down = self._lines(x, ph, -2, 0, self.split == ROWS)
            return x if ph == 0 else jnp.concatenate([up, x, down], axis=-2)
        return self._local(local, False, False)(x)

    def _lines(self, x, width: int, dim: int, along: int, across: bool):
        """(before, after): for each strip of x, the `width` lines of dimension `dim` in front
        of it (its previous neighbour's last ones) and behind it (the next one's first ones),
        the neighbours along the grid's columns (along=1) or rows (0); across: at the band's
        edge from the adjacent devices, else zeros."""
        jnp = jax.numpy
        if width == 0:
            return None, None
        size = x.shape[dim]
        first = jax.lax.slice_in_dim(x, 0, width, axis=dim)
        last = jax.lax.slice_in_dim(x, size - width, size, axis=dim)
        # strip ids [position along the neighbours' axis, the other axis]
        grid = np.arange(self.rows * self.cols).reshape(self.rows, self.cols)
        grid = grid if along == 0 else grid.T
        n, others = grid.shape
        b = first.shape[0]
        if across and self.mesh is not None and self.n > 1:  # the band's edge strips' lines
            into = jax.lax.ppermute(jnp.take(last, grid[n - 1], axis=0), AXIS,
                                    [(i, i + 1) for i in range(self.n - 1)])
            outof = jax.lax.ppermute(jnp.take(first, grid[0], axis=0), AXIS,
                                     [(i + 1, i) for i in range(self.n - 1)])
            edge = b + np.arange(others)  # their place in the stacks below
        else:  # the frame's edge: the zero line after the stacks
            into = outof = first[:0]
            edge = np.full(others, b)
        before = np.empty(b, dtype=np.int32)
        after = np.empty(b, dtype=np.int32)
        before[grid[0]], after[grid[n - 1]] = edge, edge
        before[grid[1:]], after[grid[:-1]] = grid[:-1], grid[1:]
        zero = jnp.zeros_like(first[:1])
        return (jnp.take(jnp.concatenate([last, into, zero]), before, axis=0),
                jnp.take(jnp.concatenate([first, outof, zero]), after, axis=0))

    @staticmethod
    def torch(fn, x, **kwargs):
        """fn (one of the above) on a torch tensor of the trace."""
        from torchax.interop import call_jax

        return call_jax(functools.partial(fn, **kwargs), x)


@contextlib.contextmanager
def _wan_routes(vae, operands=None, strips=None):
    """The decoder's causal convs, 2-D convs, resamplers and Wan2.2's shortcut upsamplers
    routed through `_wan_conv`/`_conv2d`/`_wan_resample`/`_wan_dup_up`, its mid-block attention
    through `_wan_attention` (the post-quant conv is a causal 1x1x1 conv outside the
    decoder)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import (
        DupUp3D, WanAttentionBlock, WanResample)

    causal, conv2d = _wan_conv_types()
    routes = {causal: functools.partial(_wan_conv, operands=operands, strips=strips),
              conv2d: functools.partial(_conv2d, operands=operands, strips=strips),
              DupUp3D: _wan_dup_up,
              WanResample: functools.partial(_wan_resample, operands=operands, strips=strips)}
    if strips is not None:
        routes[WanAttentionBlock] = functools.partial(_wan_attention, strips=strips)
    with _routed(vae.decoder, routes), _routed(vae.post_quant_conv, routes):
        yield


def _wan_conv_types() -> tuple[type, type]:
    """The conv modules `_wan_routes` convolves with rounded operands: causal 3-D, plain 2-D."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    return WanCausalConv3d, torch.nn.Conv2d


def _conv_weights(vae) -> set[str]:
    """The names (in `_Decode`'s "vae.*" terms) of the weights `_wan_routes` convolves with
    rounded operands: they can be stored rounded."""
    return {".".join(filter(None, ("vae", part, name, "weight")))
            for part in ("decoder", "post_quant_conv")
            for name, m in getattr(vae, part).named_modules()
            if isinstance(m, _wan_conv_types())}


@contextlib.contextmanager
def _routed(module, routes: dict):
    """Each submodule of a type in `routes` runs `routes[type](submodule, *args)` instead of its
    forward, inside the block (the trace); the class code is untouched."""
    patched = []
    for m in module.modules():
        route = routes.get(type(m))
        if route is not None:
            m.forward = types.MethodType(route, m)
            patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


def _wan_first(vae, z, operands=None, strips=None):
    """Latent frame 0 -> (video frame 0, the cache in steady shapes; with `operands`, in that
    dtype: only convs read it, and they round it anyway). strips: z and the cache as `_Strips`
    (the video is joined)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResample

    rep_inputs = []  # the input of each 3-D upsampler, in call order ("Rep" in the cache)
    hooks = [m.register_forward_pre_hook(lambda m, args: rep_inputs.append(args[0]))
             for m in vae.decoder.modules() if isinstance(m, WanResample) and m.mode == "upsample3d"]
    try:
        cache = [None] * vae._cached_conv_counts["decoder"]
        with _wan_routes(vae, operands, strips):
            out = vae.decoder(vae.post_quant_conv(_cut(z, strips)), feat_cache=cache,
                              feat_idx=[0], first_chunk=True)
    finally:
        for h in hooks:
            h.remove()
    reps = iter(rep_inputs)
    state = []
    for entry in cache:
        if isinstance(entry, str):  # "Rep": no frame seen yet, i.e. zero padding
            x = next(reps)
            entry = torch.zeros_like(x[:, :, :1]).expand(-1, -1, 2, -1, -1)
        elif entry is not None and entry.shape[2] < 2:
            entry = torch.cat([torch.zeros_like(entry), entry], dim=2)
        state.append(entry)
    return _wan_video(vae, out, strips), _stored(state, operands)


def _wan_steady(vae, z, state, operands=None, strips=None):
    """Latent frame i > 0 with the cache of frame i - 1 -> (4 video frames, the next cache)."""
    cache = list(state)
    with _wan_routes(vae, operands, strips):
        out = vae.decoder(vae.post_quant_conv(_cut(z, strips)), feat_cache=cache, feat_idx=[0])
    return _wan_video(vae, out, strips), _stored(cache, operands)


def _cut(z, strips):
    return z if strips is None else strips.torch(strips.cut, z)


def _stored(state, operands):
    return state if operands is None else [
        s.to(operands) if isinstance(s, torch.Tensor) else s for s in state]


def _wan_video(vae, out, strips=None):
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    if vae.config.patch_size is not None:
        out = unpatchify(out, patch_size=vae.config.patch_size)
    out = torch.clamp(out, min=-1.0, max=1.0)
    return out if strips is None else strips.torch(strips.join, out)


# --- HunyuanVideo-1.5: conv caches and the mid-block K/V carried by hand ------------------------

class _HunyuanChunk:
    """While the decoder runs one latent frame, its causal convs, temporal upsamplers and
    mid-block attention read their state from `conv_in`/`kv_in` and append the next to
    `conv_out`/`kv_out`, in call order. first: the clip's first latent frame (convs pad time
    with it replicated, upsamplers treat it as the first frame); t: the frame's index (a 0-d
    int tensor)."""

    def __init__(self, first, conv_in, kv_in, t, kv_frames, split=ROWS):
        self.first, self.t, self.kv_frames, self.split = first, t, kv_frames, split
        self.conv_in, self.kv_in = iter(conv_in), iter(kv_in)
        self.conv_out, self.kv_out = [], []

    def conv(self, m, x):
        kt = m.time_causal_padding[4]
        if kt:
            front = x[:, :, :1].expand(-1, -1, kt, -1, -1) if self.first else next(self.conv_in)
            x = torch.cat([front, x], dim=2)
            self.conv_out.append(x[:, :, -kt:])
        pw, _, ph, _, _, _ = m.time_causal_padding
        if m.pad_mode != "replicate" or (ph, pw) != (1, 1):
            return m.conv(F.pad(x, (pw, pw, ph, ph, 0, 0), mode=m.pad_mode))
        return _replicate_split_conv(m.conv, x, self.split)

    def upsample(self, m, x):
        """Every frame of a steady chunk takes the upsampler's "next frames" path."""
        if self.first or not m.add_temporal_upsample:
            return type(m).forward(m, x)
        up = m._dcae_upsample_rearrange
        h = up(m.conv(x), r1=2, r2=2, r3=2)
        shortcut = up(x, r1=2, r2=2, r3=2).repeat_interleave(repeats=m.repeats, dim=1)
        return h + shortcut

    def attention(self, m, x):
        """The frame-causal attention of one latent frame against itself and every earlier
        one: its K/V go into frame slot t of the buffers, later slots are masked out."""
        identity = x
        x = m.norm(x)
        q, k, v = m.to_q(x), m.to_k(x), m.to_v(x)
        b, c, f, h, w = q.shape
        if f != 1:
            raise ValueError(f"the chunked HunyuanVideo-1.5 decode runs one latent frame per "
                             f"call; got {f}")

        def tokens(y):  # [B, C, 1, H, W] -> [B, 1, HW, C]
            return y.reshape(b, c, h * w).permute(0, 2, 1).unsqueeze(1)

        q, k, v = tokens(q), tokens(k), tokens(v)
        frame = torch.arange(self.kv_frames * h * w, device=q.device) // (h * w)  # key -> frame
        slot = (frame == self.t)[None, None, :, None]
        if self.first:
            k_all = torch.zeros((b, 1, self.kv_frames * h * w, c), dtype=k.dtype, device=k.device)
            v_all = torch.zeros_like(k_all)
        else:
            k_all, v_all = next(self.kv_in), next(self.kv_in)
        k_all = torch.where(slot, k.repeat(1, 1, self.kv_frames, 1), k_all)
        v_all = torch.where(slot, v.repeat(1, 1, self.kv_frames, 1), v_all)
        self.kv_out += [k_all, v_all]
        mask = torch.where(frame <= self.t, 0.0, float("-inf")).to(q.dtype)
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask[None, None, None, :])
        out = out.squeeze(1).reshape(b, h, w, c).permute(0, 3, 1, 2).unsqueeze(2)
        return m.proj_out(out) + identity


def _replicate_split_conv(conv, x, split):
    """conv(x with its border rows and columns replicated once), where `split` (ROWS or
    COLUMNS) is the dimension split over devices: the other one is replicate-padded (local to
    each device), the split one zero-padded by the conv, plus each border line's missing term
    (the kernel's outer line applied to that border line): the same sum, but XLA exchanges
    one-line halos, where a replicate pad of the split axis moves every line to another device
    first."""
    x = F.pad(x, (1, 1, 0, 0, 0, 0) if split == ROWS else (0, 0, 1, 1, 0, 0), mode="replicate")
    w, args = conv.weight, (conv.stride, 0, conv.dilation, conv.groups)
    y = F.conv3d(x, w, conv.bias, conv.stride, (0, 1, 0) if split == ROWS else (0, 0, 1),
                 conv.dilation, conv.groups)
    first = F.conv3d(x.narrow(split, 0, 1), w.narrow(split, 0, 1), None, *args)
    last = F.conv3d(x.narrow(split, x.shape[split] - 1, 1),
                    w.narrow(split, w.shape[split] - 1, 1), None, *args)
    line = torch.arange(y.shape[split], device=y.device)
    line = line[:, None] if split == ROWS else line
    return y + torch.where(line == 0, first, 0.0) + torch.where(line == y.shape[split] - 1, last, 0.0)


def _patched(vae, chunk: _HunyuanChunk):
    """The decoder's causal convs, upsamplers and attention blocks routed through `chunk`."""
    from diffusers.models.autoencoders import autoencoder_kl_hunyuanvideo15 as hy

    return _routed(vae.decoder, {
        hy.HunyuanVideo15CausalConv3d: lambda m, x: chunk.conv(m, x),
        hy.HunyuanVideo15Upsample: lambda m, x: chunk.upsample(m, x),
        hy.HunyuanVideo15AttnBlock: lambda m, x: chunk.attention(m, x)})


def _hunyuan_chunk(vae, z, conv_state, kv_state, t, *, first, kv_frames, split=ROWS):
    chunk = _HunyuanChunk(first, conv_state, kv_state, t, kv_frames, split)
    with _patched(vae, chunk):
        out = vae.decoder(z)
    return out, chunk.conv_out, chunk.kv_out


# --- the decoder ---------------------------------------------------------------------------------

class JaxVaeDecoder:
    """Decodes [1, C, F, H, W] VAE latents (already de-normalised: `modules.vae.to_vae_latents`)
    into the video [1, 3, 4(F-1)+1, H*s, W*s] as float32 numpy, on JAX.

    vae: a diffusers AutoencoderKLWan / AutoencoderKLHunyuanVideo15 or PixelLatents, on the
    host in the dtype to compute in (its weights are copied to the devices once).
    mesh: a 1-D mesh (`make_mesh`) to split the frame's rows over; None: one device.
    abstract: hold the weights as shapes only (a VAE built on the meta device, a mesh of
    compile-only TPU devices): `prepare` then compiles for that slice and nothing can run
    (`tpu.vae_aot`).
    conv_operands: the dtype the Wan decoders round conv operands to (see the module's doc),
    None for as stored; "auto": `conv_operand_dtype` for the mesh's platform.
    strips: (rows, columns) of strips the Wan decoders cut each device's band of the frame into
    (`_Strips`); "auto": `strip_grid` for the mesh's platform.
    frames_per_call: latent frames each steady call of a Wan decoder decodes (the last call's
    missing ones zeros, their video dropped: the convs are causal); "auto": WAN_FRAMES_PER_CALL.
    """

    def __init__(self, vae, mesh: Mesh | None = None, *, abstract: bool = False,
                 conv_operands: torch.dtype | None | str = "auto",
                 strips: tuple[int, int] | str = "auto", frames_per_call: int | str = "auto"):
        self.torchax = import_torchax()
        self.env = self.torchax.default_env()
        self.family = family(vae)
        self.vae, self.mesh, self.abstract = vae, mesh, abstract
        self.split = ROWS  # set per latent shape by `prepare` (`split_plan`)
        if abstract and mesh is None:
            raise ValueError("an abstract decoder compiles for a mesh; expected mesh= (one device "
                             "or more)")
        self.module = _Decode(vae)
        self.dtype = next(iter(vae.parameters()), torch.zeros(())).dtype
        platform = (mesh.devices.flat[0] if mesh is not None else jax.local_devices()[0]).platform
        if conv_operands == "auto":
            conv_operands = conv_operand_dtype(self.dtype, platform) \
                if self.family == "wan" else None
        elif conv_operands is not None and self.family != "wan":
            raise ValueError(f"conv_operands rounds the Wan decoders' convs; {type(vae).__name__}"
                             " convolves as stored (expected conv_operands=None or 'auto')")
        self.operands = conv_operands
        self.platform = platform
        if strips != "auto" and (self.family != "wan" or len(strips) != 2
                                 or min(strips) < 1):
            raise ValueError(f"strips={strips!r}: expected 'auto' or (rows, columns) of at least "
                             "1 each, for a Wan VAE")
        self.grid = strips
        self.strips = None  # set per latent shape by `prepare`
        if frames_per_call == "auto":
            frames_per_call = WAN_FRAMES_PER_CALL if self.family == "wan" else 1
        if not isinstance(frames_per_call, int) or frames_per_call < 1 or (
                frames_per_call > 1 and self.family != "wan"):
            raise ValueError(f"frames_per_call={frames_per_call!r}: expected 'auto' or a positive "
                             "integer (above 1 for a Wan VAE only)")
        self.per_call = frames_per_call
        rounded = _conv_weights(vae) if conv_operands is not None else set()
        tensors = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        # the decoder's side only: the encoder's weights (a third of the Wan2.2 VAE's) would sit
        # on every device unused
        self.params = {name: self._put(t.to(conv_operands) if name in rounded else t,
                                       self._replicated())
                       for name, t in tensors.items() if not name.startswith(_ENCODER)}
        devices = tuple((d.platform, d.device_kind, d.id) for d in mesh.devices.flat) \
            if mesh is not None else None
        config = sorted((k, repr(v)) for k, v in dict(getattr(vae, "config", {})).items())
        self._arch = (type(vae).__name__, tuple(config), str(self.dtype), str(conv_operands),
                      devices, strips)
        # (latent shape of one frame, kv_frames) -> (first, steady)
        self._programs = _COMPILED.setdefault(self._arch, {})

    # placement ------------------------------------------------------------------------------

    def _replicated(self):
        return None if self.mesh is None else NamedSharding(self.mesh, P())

    def _rows(self, ndim=5):
        """The sharding of a [B, C, T, H, W] array: split by rows or columns (`self.split`)."""
        if self.mesh is None or ndim != 5:
            return None
        spec = [None] * 5
        spec[self.split] = AXIS
        return NamedSharding(self.mesh, P(*spec))

    def _put(self, tensor: torch.Tensor, sharding):
        if self.abstract:
            dtype = jax.dtypes.canonicalize_dtype(str(tensor.dtype).removeprefix("torch."))
            return jax.ShapeDtypeStruct(tuple(tensor.shape), dtype, sharding=sharding)
        if tensor.dtype == torch.bfloat16:  # numpy has no bf16: through torchax's mapping
            array = self.env.t2j_copy(tensor.detach().contiguous())
            return array if sharding is None else jax.device_put(array, sharding)
        return jax.device_put(tensor.detach().cpu().numpy(), sharding)

    def _state_shardings(self, abstract):
        """Cached frames split like the activations (Wan: strips by the batch axis); K/V
        buffers replicated."""
        if self.strips is not None and self.mesh is not None:
            return jax.tree.map(lambda a: NamedSharding(self.mesh, P(AXIS)), abstract)
        return jax.tree.map(lambda a: self._rows(a.ndim) or self._replicated(), abstract)

    def _plan_strips(self, h: int, w: int):
        """The `_Strips` of a latent frame of h x w (None: the frame whole on one device)."""
        n = 1 if self.mesh is None else self.mesh.size
        band = (h // n, w) if self.split == ROWS else (h, w // n)
        rows, cols = strip_grid(*band, self.platform) if self.grid == "auto" else self.grid
        if band[0] % rows or band[1] % cols:
            raise ValueError(f"strips {rows} x {cols}: each device's band of the latent frame is "
                             f"{band[0]} x {band[1]}; expected divisors of those")
        if n * rows * cols == 1:
            return None
        return _Strips(n, self.split, rows, cols, self.mesh)

    # programs -------------------------------------------------------------------------------

    def _trace(self, fn):
        module, env = self.module, self.env

        def traced(params, *args):
            with env, torch.no_grad():
                return torch.func.functional_call(module, params, (fn, *args))

        return self.torchax.interop.jax_view(traced)

    def kv_frames(self, frames: int) -> int:
        return math.ceil(frames / KV_BUCKET) * KV_BUCKET

    def prepare(self, latent_shape) -> tuple:
        """Compile (once per frame size and K/V bucket) the first and steady programs for
        latents of `latent_shape`; returns the compiled pair."""
        b, c, frames, h, w = latent_shape
        if self.mesh is not None:
            n, self.split = split_plan(h, w, self.mesh.size)
            if n != self.mesh.size:
                raise ValueError(f"a latent of {h} x {w} splits over no {self.mesh.size} devices "
                                 f"by rows or columns; use {n} (tpu.vae.split_plan)")
        self.strips = self._plan_strips(h, w) if self.family == "wan" else None
        kv = self.kv_frames(frames) if self.family == "hunyuan" else 0
        key = ((b, c, h, w), kv, self.per_call) if self.family != "pixels" \
            else tuple(latent_shape)
        if key in self._programs:
            return self._programs[key]
        split = self.split
        dt = jax.numpy.dtype(str(self.dtype).removeprefix("torch."))
        if self.family == "pixels":
            z = jax.ShapeDtypeStruct(tuple(latent_shape), dt, sharding=self._rows())
            program = jax.jit(self._trace(lambda vae, z: vae.decode(z)[0].float()),
                              out_shardings=self._rows())
            self._programs[key] = (program.lower(self.params, z).compile(), None)
            return self._programs[key]
        z = jax.ShapeDtypeStruct((b, c, 1, h, w), dt, sharding=self._rows())
        if self.family == "wan":
            operands = self.operands
            strips = self.strips

            def first_fn(vae, z):
                out, state = _wan_first(vae, z, operands, strips)
                return out.float(), state

            def steady_fn(vae, z, state):
                out, state = _wan_steady(vae, z, state, operands, strips)
                return out.float(), state
        else:
            def first_fn(vae, z):
                out, conv, kvs = _hunyuan_chunk(vae, z, [], [], 0, first=True, kv_frames=kv,
                                                split=split)
                return out.float(), (conv, kvs)

            def steady_fn(vae, z, state, t):
                out, conv, kvs = _hunyuan_chunk(vae, z, state[0], state[1], t, first=False,
                                                kv_frames=kv, split=split)
                return out.float(), (conv, kvs)

        first_abstract = jax.eval_shape(self._trace(first_fn), self.params, z)
        state = self._state_shardings(first_abstract[1])
        outs = (self._rows(), state)
        first = jax.jit(self._trace(first_fn), out_shardings=outs).lower(self.params, z)
        z = jax.ShapeDtypeStruct((b, c, self.per_call, h, w), dt, sharding=self._rows())
        s_abs = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             first_abstract[1], state)
        steady = jax.jit(self._trace(steady_fn), out_shardings=outs)
        if self.family == "wan":
            steady = steady.lower(self.params, z, s_abs)
        else:
            t = jax.ShapeDtypeStruct((), jax.numpy.int32, sharding=self._replicated())
            steady = steady.lower(self.params, z, s_abs, t)
        # the two compiles are independent and XLA's runs without the GIL: side by side they
        # take the longer one's time where the host has the cores (a TPU VM has hundreds)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            self._programs[key] = tuple(pool.map(lambda lowered: lowered.compile(),
                                                 (first, steady)))
        return self._programs[key]

    # the loop -------------------------------------------------------------------------------

    def decode(self, z: torch.Tensor) -> np.ndarray:
        """The video, float32 [1, 3, frames, height, width] in the VAE's output range."""
        if self.abstract:
            raise RuntimeError("an abstract decoder holds no weights; it can only compile")
        first, steady = self.prepare(tuple(z.shape))
        z = z.to(self.dtype)
        if self.family == "pixels":
            return np.asarray(first(self.params, self._put(z, self._rows())))
        chunks = []
        out, state = first(self.params, self._put(z[:, :, :1], self._rows()))
        k, frames = self.per_call, z.shape[2]
        for i in range(1, frames, k):  # host slices and transfers: no device op to compile
            part = z[:, :, i:i + k]
            if part.shape[2] < k:  # the clip's last frames: zeros after them change nothing
                part = torch.cat([part, part.new_zeros(*part.shape[:2], k - part.shape[2],
                                                       *part.shape[3:])], dim=2)
            previous, part = out, self._put(part, self._rows())
            if self.family == "wan":
                out, state = steady(self.params, part, state)
            else:
                t = jax.device_put(np.int32(i), self._replicated())
                out, state = steady(self.params, part, state, t)
            # the previous chunk comes to the host while this call runs: at most two video
            # chunks are ever on the device (tpu.vae_aot's memory plan counts them)
            chunks.append(np.asarray(previous))
        last = np.asarray(out)
        padded = -(frames - 1) % k  # the zero latent frames of the last call
        chunks.append(last[:, :, :last.shape[2] - padded * (last.shape[2] // k)])
        return np.concatenate(chunks, axis=2)

    def compile_counts(self):
        return compile_counts()

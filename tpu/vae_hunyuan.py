"""HunyuanVideo-1.5 VAE (AutoencoderKLHunyuanVideo15) decode plan (`HunyuanPlan`): diffusers
decodes the whole clip at once. Its convs pad time with the first frame replicated and its
mid-block attention is frame-causal over every earlier latent frame, so the chunked decode
carries each causal conv's last 2 input frames and the mid-block K/V of all earlier frames, in
buffers of `kv_frames` latent frames (the clip's count rounded up to a multiple of KV_BUCKET, so
clips of 1-8 latent frames share programs, 9-16 the next ones, ...), masked by frame. Each
call is a chain of block programs (tpu/vae_chain.py), as the Wan decoders' are.

On a mesh XLA partitions the convolutions (GSPMD: each 3x3 conv exchanges a line of halo with its
neighbours by collective-permute); the replicate padding of the split dimension is rewritten so
that only those halos move (`_replicate_split_conv`).
"""

from __future__ import annotations

import math

import jax
import numpy as np
import torch
import torch.nn.functional as F

from .vae_plan import ROWS, ChunkedPlan, Placement, routed

KV_BUCKET = 8  # the mid-block K/V buffers hold a multiple of 8 latent frames


def kv_frames(frames: int) -> int:
    """The latent frames the K/V buffers of a clip of `frames` hold (a multiple of KV_BUCKET)."""
    return math.ceil(frames / KV_BUCKET) * KV_BUCKET


# --- conv caches and the mid-block K/V carried by hand -------------------------------------------

class _Chunk:
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


def _patched(vae, chunk: _Chunk):
    """The decoder's causal convs, upsamplers and attention blocks routed through `chunk`."""
    from diffusers.models.autoencoders import autoencoder_kl_hunyuanvideo15 as hy

    return routed(vae.decoder, {
        hy.HunyuanVideo15CausalConv3d: lambda m, x: chunk.conv(m, x),
        hy.HunyuanVideo15Upsample: lambda m, x: chunk.upsample(m, x),
        hy.HunyuanVideo15AttnBlock: lambda m, x: chunk.attention(m, x)})


def hunyuan_steps(vae, *, first: bool, kv_frames: int, split=ROWS):
    """The decoder's call as `Step`s (tpu/vae_chain.py) in diffusers' order: conv_in with its
    channel-repeat shortcut, the mid block's residual blocks and attention, each up block's
    residual blocks and upsamplers, the head; each block's causal convs' last frames (or the
    attention's K/V) on its own state slots. The steady attention reads the frame's index "t".
    Returns (steps, slots)."""
    from diffusers.models.autoencoders import autoencoder_kl_hunyuanvideo15 as hy

    from .vae_chain import Step

    def run(module_call, kv=False):
        def fn(p, x, *rest):
            *t, cache = rest
            chunk = _Chunk(first, [] if kv else cache, cache if kv else [], t[0] if t else 0,
                           kv_frames, split)
            with _patched(vae, chunk):
                x = module_call(p, x)
            return x, chunk.conv_out + chunk.kv_out
        return fn

    def state_of(module) -> int:  # the causal convs that carry frames
        return sum(isinstance(m, hy.HunyuanVideo15CausalConv3d) and m.time_causal_padding[4] > 0
                   for m in module.modules())

    decoder, steps, slot = vae.decoder, [], 0

    def add(kind, parts, call, slots, kv=False, **kw):
        nonlocal slot
        steps.append(Step(f"{kind}-{'first' if first else 'steady'}", parts, run(call, kv),
                          tuple(range(slot, slot + slots)), **kw))
        slot += slots

    def block(p, x):
        return p.m(x)

    def one(path):
        return (("m", path),)

    add("in", one("decoder.conv_in"),
        lambda p, z: p.m(z) + z.repeat_interleave(repeats=decoder.repeat, dim=1),
        state_of(decoder.conv_in), inputs=("z",))
    mid = decoder.mid_block
    add("res", one("decoder.mid_block.resnets.0"), block, state_of(mid.resnets[0]))
    for j, attn in enumerate(mid.attentions):
        if attn is not None:
            add("attn", one(f"decoder.mid_block.attentions.{j}"), block, 2, kv=True,
                inputs=("x",) if first else ("x", "t"))
        add("res", one(f"decoder.mid_block.resnets.{j + 1}"), block, state_of(mid.resnets[j + 1]))
    for i, up in enumerate(decoder.up_blocks):
        for j, res in enumerate(up.resnets):
            add("res", one(f"decoder.up_blocks.{i}.resnets.{j}"), block, state_of(res))
        for j, sampler in enumerate(up.upsamplers or ()):
            add("up", one(f"decoder.up_blocks.{i}.upsamplers.{j}"), block, state_of(sampler))
    add("head", (("norm", "decoder.norm_out"), ("conv", "decoder.conv_out")),
        lambda p, x: p.conv(decoder.conv_act(p.norm(x))).float(), state_of(decoder.conv_out))
    return steps, slot


# --- the plan ------------------------------------------------------------------------------------

class HunyuanPlan(ChunkedPlan):
    """A first call and a steady one of one latent frame, each a chain of block programs
    (`hunyuan_steps`), the causal convs' last frames and the mid-block K/V of every earlier
    frame carried between calls; the steady call also takes its frame's index. The programs
    depend on the clip's K/V bucket (`kv_frames`)."""

    vae_class, family = "AutoencoderKLHunyuanVideo15", "hunyuan"

    def key(self, latent_shape) -> tuple:
        b, c, frames, h, w = latent_shape
        return (b, c, h, w), kv_frames(frames), self.per_call

    steady_extra_names = ("t",)

    def steps(self, vae, placement, latent_shape, first):
        return hunyuan_steps(vae, first=first, kv_frames=kv_frames(latent_shape[2]),
                             split=placement.split)

    def steady_extras(self, placement: Placement, frame: int | None) -> tuple:
        """The index of the steady call's latent frame (a 0-d int32)."""
        if frame is None:
            return (jax.ShapeDtypeStruct((), jax.numpy.int32, sharding=placement.replicated()),)
        return (jax.device_put(np.int32(frame), placement.replicated()),)

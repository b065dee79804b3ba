"""The Wan2.2 DiT shared by TI2V-5B and each I2V-A14B expert, static-shape and staged.

Parameter names are the official checkpoint keys (`wan/modules/model.py::WanModel`), so an
official state dict loads as is; `modules/wan_format.py` converts the diffusers layout.
Staged API: `prepare` -> `block(i)` x num_layers -> `final` (head and unpatchify; `head` is
the official name of the head's parameters); `forward` is exactly that.

B batch, C channels, F/Hh/W latent frames/height/width, f/h/w token grid, L = f*h*w tokens,
T = 1 (one timestep per sample) or L (per-token timesteps, TI2V), S text tokens, D model dim,
N heads, H head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from modules import ops
from modules.layers import (
    LayerNorm,
    Linear,
    ModelConfigError,
    RMSNorm,
    StagedDiT,
    patchify,
    time_mlp,
    timestep_sinusoid,
)


@dataclass(frozen=True, kw_only=True)
class WanDims:
    """What every Wan2.2 DiT config shares: patch, text and RoPE settings, the heads' RoPE split."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_len: int = 512
    text_dim: int = 4096
    freq_dim: int = 256
    eps: float = 1e-6
    rope_theta: float = 10000.0

    def _check_dims(self):
        if self.dim % self.num_heads:
            raise ModelConfigError(f"dim {self.dim} is not a multiple of num_heads {self.num_heads}")
        if self.head_dim % 2 or min(self.rope_axes) <= 0:
            raise ModelConfigError(f"head_dim {self.head_dim} must be even and at least 6 (RoPE)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def rope_axes(self) -> tuple[int, int, int]:
        """Channels per axis (t, h, w): 44/42/42 for head_dim 128 (trap T5)."""
        d = self.head_dim
        return (d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6))


@dataclass(frozen=True)
class WanConfig(WanDims):
    dim: int
    ffn_dim: int
    num_layers: int
    num_heads: int
    in_dim: int
    out_dim: int
    model_type: str  # "ti2v" (per-token timesteps) or "i2v" (channel-concat conditioning)

    def __post_init__(self):
        if self.model_type not in ("ti2v", "i2v", "t2v"):
            raise ModelConfigError(f"model_type {self.model_type!r}: expected ti2v, i2v or t2v")
        self._check_dims()


_WAN_A14B = dict(dim=5120, ffn_dim=13824, num_layers=40, num_heads=40, in_dim=36, out_dim=16,
                 model_type="i2v")
CONFIGS: dict[str, WanConfig] = {
    "wan2.2-ti2v-5b": WanConfig(dim=3072, ffn_dim=14336, num_layers=30, num_heads=24,
                                in_dim=48, out_dim=48, model_type="ti2v"),
    # The two A14B experts share one architecture; the sampler switches at t >= 900.
    "wan2.2-i2v-a14b-high": WanConfig(**_WAN_A14B),
    "wan2.2-i2v-a14b-low": WanConfig(**_WAN_A14B),
    # Tiny random-weight models for tests: head_dim 12 splits 4/4/4 across the RoPE axes.
    "wan-tiny-ti2v": WanConfig(dim=24, ffn_dim=32, num_layers=4, num_heads=2, in_dim=4,
                               out_dim=4, model_type="ti2v", text_len=16, text_dim=16),
    "wan-tiny-i2v": WanConfig(dim=24, ffn_dim=32, num_layers=4, num_heads=2, in_dim=12,
                              out_dim=4, model_type="i2v", text_len=16, text_dim=16),
    # The tiny model trained here on procedural clips (assets/tiny-wan-ti2v, bench/fixtures):
    # pixel space (3 channels), one 4x4 token per patch.
    "wan-tiny-trained": WanConfig(dim=96, ffn_dim=256, num_layers=6, num_heads=4, in_dim=3,
                                  out_dim=3, model_type="ti2v", patch_size=(1, 4, 4), text_len=16,
                                  text_dim=64),
    # The second recipe's model (bench/fixtures/scenes.py, issue 60): 15x15 clips of 5 frames
    # in 1x3x3 patches (125 tokens), five blocks, 20 text positions.
    "wan-tiny-scenes": WanConfig(dim=96, ffn_dim=320, num_layers=5, num_heads=4, in_dim=3,
                                 out_dim=3, model_type="ti2v", patch_size=(1, 3, 3), text_len=20,
                                 text_dim=64),
}

# Parameters that stay fp32 when the rest is cast to bf16: the official code runs the time
# embedding, time projection and every modulation add in fp32 (model_spec 2.4).
KEEP_FP32 = ("time_embedding.", "time_projection.", ".modulation", "head.modulation", ".norm3.")


class WanContext(NamedTuple):
    """What every block and the head need besides the hidden state; plain tensors only."""

    e: torch.Tensor  # [B, T, D] fp32 time embedding; head modulation, TeaCache "time_embedding"
    e0: torch.Tensor  # [B, T, 6, D] fp32 time projection; block modulation
    context: torch.Tensor  # [B, S, D] embedded text, zero-padded to text_len before the MLP
    rope_cos: torch.Tensor  # [L, H/2]
    rope_sin: torch.Tensor  # [L, H/2]


class WanAttention(nn.Module):
    """Self- or cross-attention with q/k RMSNorm over all heads at once (trap T1)."""

    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.q, self.k, self.v, self.o = (Linear(cfg.dim, cfg.dim) for _ in range(4))
        self.norm_q = RMSNorm(cfg.dim, cfg.eps)
        self.norm_k = RMSNorm(cfg.dim, cfg.eps)

    def forward(self, x_BLD, kv_BSD, rope=None, key_mask_BS=None):
        q = self.norm_q(self.q(x_BLD)).unflatten(-1, (self.num_heads, -1))
        k = self.norm_k(self.k(kv_BSD)).unflatten(-1, (self.num_heads, -1))
        v = self.v(kv_BSD).unflatten(-1, (self.num_heads, -1))
        if rope is not None:
            q, k = ops.rope(q, *rope), ops.rope(k, *rope)
        return self.o(ops.attention(q, k, v, key_mask_BS).flatten(-2))


class WanBlock(nn.Module):
    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.eps = cfg.eps
        self.self_attn = WanAttention(cfg)
        self.norm3 = LayerNorm(cfg.dim, cfg.eps)  # affine, before cross-attention; diffusers `norm2` (T4)
        self.cross_attn = WanAttention(cfg)
        self.ffn = nn.Sequential(Linear(cfg.dim, cfg.ffn_dim), nn.GELU(approximate="tanh"),
                                 Linear(cfg.ffn_dim, cfg.dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, cfg.dim) / cfg.dim**0.5)

    def modulation_chunks(self, ctx: WanContext):
        """shift_msa, scale_msa, gate_msa, shift_ffn, scale_ffn, gate_ffn, each [B, T, D] fp32."""
        return (self.modulation.float().unsqueeze(0) + ctx.e0).unbind(2)

    def forward(self, h_BLD: torch.Tensor, ctx: WanContext, key_mask_BL=None) -> torch.Tensor:
        return self.forward_gated(h_BLD, ctx, key_mask_BL)[0]

    def forward_gated(self, h_BLD: torch.Tensor, ctx: WanContext, key_mask_BL=None):
        """(the block's output, (self-attention output, FFN output)): the two sub-layer outputs
        the block adds scaled by its gate rows, given before that scaling, fp32."""
        shift_msa, scale_msa, gate_msa, shift_ffn, scale_ffn, gate_ffn = self.modulation_chunks(ctx)
        y = ops.layer_norm_modulate(h_BLD, shift_msa, scale_msa, self.eps)
        attn = self.self_attn(y, y, (ctx.rope_cos, ctx.rope_sin), key_mask_BL).float()
        h_BLD = h_BLD + attn * gate_msa
        y = self.norm3(h_BLD)
        h_BLD = h_BLD + self.cross_attn(y, ctx.context).float()
        y = ops.layer_norm_modulate(h_BLD, shift_ffn, scale_ffn, self.eps)
        ffn = self.ffn(y).float()
        return h_BLD + ffn * gate_ffn, (attn, ffn)

    def time_gates(self, ctx: WanContext):
        """The time term of the gate rows `forward_gated`'s outputs are scaled by: each gate is
        this block's modulation row plus it, and it is the same for every block (e0's chunks)."""
        e0 = ctx.e0.unbind(2)
        return e0[2], e0[5]


class WanHead(nn.Module):
    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.eps = cfg.eps
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim) / cfg.dim**0.5)
        self.head = Linear(cfg.dim, math.prod(cfg.patch_size) * cfg.out_dim)

    def forward(self, h_BLD, e_BTD):
        # Modulated by `e` itself, not SiLU(e) or e0; shift before scale (trap T2).
        shift, scale = (self.modulation.float().unsqueeze(0) + e_BTD.unsqueeze(2)).unbind(2)
        return self.head(ops.layer_norm_modulate(h_BLD, shift, scale, self.eps))


class WanDiT(StagedDiT):
    block_cls = WanBlock  # S2V swaps in its segmented-modulation block

    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.config = cfg
        d = cfg.dim
        # Conv3d only holds the official [D, C, pt, ph, pw] weight; prepare() applies it as a
        # matmul over non-overlapping patches, which is what kernel == stride computes.
        self.patch_embedding = nn.Conv3d(cfg.in_dim, d, cfg.patch_size, cfg.patch_size)
        self.text_embedding = nn.Sequential(Linear(cfg.text_dim, d), nn.GELU(approximate="tanh"),
                                            Linear(d, d))
        self.time_embedding = time_mlp(cfg.freq_dim, d)
        self.time_projection = nn.Sequential(nn.SiLU(), Linear(d, 6 * d))
        self.blocks = nn.ModuleList(self.block_cls(cfg) for _ in range(cfg.num_layers))
        self.head = WanHead(cfg)

    # --- staged API ------------------------------------------------------------------------

    def prepare(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                y: torch.Tensor | None = None, rope=None) -> tuple[torch.Tensor, WanContext]:
        """Embed one model call's inputs.

        x [B, C, F, H, W] noisy latent; t [B] timesteps (sigma * 1000) or [B, L] per token
        (TI2V); context [B, S<=text_len, text_dim] text features, zero-padded here; y
        [B, C_y, F, H, W] I2V condition (mask and image latent), concatenated on channels;
        rope: `self.rope(grid, device)`, built once per shape (built here when omitted).
        Returns the fp32 hidden state entering block 0 and the WanContext.
        """
        cfg = self.config
        if y is not None:
            x = torch.cat([x, y.to(x.dtype)], dim=1)
        batch, channels = x.shape[:2]
        if x.ndim != 5 or channels != cfg.in_dim:
            raise ModelConfigError(
                f"latent (with condition) has shape {tuple(x.shape)}; expected [B, {cfg.in_dim}, "
                f"F, H, W]" + (" - I2V needs y (mask and image latent)" if y is None
                               and cfg.model_type == "i2v" else ""))
        grid = self.grid(x.shape)
        tokens = math.prod(grid)
        h_BLD = patchify(x, grid, self.patch_embedding)

        if t.ndim == 1 and t.shape[0] == batch:
            t_BT = t[:, None]
        elif t.ndim == 2 and tuple(t.shape) == (batch, tokens):
            t_BT = t
        else:
            raise ModelConfigError(f"timestep has shape {tuple(t.shape)}; expected [{batch}] or "
                                   f"[{batch}, {tokens}] (one per token)")
        e, e0 = self._embed_time(t_BT)
        context = self._embed_text(context, batch)
        if rope is None:
            rope = self.rope(grid, x.device)
        return h_BLD, WanContext(e, e0, context, *rope)

    def _embed_time(self, t_BT):
        """e [B, T, D] and e0 [B, T, 6, D], fp32 (model_spec 2.2 step 3)."""
        e = self.time_embedding(timestep_sinusoid(t_BT, self.config.freq_dim)).float()
        return e, self.time_projection(e).float().unflatten(-1, (6, self.config.dim))

    def _embed_text(self, context, batch: int):
        cfg = self.config
        if context.ndim != 3 or context.shape[0] != batch or context.shape[2] != cfg.text_dim \
                or context.shape[1] > cfg.text_len:
            raise ModelConfigError(f"context has shape {tuple(context.shape)}; expected "
                                   f"[{batch}, <= {cfg.text_len}, {cfg.text_dim}]")
        # Pad before the MLP and attend to the padding: that is what the model was trained on (T3).
        context = nn.functional.pad(context, (0, 0, 0, cfg.text_len - context.shape[1]))
        return self.text_embedding(context)

    def block(self, i: int, h_BLD: torch.Tensor, ctx: WanContext) -> torch.Tensor:
        return self.blocks[i](h_BLD, ctx)

    def block_gated(self, i: int, h_BLD: torch.Tensor, ctx: WanContext):
        """block(i) and the outputs it adds scaled by time-gated rows, before that scaling (the
        order of `time_gates`)."""
        return self.blocks[i].forward_gated(h_BLD, ctx)

    def time_gates(self, ctx: WanContext):
        """The time term every block's gate rows share: block i's output is
        h + R_i + sum_k (m_ik + time_gates[k]) * y_ik with y_ik = block_gated(i)[1][k] and m_ik
        block i's own rows, so a sum over blocks of their outputs splits into a part no time
        term scales and the sums of y_k each time term scales."""
        return self.blocks[0].time_gates(ctx)

    def final(self, h_BLD: torch.Tensor, ctx: WanContext, grid) -> torch.Tensor:
        """Final modulated norm, projection and unpatchify: [B, out_dim, F, H, W] fp32."""
        return self._unpatchify(self.head(h_BLD, ctx.e), grid)

    def signature(self, kind: str, h_BLD: torch.Tensor, ctx: WanContext) -> torch.Tensor:
        """The tensor a TeaCache signature summarises (names match cache/teacache_profiles.py)."""
        if kind == "modulated_input":
            shift, scale = self.blocks[0].modulation_chunks(ctx)[:2]
            return ops.layer_norm_modulate(h_BLD, shift, scale, self.config.eps)
        if kind == "time_embedding":
            return ctx.e
        if kind == "time_projection":
            return ctx.e0
        raise ModelConfigError(f"unknown signature {kind!r}; expected modulated_input, "
                               "time_embedding or time_projection")

    def forward(self, x, t, context, y=None):
        grid = self.grid(x.shape)
        h, ctx = self.prepare(x, t, context, y)
        for i in range(self.num_blocks):
            h = self.block(i, h, ctx)
        return self.final(h, ctx, grid)

    # --- patches ---------------------------------------------------------------------------

    def _unpatchify(self, out_BLX, grid):
        # The head lays each token out as (pt, ph, pw, c), c fastest (trap T11).
        b, c = out_BLX.shape[0], self.config.out_dim
        (f, h, w), (pt, ph, pw) = grid, self.config.patch_size
        u = out_BLX.reshape(b, f, h, w, pt, ph, pw, c).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return u.reshape(b, c, f * pt, h * ph, w * pw).float()

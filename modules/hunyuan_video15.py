"""HunyuanVideo-1.5 (8.3 B): 54 dual-stream blocks, token refiner, byT5 and vision branches.

Parameter names are the official keys (`HunyuanVideo_1_5_DiffusionTransformer`). Static shapes:
the context is a fixed [vision | byT5 | MLLM] sequence with a key-padding mask (model_spec 3.5,
3.3 step 7), and T2V versus I2V is the `i2v` argument, never read from tensor values (T22).
Staged API: `prepare` -> `block(i)` x num_layers -> `final`. The hidden state is the pair
(img, txt): the text stream is updated by every block, so a cached tail needs both.

B batch, C latent channels, L image tokens, S context tokens (vision + byT5 + MLLM), D hidden,
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


@dataclass(frozen=True)
class HunyuanVideo15Config:
    hidden_size: int = 2048
    num_heads: int = 16
    num_layers: int = 54
    in_channels: int = 32  # latent channels; the patch embedding reads 2 * C + 1 (T17)
    out_channels: int = 32
    patch_size: tuple[int, int, int] = (1, 1, 1)
    rope_axes: tuple[int, int, int] = (16, 56, 56)
    rope_theta: float = 256.0  # not 10000 (T14)
    mlp_ratio: float = 4.0
    refiner_layers: int = 2
    refiner_mlp_ratio: float = 4.0
    text_dim: int = 3584  # Qwen2.5-VL hidden states
    text_len: int = 1000
    byt5_dim: int = 1472
    byt5_hidden: int = 2048  # hard-coded in the official ByT5Mapper and in diffusers
    byt5_len: int = 256
    vision_dim: int = 1152  # SigLIP
    vision_len: int = 729
    use_meanflow: bool = False  # 480p_i2v_step_distilled adds time_r_in (T23)
    eps: float = 1e-6

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ModelConfigError(f"hidden_size {self.hidden_size} is not a multiple of "
                                   f"num_heads {self.num_heads}")
        if sum(self.rope_axes) != self.head_dim or any(d % 2 for d in self.rope_axes):
            raise ModelConfigError(f"rope_axes {self.rope_axes} must be even and sum to "
                                   f"head_dim {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def context_len(self) -> int:
        return self.vision_len + self.byt5_len + self.text_len


# vision_len 4: a SigLIP's token count is a square ((image_size / patch_size)^2), so the tiny
# stage-1 SigLIP (28 px, patch 14) gives 4 tokens; 5 could come from no vision encoder.
_TINY = dict(hidden_size=16, num_heads=2, num_layers=4, in_channels=4, out_channels=4,
             rope_axes=(2, 2, 4), mlp_ratio=2.0, refiner_layers=1, text_dim=16, text_len=10,
             byt5_dim=8, byt5_len=6, vision_dim=12, vision_len=4)
# Every released variant shares the architecture; only the step-distilled one adds time_r_in.
# Sampling settings per variant (shift, guidance, steps) belong to the sampler, not here.
CONFIGS: dict[str, HunyuanVideo15Config] = {
    **{f"hunyuanvideo-1.5-{v}": HunyuanVideo15Config() for v in (
        "480p_t2v", "480p_i2v", "720p_t2v", "720p_i2v", "480p_t2v_distilled",
        "480p_i2v_distilled", "720p_i2v_distilled", "720p_i2v_distilled_sparse")},
    "hunyuanvideo-1.5-480p_i2v_step_distilled": HunyuanVideo15Config(use_meanflow=True),
    "hunyuanvideo-tiny": HunyuanVideo15Config(**_TINY),
    "hunyuanvideo-tiny-meanflow": HunyuanVideo15Config(**_TINY, use_meanflow=True),
    # The tiny model trained here on procedural clips (assets/tiny-hunyuanvideo15,
    # bench/fixtures): pixel space (3 channels), one 4x4 token per patch, the word table's
    # 64-wide text, no byT5 text (one all-masked token) and no image tokens beyond one.
    "hunyuanvideo-tiny-trained": HunyuanVideo15Config(
        hidden_size=96, num_heads=4, num_layers=4, in_channels=3, out_channels=3,
        patch_size=(1, 4, 4), rope_axes=(8, 8, 8), mlp_ratio=2.0, refiner_layers=1,
        refiner_mlp_ratio=2.0, text_dim=64, text_len=16, byt5_dim=8, byt5_hidden=16, byt5_len=1,
        vision_dim=16, vision_len=1),
}

# The time embedders and modulations run in fp32 when the rest is bf16.
KEEP_FP32 = ("time_in.", "time_r_in.", "txt_in.t_embedder.", "img_mod.", "txt_mod.",
             "final_layer.adaLN_modulation.")


class HunyuanContext(NamedTuple):
    vec: torch.Tensor  # [B, D] fp32 conditioning vector (time, + time_r for meanflow)
    key_mask: torch.Tensor  # [B, L + S] bool: image keys always valid, then the context mask
    rope_cos: torch.Tensor  # [L, H/2], image tokens only
    rope_sin: torch.Tensor


class _Named(nn.Module):
    """A holder whose children get official key names (`linear_1`, `fc1`, ...)."""

    def __init__(self, **children: nn.Module):
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


def _modulation(dim: int, chunks: int) -> nn.Sequential:
    return nn.Sequential(nn.SiLU(), Linear(dim, chunks * dim))


class RefinerBlock(nn.Module):
    """IndividualTokenRefinerBlock: fused qkv, no qk-norm, SiLU MLP, gates only (T18)."""

    def __init__(self, cfg: HunyuanVideo15Config):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.norm1 = LayerNorm(d, 1e-6)
        self.self_attn_qkv = Linear(d, 3 * d)
        self.self_attn_proj = Linear(d, d)
        self.norm2 = LayerNorm(d, 1e-6)
        hidden = int(d * cfg.refiner_mlp_ratio)
        self.mlp = _Named(fc1=Linear(d, hidden), fc2=Linear(hidden, d))
        self.adaLN_modulation = _modulation(d, 2)

    def forward(self, x_BSD, c_BD, key_mask_BS):
        gate_msa, gate_mlp = self.adaLN_modulation(c_BD).float()[:, None].chunk(2, dim=-1)
        q, k, v = self.self_attn_qkv(self.norm1(x_BSD)).unflatten(
            -1, (3, self.num_heads, -1)).unbind(2)
        x_BSD = x_BSD + self.self_attn_proj(ops.attention(q, k, v, key_mask_BS).flatten(-2)) * gate_msa
        y = self.mlp.fc2(nn.functional.silu(self.mlp.fc1(self.norm2(x_BSD))))
        return x_BSD + y * gate_mlp


class TokenRefiner(nn.Module):
    """`txt_in`: refines the MLLM states with their own time embedding and masked-mean pooling."""

    def __init__(self, cfg: HunyuanVideo15Config):
        super().__init__()
        d = cfg.hidden_size
        self.input_embedder = Linear(cfg.text_dim, d)
        self.t_embedder = _Named(mlp=time_mlp(256, d))
        self.c_embedder = _Named(linear_1=Linear(cfg.text_dim, d), linear_2=Linear(d, d))
        self.individual_token_refiner = _Named(
            blocks=nn.ModuleList(RefinerBlock(cfg) for _ in range(cfg.refiner_layers)))

    def forward(self, text_BSC, mask_BS, t_B):
        mask = mask_BS.float()[..., None]
        pooled = (text_BSC.float() * mask).sum(1) / mask.sum(1)  # the original mask
        c = self.t_embedder.mlp(timestep_sinusoid(t_B)).float()
        c = c + self.c_embedder.linear_2(nn.functional.silu(self.c_embedder.linear_1(pooled))).float()
        x = self.input_embedder(text_BSC).float()
        # The first token is always a valid key, so no row is fully masked.
        key_mask = torch.cat([torch.ones_like(mask_BS[:, :1]), mask_BS[:, 1:]], dim=1)
        for block in self.individual_token_refiner.blocks:
            x = block(x, c, key_mask)
        return x


class DoubleStreamBlock(nn.Module):
    """MMDoubleStreamBlock: separate image and text weights, one joint attention."""

    def __init__(self, cfg: HunyuanVideo15Config):
        super().__init__()
        d, hidden = cfg.hidden_size, int(cfg.hidden_size * cfg.mlp_ratio)
        self.num_heads, self.eps = cfg.num_heads, cfg.eps
        for stream in ("img", "txt"):
            self.add_module(f"{stream}_mod", _Named(linear=Linear(d, 6 * d)))
            for p in "qkv":
                self.add_module(f"{stream}_attn_{p}", Linear(d, d))
            self.add_module(f"{stream}_attn_q_norm", RMSNorm(cfg.head_dim, cfg.eps))  # per head (T15)
            self.add_module(f"{stream}_attn_k_norm", RMSNorm(cfg.head_dim, cfg.eps))
            self.add_module(f"{stream}_attn_proj", Linear(d, d))
            self.add_module(f"{stream}_mlp", _Named(fc1=Linear(d, hidden), fc2=Linear(hidden, d)))

    def modulation(self, stream: str, vec_BD):
        """shift1, scale1, gate1, shift2, scale2, gate2, each [B, 1, D] fp32."""
        mod = getattr(self, f"{stream}_mod").linear(nn.functional.silu(vec_BD))
        return mod.float()[:, None].chunk(6, dim=-1)

    def _qkv(self, stream, y):
        q, k, v = (getattr(self, f"{stream}_attn_{p}")(y).unflatten(-1, (self.num_heads, -1))
                   for p in "qkv")
        return (getattr(self, f"{stream}_attn_q_norm")(q),
                getattr(self, f"{stream}_attn_k_norm")(k), v)

    def _mlp(self, stream, x, shift, scale):
        mlp = getattr(self, f"{stream}_mlp")
        y = ops.layer_norm_modulate(x, shift, scale, self.eps)
        return mlp.fc2(nn.functional.gelu(mlp.fc1(y), approximate="tanh")).float()

    def forward(self, hidden, ctx: HunyuanContext):
        img, txt = hidden
        s1_i, c1_i, g1_i, s2_i, c2_i, g2_i = self.modulation("img", ctx.vec)
        s1_t, c1_t, g1_t, s2_t, c2_t, g2_t = self.modulation("txt", ctx.vec)
        q_i, k_i, v_i = self._qkv("img", ops.layer_norm_modulate(img, s1_i, c1_i, self.eps))
        q_i = ops.rope(q_i, ctx.rope_cos, ctx.rope_sin)
        k_i = ops.rope(k_i, ctx.rope_cos, ctx.rope_sin)
        q_t, k_t, v_t = self._qkv("txt", ops.layer_norm_modulate(txt, s1_t, c1_t, self.eps))
        joint = ops.attention(torch.cat([q_i, q_t], 1), torch.cat([k_i, k_t], 1),
                              torch.cat([v_i, v_t], 1), ctx.key_mask).flatten(-2)
        a_img, a_txt = joint[:, :img.shape[1]], joint[:, img.shape[1]:]
        img = img + self.img_attn_proj(a_img).float() * g1_i
        img = img + self._mlp("img", img, s2_i, c2_i) * g2_i
        txt = txt + self.txt_attn_proj(a_txt).float() * g1_t
        txt = txt + self._mlp("txt", txt, s2_t, c2_t) * g2_t
        return img, txt


class HunyuanVideo15DiT(StagedDiT):
    def __init__(self, cfg: HunyuanVideo15Config):
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        # Conv3d holds the official weight; prepare() applies it as a per-patch matmul.
        self.img_in = _Named(proj=nn.Conv3d(2 * cfg.in_channels + 1, d, cfg.patch_size,
                                            cfg.patch_size))
        self.time_in = _Named(mlp=time_mlp(256, d))
        if cfg.use_meanflow:
            self.time_r_in = _Named(mlp=time_mlp(256, d))
        self.txt_in = TokenRefiner(cfg)
        self.byt5_in = _Named(layernorm=LayerNorm(cfg.byt5_dim, 1e-5),
                              fc1=Linear(cfg.byt5_dim, cfg.byt5_hidden),
                              fc2=Linear(cfg.byt5_hidden, cfg.byt5_hidden),
                              fc3=Linear(cfg.byt5_hidden, d))
        self.vision_in = _Named(proj=nn.Sequential(
            LayerNorm(cfg.vision_dim, 1e-5), Linear(cfg.vision_dim, cfg.vision_dim), nn.GELU(),
            Linear(cfg.vision_dim, d), LayerNorm(d, 1e-5)))
        self.cond_type_embedding = nn.Embedding(3, d)  # 0 MLLM text, 1 byT5, 2 vision
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(cfg) for _ in range(cfg.num_layers))
        self.final_layer = _Named(adaLN_modulation=_modulation(d, 2),
                                  linear=Linear(d, math.prod(cfg.patch_size) * cfg.out_channels))

    # --- staged API ------------------------------------------------------------------------

    def prepare(self, x, t, text, text_mask, byt5, byt5_mask, *, i2v: bool, cond=None,
                vision=None, timestep_r=None, rope=None):
        """Embed one model call's inputs.

        x [B, C, F, H, W] noisy latent; t [B] float timesteps (sigma * 1000, T20); text
        [B, text_len, text_dim] MLLM states and text_mask [B, text_len]; byt5 [B, byt5_len,
        byt5_dim] and byt5_mask (all zero when the prompt quotes no text); i2v selects the image
        branch: cond [B, C + 1, F, H, W] (reference latent at frame 0 and the frame mask) and
        vision [B, vision_len, vision_dim] SigLIP states are then required; for T2V both are
        zeros. timestep_r [B]: the next timestep, for the meanflow (step-distilled) variant.
        rope: `self.rope(grid, device)`, built once per shape (built here when omitted).
        Returns the hidden pair (img, txt) in fp32 and the HunyuanContext.
        """
        cfg = self.config
        batch = x.shape[0]
        self._check(x, f"[B, {cfg.in_channels}, F, H, W]", ndim=5, dims={1: cfg.in_channels})
        cond_shape = (batch, cfg.in_channels + 1, *x.shape[2:])
        if i2v:
            if cond is None or vision is None:
                raise ModelConfigError("i2v=True needs cond (reference latent and mask) and vision")
            self._check(cond, str(list(cond_shape)), dims=dict(enumerate(cond_shape)))
            self._check(vision, f"[{batch}, {cfg.vision_len}, {cfg.vision_dim}]",
                        dims={0: batch, 1: cfg.vision_len, 2: cfg.vision_dim})
        else:
            cond = x.new_zeros(cond_shape)
            vision = x.new_zeros((batch, cfg.vision_len, cfg.vision_dim))
        self._check(text, f"[{batch}, {cfg.text_len}, {cfg.text_dim}]",
                    dims={0: batch, 1: cfg.text_len, 2: cfg.text_dim})
        self._check(byt5, f"[{batch}, {cfg.byt5_len}, {cfg.byt5_dim}]",
                    dims={0: batch, 1: cfg.byt5_len, 2: cfg.byt5_dim})
        self._check(text_mask, f"[{batch}, {cfg.text_len}]", dims={0: batch, 1: cfg.text_len})
        self._check(byt5_mask, f"[{batch}, {cfg.byt5_len}]", dims={0: batch, 1: cfg.byt5_len})
        self._check(t, f"[{batch}]", ndim=1, dims={0: batch})
        if cfg.use_meanflow != (timestep_r is not None):
            raise ModelConfigError("timestep_r is required by, and only by, the meanflow "
                                   f"(step-distilled) variant; use_meanflow={cfg.use_meanflow}")

        grid = self.grid(x.shape)
        img = patchify(torch.cat([x, cond.to(x.dtype)], dim=1), grid,
                       self.img_in.proj)

        vec = self.time_in.mlp(timestep_sinusoid(t)).float()
        if cfg.use_meanflow:
            vec = vec + self.time_r_in.mlp(timestep_sinusoid(timestep_r)).float()

        text_mask, byt5_mask = text_mask.bool(), byt5_mask.bool()
        type_emb = self.cond_type_embedding.weight.float()
        mllm = self.txt_in(text, text_mask, t) + type_emb[0]
        b = self.byt5_in
        glyph = b.fc3(nn.functional.gelu(b.fc2(nn.functional.gelu(b.fc1(b.layernorm(byt5))))))
        glyph = glyph.float() + type_emb[1]
        seen = self.vision_in.proj(vision).float() * (1.0 if i2v else 0.0) + type_emb[2]
        vision_mask = torch.full((batch, cfg.vision_len), i2v, dtype=torch.bool, device=x.device)
        # Padded tokens are zeroed as in the official reorder (zero_feat=True); they are never
        # valid keys, so only this static order differs from the official one (model_spec 3.3).
        masks = [vision_mask, byt5_mask, text_mask]
        feats = (seen, glyph, mllm)
        txt = torch.cat([f * m[..., None] for f, m in zip(feats, masks, strict=True)], dim=1)
        image_keys = torch.ones((batch, img.shape[1]), dtype=torch.bool, device=x.device)
        key_mask = torch.cat([image_keys, *masks], dim=1)

        if rope is None:
            rope = self.rope(grid, x.device)
        return (img, txt), HunyuanContext(vec, key_mask, *rope)

    def block(self, i: int, hidden, ctx: HunyuanContext):
        return self.double_blocks[i](hidden, ctx)

    def final(self, hidden, ctx: HunyuanContext, grid) -> torch.Tensor:
        """Final modulated norm (shift before scale, T16), projection, unpatchify; fp32."""
        img = hidden[0]
        shift, scale = self.final_layer.adaLN_modulation(ctx.vec).float()[:, None].chunk(2, dim=-1)
        out = self.final_layer.linear(ops.layer_norm_modulate(img, shift, scale, self.config.eps))
        return self._unpatchify(out, grid)

    def signature(self, kind: str, hidden, ctx: HunyuanContext) -> torch.Tensor:
        """What a TeaCache signature summarises: block 0's modulated image input."""
        if kind == "modulated_input":
            shift, scale = self.double_blocks[0].modulation("img", ctx.vec)[:2]
            return ops.layer_norm_modulate(hidden[0], shift, scale, self.config.eps)
        if kind == "time_embedding":
            return ctx.vec
        raise ModelConfigError(f"unknown signature {kind!r}; expected modulated_input or "
                               "time_embedding")

    def forward(self, x, t, text, text_mask, byt5, byt5_mask, *, i2v: bool, cond=None,
                vision=None, timestep_r=None):
        grid = self.grid(x.shape)
        hidden, ctx = self.prepare(x, t, text, text_mask, byt5, byt5_mask, i2v=i2v, cond=cond,
                                   vision=vision, timestep_r=timestep_r)
        for i in range(self.num_blocks):
            hidden = self.block(i, hidden, ctx)
        return self.final(hidden, ctx, grid)

    # --- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _check(tensor, expected: str, ndim: int | None = None, dims: dict | None = None):
        shape = tuple(tensor.shape)
        ok = ndim is None or len(shape) == ndim
        ok = ok and all(i < len(shape) and shape[i] == n for i, n in (dims or {}).items())
        if dims and ndim is None:
            ok = ok and len(shape) == len(dims)
        if not ok:
            raise ModelConfigError(f"input has shape {list(shape)}; expected {expected}")

    def _unpatchify(self, out_BLX, grid):
        # Channel-major (c, pt, ph, pw) per token, unlike Wan (T11).
        b, c = out_BLX.shape[0], self.config.out_channels
        (f, h, w), (pt, ph, pw) = grid, self.config.patch_size
        u = out_BLX.reshape(b, f, h, w, c, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return u.reshape(b, c, f * pt, h * ph, w * pw).float()

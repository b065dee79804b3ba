"""Wan2.2 S2V-14B (speech-to-video) as a static-shape staged DiT.

The Wan2.2 DiT (`modules/wan.py`) with, per the official `wan/modules/s2v/` code:
  - one sequence of [noisy tokens | reference-image tokens | motion tokens] (RoPE: the reference
    at frame 30, the motion history at negative frames), tagged by a learned embedding per part;
  - the motion history (the last 19 latent frames) packed at three rates (FramePackMotioner);
  - segmented modulation: the noisy tokens take t's modulation, reference and motion tokens the
    modulation of t = 0 (`zero_timestep`); the head reads t's embedding only;
  - wav2vec2 features (25 hidden states) through a causal convolutional audio encoder into 4+1
    tokens and one global vector per latent frame, injected after the listed blocks by a
    per-frame cross-attention whose queries are normalised by AdaIN from the global vector
    (adain_mode "attn_norm").
Parameter names are the official checkpoint keys (`WanModel_S2V` state dict), typos included
(`casual_audio_encoder`). Only the released configuration is built (framepack, padding drop mode,
AdaIN in attention-norm mode, zero timestep); `modules/wan_s2v_format.py` refuses other switches.

The first clip of the official pipeline drops the motion tokens (drop_first_motion); here they
stay in the sequence and a key mask hides them, which gives every other token the same values
and keeps one token count, so one compiled program serves every clip.

B batch, C latent channels, F latent frames of the clip, Hh x W latent size, h x w its token grid,
P = h*w tokens per frame, L = F*P noisy tokens, R reference tokens (= P), M motion tokens
(= 1.5 P), S text tokens, D model dim, A audio tokens per frame, T audio frames.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from modules import ops
from modules.layers import (
    Linear,
    ModelConfigError,
    grid_positions,
    patchify,
    rope_angles_at,
)
from modules.wan import WanAttention, WanBlock, WanDims, WanDiT

# FramePackMotioner (official): the newest motion latent frame at the model's patch, the two
# before it 2x coarser, the 16 before those 4x coarser; 19 frames = (73 pixel frames + 3) // 4.
PACK_FRAMES = (1, 2, 16)  # newest first
PACK_KERNELS = ((1, 2, 2), (2, 4, 4), (4, 8, 8))
REF_FRAME = 30  # the reference image's RoPE frame position
ADAIN_EPS = 1e-5  # diffusers AdaLayerNorm's default; the blocks use config.eps


@dataclass(frozen=True)
class WanS2VConfig(WanDims):
    dim: int
    ffn_dim: int
    num_layers: int
    num_heads: int
    audio_inject_layers: tuple[int, ...]  # audio cross-attention after these blocks
    in_dim: int = 16
    out_dim: int = 16
    cond_dim: int = 16  # pose latent channels (cond_encoder); zero latents without a pose video
    audio_dim: int = 1024  # wav2vec2-large hidden size
    audio_layers: int = 25  # wav2vec2 hidden states weighted together (embeddings + 24 layers)
    num_audio_token: int = 4  # audio tokens per latent frame (plus one learned padding token)
    motion_frames: int = 73  # pixel frames of motion history (19 latent frames)
    zero_timestep: bool = True  # reference and motion tokens modulated by t = 0

    def __post_init__(self):
        self._check_dims()
        layers = self.audio_inject_layers
        if not layers or list(layers) != sorted(set(layers)) or layers[0] < 0 \
                or layers[-1] >= self.num_layers:
            raise ModelConfigError(f"audio_inject_layers {layers}: expected increasing block "
                                   f"indices in [0, {self.num_layers})")
        if self.patch_size != (1, 2, 2):
            raise ModelConfigError(f"patch_size {self.patch_size}: the frame packer is built "
                                   "for (1, 2, 2)")
        if self.in_dim != self.out_dim:
            raise ModelConfigError(f"in_dim {self.in_dim} != out_dim {self.out_dim}: reference "
                                   "and motion latents share the noisy latent's channels")

    @property
    def motion_latent_frames(self) -> int:
        return (self.motion_frames + 3) // 4

    @property
    def audio_frames_per_latent(self) -> int:
        return 4  # the audio encoder's two stride-2 convolutions: the VAE's temporal stride


_S2V_14B = dict(dim=5120, ffn_dim=13824, num_layers=40, num_heads=40,
                audio_inject_layers=(0, 4, 8, 12, 16, 20, 24, 27, 30, 33, 36, 39))
CONFIGS: dict[str, WanS2VConfig] = {
    # wan/configs/wan_s2v_14B.py (the transformer fields WanModel_S2V takes)
    "wan2.2-s2v-14b": WanS2VConfig(**_S2V_14B),
    # Tiny random-weight twin: 16 latent channels and 25 audio layers as the official modules
    # hard-code them; audio injected after blocks 0, 2 and 3 (the last one too, as block 39).
    "wan-tiny-s2v": WanS2VConfig(dim=24, ffn_dim=32, num_layers=4, num_heads=2,
                                 audio_inject_layers=(0, 2, 3), audio_dim=16, text_len=16,
                                 text_dim=16),
}

# As wan.KEEP_FP32, plus the audio encoder: the official code runs it under fp32 autocast.
KEEP_FP32 = ("time_embedding.", "time_projection.", ".modulation", "head.modulation", ".norm3.",
             "casual_audio_encoder.")


class WanS2VContext(NamedTuple):
    """What every block and the head need besides the hidden state; plain tensors only."""

    e: torch.Tensor  # [B, 1, D] fp32 time embedding of t: the head's modulation
    e0: torch.Tensor  # [B, 2, 6, D] fp32 time projection of (t, 0): the blocks' two segments
    context: torch.Tensor  # [B, S, D] embedded text
    rope_cos: torch.Tensor  # [L + R + M, H/2]
    rope_sin: torch.Tensor
    conditioning: torch.Tensor  # [L + R + M, 1] bool: reference and motion tokens (segment 1)
    key_mask: torch.Tensor  # [B, L + R + M] bool: motion keys hidden on a drop_first_motion clip
    audio: torch.Tensor  # [B, F, A + 1, D] audio tokens of each latent frame
    audio_global: torch.Tensor  # [B, F, D] the frame's global audio vector (AdaIN)


# --- audio ---------------------------------------------------------------------------------------

class CausalConv1d(nn.Module):
    """Conv1d over time, left-padded by repeating the first frame (official CausalConv1d)."""

    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1):
        super().__init__()
        self.pad = kernel - 1
        self.conv = nn.Conv1d(cin, cout, kernel, stride)

    def forward(self, x_BCT):
        x_BCT = torch.cat([x_BCT[..., :1].expand(*x_BCT.shape[:-1], self.pad), x_BCT], dim=-1)
        w = self.conv.weight
        return F.conv1d(x_BCT.to(w.dtype), w, self.conv.bias, self.conv.stride).float()


def _ln_silu(x, eps=1e-6):
    return F.silu(ops.layer_norm(x, None, None, eps))


class AudioFrameEncoder(nn.Module):
    """Official MotionEncoder_tc with need_global: features [B, T, C_a] -> local tokens
    [B, T/4, A + 1, D] and one global vector [B, T/4, D]. Both paths share conv2/conv3."""

    def __init__(self, cfg: WanS2VConfig):
        super().__init__()
        d, n = cfg.dim, cfg.num_audio_token
        self.num_tokens = n
        self.conv1_local = CausalConv1d(cfg.audio_dim, d // 4 * n)
        self.conv1_global = CausalConv1d(cfg.audio_dim, d // 4)
        self.conv2 = CausalConv1d(d // 4, d // 2, stride=2)
        self.conv3 = CausalConv1d(d // 2, d, stride=2)
        self.final_linear = Linear(d, d)
        self.padding_tokens = nn.Parameter(torch.zeros(1, 1, 1, d))

    def _downsample(self, x_NCT):
        """conv2, conv3 with their norms: [N, C/4, T] -> [N, T/4, D]."""
        x = _ln_silu(self.conv2(x_NCT).transpose(1, 2))
        return _ln_silu(self.conv3(x.transpose(1, 2)).transpose(1, 2))

    def forward(self, x_BTC):
        b, n = x_BTC.shape[0], self.num_tokens
        x_BCT = x_BTC.transpose(1, 2)
        local = self.conv1_local(x_BCT)  # [B, n * D/4, T], token-major channels
        local = local.unflatten(1, (n, -1)).flatten(0, 1)  # [(B n), D/4, T]
        local = _ln_silu(local.transpose(1, 2)).transpose(1, 2)
        local = self._downsample(local)  # [(B n), T', D]
        local = local.unflatten(0, (b, n)).transpose(1, 2)  # [B, T', n, D]
        pad = self.padding_tokens.float().expand(b, local.shape[1], 1, -1)
        tokens = torch.cat([local, pad], dim=2)
        glob = _ln_silu(self.conv1_global(x_BCT).transpose(1, 2)).transpose(1, 2)
        glob = self.final_linear(self._downsample(glob)).float()
        return tokens, glob


class CausalAudioEncoder(nn.Module):
    """Softmax-free weighting of the wav2vec2 hidden states (SiLU weights, normalised to sum 1),
    then AudioFrameEncoder. Official CausalAudioEncoder; runs in fp32."""

    def __init__(self, cfg: WanS2VConfig):
        super().__init__()
        self.encoder = AudioFrameEncoder(cfg)
        self.weights = nn.Parameter(torch.full((1, cfg.audio_layers, 1, 1), 0.01))

    def forward(self, features_BKCT):
        w = F.silu(self.weights.float())
        mixed = (features_BKCT.float() * w / w.sum(dim=1, keepdim=True)).sum(dim=1)  # [B, C, T]
        return self.encoder(mixed.transpose(1, 2))


class AudioAdaIN(nn.Module):
    """diffusers AdaLayerNorm(chunk_dim=1) as the injector uses it: a non-affine LayerNorm (eps
    1e-5) modulated by SiLU -> Linear of the frame's global audio vector, shift first."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = Linear(dim, 2 * dim)

    def forward(self, x_NPD, g_ND):
        shift, scale = self.linear(F.silu(g_ND)).float().chunk(2, dim=-1)
        return ops.layer_norm_modulate(x_NPD, shift[:, None], scale[:, None], ADAIN_EPS)


class AudioInjector(nn.Module):
    """Per injected block: AdaIN, then cross-attention of each frame's tokens to the frame's
    audio tokens (official AudioInjector_WAN; its pre-norm layers have no parameters and are
    unused in attn_norm mode)."""

    def __init__(self, cfg: WanS2VConfig):
        super().__init__()
        n = len(cfg.audio_inject_layers)
        self.injector = nn.ModuleList(WanAttention(cfg) for _ in range(n))
        self.injector_adain_layers = nn.ModuleList(AudioAdaIN(cfg.dim) for _ in range(n))
        self.slot = {block: i for i, block in enumerate(cfg.audio_inject_layers)}

    def forward(self, block: int, h_BXD, ctx: WanS2VContext):
        """h plus the audio residual on its first L (noisy) tokens."""
        i = self.slot[block]
        b, frames = ctx.audio.shape[:2]
        per_frame = _noisy_tokens(h_BXD.shape[1], frames) // frames
        noisy = h_BXD[:, : frames * per_frame].reshape(b * frames, per_frame, -1)
        q = self.injector_adain_layers[i](noisy, ctx.audio_global.flatten(0, 1))
        out = self.injector[i](q, ctx.audio.flatten(0, 1)).float()
        out = out.reshape(b, frames * per_frame, -1)
        # pad, not slice-and-concatenate: the rest of the sequence is untouched (x + 0 == x)
        return h_BXD + F.pad(out, (0, 0, 0, h_BXD.shape[1] - out.shape[1]))


# --- tokens --------------------------------------------------------------------------------------

def _motion_tokens(per_frame: int) -> int:
    return per_frame + per_frame // 4 + per_frame // 4  # 1 frame at 1x, 1 at 2x, 4 at 4x


def _noisy_tokens(total: int, frames: int) -> int:
    """L of a [noisy | reference | motion] sequence of `total` tokens and `frames` latent frames:
    total = (F + 1) P + 1.5 P. The blocks see shapes only; this recovers L from them."""
    per_frame = 2 * total // (2 * frames + 5)
    if per_frame * frames + per_frame + _motion_tokens(per_frame) != total:
        raise ModelConfigError(f"{total} tokens are not [noisy | reference | motion] tokens of "
                               f"{frames} latent frames")
    return per_frame * frames


def s2v_positions(grid) -> np.ndarray:
    """RoPE (t, h, w) positions [L + R + M, 3] of the S2V sequence (official rope_precompute
    with the grid sizes of WanModel_S2V.forward and FramePackMotioner): noisy tokens on their
    grid, the reference at frame 30, the packed motion at negative frames (conjugate rotation),
    the coarser buckets sampling the full grid's h and w positions like np.linspace."""
    f, h, w = grid
    ref = grid_positions((1, h, w)) + [REF_FRAME, 0, 0]
    parts, start = [grid_positions(grid), ref], 0
    for frames, (kt, kh, _) in zip(PACK_FRAMES, PACK_KERNELS, strict=True):
        start += frames  # the bucket covers frames -start .. -(start - frames + 1)
        t = -np.linspace(start, start - frames + 1, frames // kt).astype(int)
        hs = np.linspace(0, h - 1, h * 2 // kh).astype(int)
        ws = np.linspace(0, w - 1, w * 2 // kh).astype(int)
        mesh = np.meshgrid(t, hs, ws, indexing="ij")
        parts.append(np.stack([m.reshape(-1) for m in mesh], axis=-1).astype(np.float64))
    return np.concatenate(parts, axis=0)


class FramePacker(nn.Module):
    """The motion latents [B, C, 19, Hh, W] -> [B, M, D]: official FramePackMotioner ('padd'
    mode, all buckets kept)."""

    def __init__(self, cfg: WanS2VConfig):
        super().__init__()
        self.proj, self.proj_2x, self.proj_4x = (nn.Conv3d(cfg.in_dim, cfg.dim, k, k)
                                                 for k in PACK_KERNELS)

    def forward(self, m_BCFHW):
        height, width = m_BCFHW.shape[-2:]
        tokens, stop = [], m_BCFHW.shape[2]
        for frames, conv in zip(PACK_FRAMES, (self.proj, self.proj_2x, self.proj_4x), strict=True):
            part = m_BCFHW[:, :, stop - frames: stop]
            stop -= frames
            kt, kh, kw = conv.kernel_size
            tokens.append(patchify(part, (frames // kt, height // kh, width // kw), conv))
        return torch.cat(tokens, dim=1)


# --- the model -----------------------------------------------------------------------------------

class WanS2VBlock(WanBlock):
    """WanS2VAttentionBlock: WanBlock with two modulations, t's for the noisy tokens and t=0's
    for the reference and motion tokens, and the drop-first-motion key mask."""

    def modulation_chunks(self, ctx: WanS2VContext):
        chunks = (self.modulation.float().unsqueeze(0) + ctx.e0).unbind(2)  # 6 x [B, 2, D]
        # where, not slices: an elementwise select keeps a token-sharded sequence in place
        return tuple(torch.where(ctx.conditioning, c[:, 1:], c[:, :1]) for c in chunks)

    def forward(self, h_BXD, ctx: WanS2VContext, key_mask_BX=None):
        return super().forward(h_BXD, ctx, ctx.key_mask)  # the context carries the clip's mask

    def forward_gated(self, h_BXD, ctx: WanS2VContext, key_mask_BX=None):
        return super().forward_gated(h_BXD, ctx, ctx.key_mask)

    def time_gates(self, ctx: WanS2VContext):
        return tuple(torch.where(ctx.conditioning, c[:, 1:], c[:, :1])
                     for c in super().time_gates(ctx))


class WanS2VDiT(WanDiT):
    block_cls = WanS2VBlock

    def __init__(self, cfg: WanS2VConfig):
        super().__init__(cfg)
        d = cfg.dim
        self.cond_encoder = nn.Conv3d(cfg.cond_dim, d, cfg.patch_size, cfg.patch_size)
        self.casual_audio_encoder = CausalAudioEncoder(cfg)  # sic: the official key
        self.audio_injector = AudioInjector(cfg)
        self.trainable_cond_mask = nn.Embedding(3, d)  # 0 noisy, 1 reference, 2 motion
        self.frame_packer = FramePacker(cfg)

    # --- geometry --------------------------------------------------------------------------

    def block_of(self, name: str) -> int | None:
        """The audio injector after block i is part of block i's staged call."""
        for part in ("audio_injector.injector.", "audio_injector.injector_adain_layers."):
            if name.startswith(part):
                return self.config.audio_inject_layers[int(name[len(part):].split(".", 1)[0])]
        return super().block_of(name)

    def sequence_length(self, grid) -> int:
        per_frame = grid[1] * grid[2]
        return grid[0] * per_frame + per_frame + _motion_tokens(per_frame)

    def rope(self, grid, device=None):
        cos, sin = rope_angles_at(s2v_positions(grid), self.config.rope_axes, self.config.rope_theta)
        return torch.tensor(cos, device=device), torch.tensor(sin, device=device)

    def audio_input_frames(self, latent_frames: int) -> int:
        """Audio feature frames of a clip of `latent_frames` (the official infer_frames)."""
        return latent_frames * self.config.audio_frames_per_latent

    # --- staged API ------------------------------------------------------------------------

    def prepare(self, x, t, context, ref_latent, motion_latents, audio, motion_mask=None,
                pose=None, rope=None):
        """Embed one model call's inputs.

        x [B, C, F, Hh, W] noisy latent (Hh, W multiples of 8: the 4x motion bucket); t [B];
        context [B, S <= text_len, text_dim]; ref_latent [B, C, 1, Hh, W]; motion_latents
        [B, C, Fm, Hh, W], the last 19 frames used (zeros in front when fewer, as official);
        audio [B, 25, audio_dim, 4F] wav2vec2 features of the clip's frames (zeros: the
        unconditional branch); motion_mask [B], 0 hides the motion tokens (the official
        drop_motion_frames), None shows them; pose [B, cond_dim, F, Hh, W] (None: zeros, no pose
        video). Returns the fp32 hidden state [B, L + R + M, D] entering block 0, and the context.
        """
        cfg = self.config
        if x.ndim != 5 or x.shape[1] != cfg.in_dim:
            raise ModelConfigError(f"latent has shape {tuple(x.shape)}; expected [B, "
                                   f"{cfg.in_dim}, F, H, W]")
        batch, _, frames, height, width = x.shape
        if height % 8 or width % 8:
            raise ModelConfigError(f"latent H, W = {height}, {width}: S2V needs multiples of 8 "
                                   "(the motion frame packer's 4x bucket)")
        self._check("ref_latent", ref_latent, (batch, cfg.in_dim, 1, height, width))
        if motion_latents.ndim != 5 or tuple(motion_latents.shape[:2]) != (batch, cfg.in_dim) \
                or tuple(motion_latents.shape[3:]) != (height, width):
            raise ModelConfigError(f"motion_latents has shape {tuple(motion_latents.shape)}; "
                                   f"expected [{batch}, {cfg.in_dim}, frames, {height}, {width}]")
        self._check("audio", audio, (batch, cfg.audio_layers, cfg.audio_dim,
                                     self.audio_input_frames(frames)))
        if pose is not None:
            self._check("pose", pose, (batch, cfg.cond_dim, frames, height, width))
        if motion_mask is not None:
            self._check("motion_mask", motion_mask, (batch,))
        if t.shape != (batch,):
            raise ModelConfigError(f"timestep has shape {tuple(t.shape)}; expected [{batch}]")
        grid = self.grid(x.shape)
        noisy = frames * grid[1] * grid[2]
        total = self.sequence_length(grid)

        h_BLD = patchify(x, grid, self.patch_embedding)
        if pose is None:  # cond_encoder of zeros: its bias
            h_BLD = h_BLD + self.cond_encoder.bias.float()
        else:
            h_BLD = h_BLD + patchify(pose, grid, self.cond_encoder)
        ref = patchify(ref_latent, (1, *grid[1:]), self.patch_embedding)
        motion = self.frame_packer(self._last_motion_frames(motion_latents))
        h = torch.cat([h_BLD, ref, motion], dim=1)
        part = torch.cat([torch.zeros(noisy, dtype=torch.int32, device=x.device),
                          torch.ones(ref.shape[1], dtype=torch.int32, device=x.device),
                          torch.full((motion.shape[1],), 2, dtype=torch.int32, device=x.device)])
        h = h + self.trainable_cond_mask(part).float()

        e, e0 = self._embed_time(t[:, None])  # [B, 1, D], [B, 1, 6, D]
        if cfg.zero_timestep:
            e0_zero = self._embed_time(torch.zeros_like(t[:1, None]))[1]
            e0 = torch.cat([e0, e0_zero.expand_as(e0)], dim=1)
        else:
            e0 = torch.cat([e0, e0], dim=1)
        context = self._embed_text(context, batch)

        audio_tokens, audio_global = self.casual_audio_encoder(self._with_motion_audio(audio))
        skip = cfg.motion_latent_frames  # the encoded motion-history frames
        audio_tokens, audio_global = audio_tokens[:, skip:], audio_global[:, skip:]

        conditioning = (torch.arange(total, device=x.device) >= noisy)[:, None]
        if motion_mask is None:
            key_mask = torch.ones(batch, total, dtype=torch.bool, device=x.device)
        else:
            key_mask = torch.cat([torch.ones(batch, total - motion.shape[1], dtype=torch.bool,
                                             device=x.device),
                                  (motion_mask[:, None] > 0).expand(batch, motion.shape[1])], 1)
        if rope is None:
            rope = self.rope(grid, x.device)
        return h, WanS2VContext(e, e0, context, *rope, conditioning, key_mask, audio_tokens,
                                audio_global)

    def block(self, i: int, h_BXD, ctx: WanS2VContext):
        return self.block_gated(i, h_BXD, ctx)[0]

    def block_gated(self, i: int, h_BXD, ctx: WanS2VContext):
        h_BXD, gated = self.blocks[i].forward_gated(h_BXD, ctx)
        if i in self.audio_injector.slot:  # official after_transformer_block (not time-gated)
            h_BXD = self.audio_injector(i, h_BXD, ctx)
        return h_BXD, gated

    def final(self, h_BXD, ctx: WanS2VContext, grid):
        """Head and unpatchify over the noisy tokens: [B, out_dim, F, Hh, W] fp32."""
        noisy = grid[0] * grid[1] * grid[2]
        return self._unpatchify(self.head(h_BXD[:, :noisy], ctx.e), grid)

    def signature(self, kind: str, h_BXD, ctx: WanS2VContext):
        """As WanDiT's; "modulated_input" is block 0's segmented modulated input with the
        reference and motion rows zeroed: they are the same at every step of a clip, so they
        would only dilute the relative change TeaCache measures (which a row count cancels)."""
        if kind == "modulated_input":
            shift, scale = self.blocks[0].modulation_chunks(ctx)[:2]
            mod = ops.layer_norm_modulate(h_BXD, shift, scale, self.config.eps)
            return torch.where(ctx.conditioning, torch.zeros_like(mod), mod)
        return super().signature(kind, h_BXD, ctx)

    def forward(self, x, t, context, ref_latent, motion_latents, audio, motion_mask=None,
                pose=None):
        grid = self.grid(x.shape)
        h, ctx = self.prepare(x, t, context, ref_latent, motion_latents, audio, motion_mask, pose)
        for i in range(self.num_blocks):
            h = self.block(i, h, ctx)
        return self.final(h, ctx, grid)

    # --- inputs ----------------------------------------------------------------------------

    @staticmethod
    def _check(name, tensor, shape):
        if tuple(tensor.shape) != tuple(shape):
            raise ModelConfigError(f"{name} has shape {tuple(tensor.shape)}; expected "
                                   f"{list(shape)}")

    def _last_motion_frames(self, m_BCFHW):
        """The last 19 frames; zero frames in front of a shorter history (official padd_lat)."""
        need = sum(PACK_FRAMES)
        have = m_BCFHW.shape[2]
        if have >= need:
            return m_BCFHW[:, :, have - need:]
        return F.pad(m_BCFHW, (0, 0, 0, 0, need - have, 0))

    def _with_motion_audio(self, audio_BKCT):
        """The clip's first audio frame repeated over the motion history's frames, in front."""
        first = audio_BKCT[..., :1].expand(*audio_BKCT.shape[:-1], self.config.motion_frames)
        return torch.cat([first, audio_BKCT], dim=-1)


__all__ = ["CONFIGS", "KEEP_FP32", "WanS2VConfig", "WanS2VContext", "WanS2VDiT", "s2v_positions"]

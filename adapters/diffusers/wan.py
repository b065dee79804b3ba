"""diffusers' WanTransformer3DModel (Wan2.1 / Wan2.2 T2V, TI2V, I2V A14B) as a staged model:
its own forward cut where the gate needs it, every layer its own.

    prepare   rope, patch embedding, condition embedder (time, text, image)
    block(i)  blocks[i](hidden, text, timestep_proj, rope)
    final     the output norm modulated by the time embedding, proj_out, unpatchify

The lines of `WanTransformer3DModel.forward` (diffusers 0.42.1) in that order; the TeaCache
signatures are those of our Wan (modules/wan.py `signature`) read off diffusers' block 0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .staged import StagedTransformer


class WanDiffusersContext(NamedTuple):
    """What the blocks and the head read besides the hidden state."""

    temb: torch.Tensor  # [B, D], or [B, L, D] with per-token timesteps (Wan2.2 TI2V)
    timestep_proj: torch.Tensor  # [B, 6, D] or [B, L, 6, D]
    encoder_hidden_states: torch.Tensor  # the embedded text (image tokens first, I2V 2.1)
    rope_cos: torch.Tensor  # [1, L, 1, head_dim]
    rope_sin: torch.Tensor
    token_axes = {}  # noqa: RUF012 - one device: the adapter cuts no tokens


class WanStaged(StagedTransformer):
    """The staged API (`sampling.stages`) over one WanTransformer3DModel."""

    blocks_name = "blocks"
    context_type = WanDiffusersContext
    conds = ("encoder_hidden_states", "encoder_hidden_states_image")  # forward kwargs it reads

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer, transformer.config.patch_size)

    def prepare(self, x, t, encoder_hidden_states, encoder_hidden_states_image=None, rope=None):
        m = self.transformer
        if rope is None:
            rope = self.rope(self.grid(x.shape))
        hidden = m.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()
        per_token = t.shape[1] if t.ndim == 2 else None
        temb, proj, text, image = m.condition_embedder(
            t.flatten() if per_token else t, encoder_hidden_states, encoder_hidden_states_image,
            timestep_seq_len=per_token)
        proj = proj.unflatten(2, (6, -1)) if per_token else proj.unflatten(1, (6, -1))
        if image is not None:
            text = torch.concat([image, text], dim=1)
        return hidden, WanDiffusersContext(temb, proj, text, *rope)

    def block(self, i: int, hidden, ctx: WanDiffusersContext):
        return self.transformer.blocks[i](hidden, ctx.encoder_hidden_states, ctx.timestep_proj,
                                          (ctx.rope_cos, ctx.rope_sin))

    def signature(self, kind: str, hidden, ctx: WanDiffusersContext):
        if kind == "modulated_input":
            block = self.transformer.blocks[0]
            proj = ctx.timestep_proj.float()
            if proj.ndim == 4:
                shift, scale = (block.scale_shift_table.unsqueeze(0) + proj).chunk(6, dim=2)[:2]
                shift, scale = shift.squeeze(2), scale.squeeze(2)
            else:
                shift, scale = (block.scale_shift_table + proj).chunk(6, dim=1)[:2]
            return block.norm1(hidden.float()) * (1 + scale) + shift
        if kind == "time_embedding":
            return ctx.temb.unsqueeze(1) if ctx.temb.ndim == 2 else ctx.temb
        if kind == "time_projection":
            proj = ctx.timestep_proj
            return proj.unsqueeze(1) if proj.ndim == 3 else proj
        raise ValueError(f"unknown signature {kind!r}; expected modulated_input, "
                         "time_embedding or time_projection")

    def final(self, hidden, ctx: WanDiffusersContext, grid):
        m = self.transformer
        temb = ctx.temb
        if temb.ndim == 3:
            shift, scale = (m.scale_shift_table.unsqueeze(0).to(temb.device)
                            + temb.unsqueeze(2)).chunk(2, dim=2)
            shift, scale = shift.squeeze(2), scale.squeeze(2)
        else:
            shift, scale = (m.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
        shift, scale = shift.to(hidden.device), scale.to(hidden.device)
        hidden = (m.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        hidden = m.proj_out(hidden)
        (f, h, w), (pt, ph, pw) = grid, self.patch_size
        hidden = hidden.reshape(hidden.shape[0], f, h, w, pt, ph, pw, -1)
        hidden = hidden.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return hidden.flatten(6, 7).flatten(4, 5).flatten(2, 3)

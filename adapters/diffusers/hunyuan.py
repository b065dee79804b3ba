"""diffusers' HunyuanVideo15Transformer3DModel (HunyuanVideo-1.5 T2V and I2V) as a staged model:
its own forward cut where the gate needs it, every layer its own. The hidden state is the pair
(image tokens, text tokens) its double-stream blocks carry, as in our HunyuanVideo-1.5.

    prepare   rope, time embedding, patch embedding, the three text/image streams and their
              reordering (valid tokens first), as `forward` does before its blocks
    block(i)  transformer_blocks[i](image, text, temb, mask, rope)
    final     norm_out modulated by temb, proj_out, unpatchify

diffusers 0.42.1's forward in that order; the TeaCache signatures are our HunyuanVideo-1.5's
(modules/hunyuan_video15.py `signature`) read off diffusers' block 0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .staged import StagedTransformer


class HunyuanDiffusersContext(NamedTuple):
    temb: torch.Tensor  # [B, D]
    mask: torch.Tensor  # [B, S] the reordered text/image key mask
    rope_cos: torch.Tensor  # [L, head_dim]
    rope_sin: torch.Tensor
    token_axes = {}  # noqa: RUF012 - one device: the adapter cuts no tokens


class HunyuanStaged(StagedTransformer):
    """The staged API (`sampling.stages`) over one HunyuanVideo15Transformer3DModel."""

    blocks_name = "transformer_blocks"
    context_type = HunyuanDiffusersContext
    conds = ("encoder_hidden_states", "encoder_attention_mask", "timestep_r",
             "encoder_hidden_states_2", "encoder_attention_mask_2", "image_embeds")

    def __init__(self, transformer: nn.Module):
        cfg = transformer.config
        super().__init__(transformer, (cfg.patch_size_t, cfg.patch_size, cfg.patch_size))

    def prepare(self, x, t, encoder_hidden_states, encoder_attention_mask, timestep_r=None,
                encoder_hidden_states_2=None, encoder_attention_mask_2=None, image_embeds=None,
                rope=None):
        m = self.transformer
        if rope is None:
            rope = self.rope(self.grid(x.shape), x.device)
        batch = x.shape[0]
        temb = m.time_embed(t, timestep_r=timestep_r)
        hidden = m.x_embedder(x)
        text = m.context_embedder(encoder_hidden_states, t, encoder_attention_mask)
        text = text + m.cond_type_embed(torch.zeros_like(text[:, :, 0], dtype=torch.long))
        byt5 = m.context_embedder_2(encoder_hidden_states_2)
        byt5 = byt5 + m.cond_type_embed(torch.ones_like(byt5[:, :, 0], dtype=torch.long))
        image = m.image_embedder(image_embeds)
        t2v = torch.all(image_embeds == 0)
        if t2v:
            image = image * 0.0
        image_mask = (torch.zeros if t2v else torch.ones)(
            (batch, image.shape[1]), dtype=encoder_attention_mask.dtype,
            device=encoder_attention_mask.device)
        image = image + m.cond_type_embed(2 * torch.ones_like(image[:, :, 0], dtype=torch.long))
        masks = (encoder_attention_mask.bool(), encoder_attention_mask_2.bool(), image_mask.bool())
        streams, keys = [], []
        for txt, txt_mask, b5, b5_mask, img, img_mask in zip(text, masks[0], byt5, masks[1],
                                                             image, masks[2], strict=True):
            # valid image, byT5, text tokens first, then the padding (the byT5 and text padding
            # zeroed), as forward orders them
            streams.append(torch.cat([img[img_mask], b5[b5_mask], txt[txt_mask], img[~img_mask],
                                      torch.zeros_like(b5[~b5_mask]),
                                      torch.zeros_like(txt[~txt_mask])], dim=0))
            keys.append(torch.cat([img_mask[img_mask], b5_mask[b5_mask], txt_mask[txt_mask],
                                   img_mask[~img_mask], b5_mask[~b5_mask],
                                   txt_mask[~txt_mask]], dim=0))
        return (hidden, torch.stack(streams)), HunyuanDiffusersContext(temb, torch.stack(keys),
                                                                       *rope)

    def block(self, i: int, hidden, ctx: HunyuanDiffusersContext):
        return self.transformer.transformer_blocks[i](hidden[0], hidden[1], ctx.temb, ctx.mask,
                                                      (ctx.rope_cos, ctx.rope_sin))

    def signature(self, kind: str, hidden, ctx: HunyuanDiffusersContext):
        if kind == "modulated_input":
            return self.transformer.transformer_blocks[0].norm1(hidden[0], emb=ctx.temb)[0]
        if kind == "time_embedding":
            return ctx.temb
        raise ValueError(f"unknown signature {kind!r}; expected modulated_input or "
                         "time_embedding")

    def final(self, hidden, ctx: HunyuanDiffusersContext, grid):
        m = self.transformer
        out = m.proj_out(m.norm_out(hidden[0], ctx.temb))
        (f, h, w), (pt, ph, pw) = grid, self.patch_size
        out = out.reshape(out.shape[0], f, h, w, -1, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return out.flatten(6, 7).flatten(4, 5).flatten(2, 3)

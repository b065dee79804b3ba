"""Tiny random-weight models and inputs for the model tests (test helpers, not model code)."""

from __future__ import annotations

import torch

from modules.registry import build_model


def random_model(name: str, seed: int = 0, std: float = 0.3):
    """A tiny model with every parameter drawn at random, norms and modulations included,
    so that no term of the forward is an identity that would hide a mistake."""
    model = build_model(name)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the error relative to the output's scale."""
    return ((a - b).abs().max() / b.abs().max()).item()


def wan_inputs(cfg, *, per_token: bool, batch: int = 2, seed: int = 1):
    """x, t, context, y for a Wan config: 3 x 4 x 6 latent (18 tokens), 11 of 16 text tokens."""
    gen = torch.Generator().manual_seed(seed)
    frames, height, width = 3, 4, 6
    x = torch.randn(batch, 4, frames, height, width, generator=gen)
    y = None
    if cfg.in_dim > 4:  # I2V: [noise | mask 4 | image latent] on channels (T9)
        y = torch.randn(batch, cfg.in_dim - 4, frames, height, width, generator=gen)
    tokens = frames * (height // 2) * (width // 2)
    if per_token:  # TI2V image mode: frame-0 tokens at t = 0, the rest at t (T10)
        t = torch.tensor([700.0, 300.0])[:batch, None].repeat(1, tokens)
        t[:, : tokens // frames] = 0.0
    else:
        t = torch.tensor([999.0, 400.0])[:batch]
    context = torch.randn(batch, 11, cfg.text_dim, generator=gen)
    return x, t, context, y


def hy_inputs(cfg, *, i2v: bool, batch: int = 2, seed: int = 1):
    """Keyword inputs for a HunyuanVideo-1.5 config; the two samples have different masks."""
    gen = torch.Generator().manual_seed(seed)
    frames, height, width = 3, 4, 5
    c = cfg.in_channels
    text_mask = torch.zeros(batch, cfg.text_len)
    text_mask[0, :7] = 1
    text_mask[1:, :4] = 1
    byt5_mask = torch.zeros(batch, cfg.byt5_len)
    byt5_mask[0, :3] = 1  # sample 1 quotes no text: all-zero byT5 mask
    kw = dict(
        x=torch.randn(batch, c, frames, height, width, generator=gen),
        t=torch.tensor([995.93, 433.1])[:batch],
        text=torch.randn(batch, cfg.text_len, cfg.text_dim, generator=gen), text_mask=text_mask,
        byt5=torch.randn(batch, cfg.byt5_len, cfg.byt5_dim, generator=gen), byt5_mask=byt5_mask,
        i2v=i2v)
    if i2v:
        cond = torch.zeros(batch, c + 1, frames, height, width)
        cond[:, :c, 0] = torch.randn(batch, c, height, width, generator=gen)
        cond[:, c, 0] = 1.0
        kw.update(cond=cond, vision=torch.randn(batch, cfg.vision_len, cfg.vision_dim, generator=gen))
    if cfg.use_meanflow:
        kw["timestep_r"] = torch.tensor([900.0, 0.0])[:batch]
    return kw


class Positional(torch.nn.Module):
    """Positional tensors in, static switches bound (jit traces tensors only)."""

    def __init__(self, model, names, **static):
        super().__init__()
        self.model, self.names, self.static = model, names, static

    def forward(self, *args):
        return self.model(**dict(zip(self.names, args, strict=True)), **self.static)

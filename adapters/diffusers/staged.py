"""What every diffusers transformer's staged model shares (`wan.py`, `hunyuan.py`): the token
grid of a latent, the rope tables of a grid (diffusers' rope modules read the latent's shape
only), and which block a parameter belongs to."""

from __future__ import annotations

import math

import torch
from torch import nn


class StagedTransformer(nn.Module):
    """The staged API's shape-only parts over one diffusers transformer whose blocks are the
    ModuleList `blocks_name` and whose patch is `patch_size` (t, h, w)."""

    blocks_name = ""

    def __init__(self, transformer: nn.Module, patch_size: tuple[int, int, int]):
        super().__init__()
        self.transformer = transformer
        self.patch_size = tuple(patch_size)
        cfg = transformer.config
        self.hidden_dim = cfg.num_attention_heads * cfg.attention_head_dim
        self.num_blocks = len(getattr(transformer, self.blocks_name))

    def grid(self, latent_shape) -> tuple[int, int, int]:
        *_, frames, height, width = latent_shape
        return tuple(n // p for n, p in zip((frames, height, width), self.patch_size, strict=True))

    def sequence_length(self, grid) -> int:
        return math.prod(grid)

    def rope(self, grid, device=None):
        shape = (1, 1, *(n * p for n, p in zip(grid, self.patch_size, strict=True)))
        return self.transformer.rope(torch.empty(shape, device=device))

    def block_of(self, name: str) -> int | None:
        head = f"transformer.{self.blocks_name}."
        return int(name[len(head):].split(".", 1)[0]) if name.startswith(head) else None

    def time_gates(self, ctx):
        return None  # the remodulated residual is ours alone (`CMConfig.remodulate`)

"""Small layers both DiTs share: dtype-following Linear, the timestep sinusoid, RoPE tables.

B batch, L tokens, D model dim, P rotary pairs.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch import nn

from modules import ops


class ModelConfigError(ValueError):
    """A model configuration or an input shape that the model cannot take."""


class Linear(nn.Linear):
    """nn.Linear that casts its input to the weight dtype, so fp32 islands feed bf16 weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm computed and returned in fp32 (the official norms run in fp32)."""

    def __init__(self, dim: int, eps: float, affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None

    def forward(self, x):
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


def time_mlp(dim_in: int, dim: int) -> nn.Sequential:
    """Linear -> SiLU -> Linear on a timestep sinusoid (keys `.0.` and `.2.` as shipped)."""
    return nn.Sequential(Linear(dim_in, dim), nn.SiLU(), Linear(dim, dim))


class StagedDiT(nn.Module):
    """What both DiTs share around the staged API; the config names patch_size, rope_axes,
    rope_theta and num_layers."""

    @property
    def num_blocks(self) -> int:
        return self.config.num_layers

    def grid(self, latent_shape) -> tuple[int, int, int]:
        """Token grid (f, h, w) of a latent [B, C, F, H, W]."""
        return token_grid(latent_shape, self.config.patch_size)

    def block_of(self, name: str) -> int | None:
        """The block whose staged call reads parameter `name`; None: prepare or the head read it."""
        for child, module in self.named_children():
            if isinstance(module, nn.ModuleList) and len(module) == self.num_blocks \
                    and name.startswith(child + "."):
                return int(name[len(child) + 1:].split(".", 1)[0])
        return None

    def sequence_length(self, grid) -> int:
        """Tokens of the image stream for a token grid (S2V adds reference and motion tokens)."""
        return math.prod(grid)

    def rope(self, grid, device=None):
        """RoPE tables for a token grid; build them once per shape and pass them to prepare()."""
        return rope_tables(grid, self.config.rope_axes, self.config.rope_theta, device)

    def time_gates(self, ctx):
        """The time term shared by every block's gate rows (see WanDiT.time_gates), or None when
        each block derives its gates from the time embedding on its own (HunyuanVideo-1.5:
        a linear layer per block), so no block-independent term exists."""
        return None


def timestep_sinusoid(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """cat(cos, sin) of t * 10000^(-i/half), in fp32, shape t.shape + (dim,) (trap T25).

    Wan's official code does this in float64; fp32 is what diffusers does and what an
    accelerator without x64 can trace (|error| < 1e-4 rad at t = 1000).
    """
    half = dim // 2
    exponent = torch.arange(half, dtype=torch.float32, device=t.device) * (-math.log(max_period) / half)
    args = t.float()[..., None] * torch.exp(exponent)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def token_grid(latent_shape, patch_size: tuple[int, int, int]) -> tuple[int, int, int]:
    """Token grid (f, h, w) of a latent [B, C, F, H, W]."""
    *_, frames, height, width = latent_shape
    pt, ph, pw = patch_size
    if frames % pt or height % ph or width % pw:
        raise ModelConfigError(f"latent F, H, W = {frames}, {height}, {width} must be multiples "
                               f"of the patch size {tuple(patch_size)}")
    return frames // pt, height // ph, width // pw


def patchify(x: torch.Tensor, grid, conv: nn.Conv3d) -> torch.Tensor:
    """A kernel == stride Conv3d as one matmul over non-overlapping patches: [B, L, D] fp32.

    The Conv3d only holds the official [D, C, pt, ph, pw] weight; a matmul is what an
    accelerator wants, and tokens come out in (f, h, w) raster order like the official flatten.
    """
    b, c = x.shape[:2]
    (f, h, w), (pt, ph, pw) = grid, conv.kernel_size
    patches = x.reshape(b, c, f, pt, h, ph, w, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
    tokens = patches.reshape(b, f * h * w, -1).to(conv.weight.dtype)
    return nn.functional.linear(tokens, conv.weight.flatten(1), conv.bias).float()


def rope_tables(grid: tuple[int, int, int], axes_dims: tuple[int, int, int], theta: float,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [L, P] for tokens in (f, h, w) raster order, per-axis frequencies.

    Axis j with d_j channels holds d_j/2 pairs rotating by pos * theta^(-2i/d_j). Computed in
    float64 on the host from the static grid (the official Wan code uses float64), then stored
    as fp32: they are shape constants, never traced values. Build them once per shape and pass
    them to `prepare`; the host arrays are memoised, the device copy is not.
    """
    cos, sin = _rope_angles(tuple(grid), tuple(axes_dims), float(theta))
    return torch.tensor(cos, device=device), torch.tensor(sin, device=device)


@functools.lru_cache(maxsize=16)
def _rope_angles(grid, axes_dims, theta):
    return rope_angles_at(grid_positions(grid), axes_dims, theta)


def grid_positions(grid) -> np.ndarray:
    """Integer (t, h, w) positions [L, 3] of a token grid in (f, h, w) raster order."""
    axes = np.meshgrid(*(np.arange(n, dtype=np.float64) for n in grid), indexing="ij")
    return np.stack([a.reshape(-1) for a in axes], axis=-1)


def rope_angles_at(positions_L3: np.ndarray, axes_dims, theta: float):
    """cos, sin [L, P] (fp32, read-only) for tokens at arbitrary, possibly negative, (t, h, w)
    positions: axis j with d_j channels rotates d_j/2 pairs by pos * theta^(-2i/d_j), the
    angles in float64 like the official code."""
    angles = []
    for axis, d in enumerate(axes_dims):
        if d % 2:
            raise ValueError(f"RoPE axis {axis} has {d} channels; expected an even number")
        inv_freq = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
        angles.append(positions_L3[:, axis, None] * inv_freq[None, :])
    angle_LP = np.concatenate(angles, axis=-1)
    cos, sin = np.cos(angle_LP).astype(np.float32), np.sin(angle_LP).astype(np.float32)
    cos.flags.writeable = sin.flags.writeable = False  # shared by every caller
    return cos, sin

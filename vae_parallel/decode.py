"""Decode a latent with the frame split over ranks (seed 004's VAE patch parallel): each rank
decodes its patch with the decoder's layers made patch-parallel, and a two-stage gather puts the
frame together on rank 0."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .comm import PatchComm
from .grid import PatchGridError
from .layers import patch_parallel


def decoder_parts(vae) -> list[nn.Module]:
    """The modules a diffusers VAE's decode runs (Wan's post_quant_conv, then the decoder)."""
    return [m for m in (getattr(vae, "post_quant_conv", None), vae.decoder) if m is not None]


def plain_decode(vae, z: torch.Tensor) -> torch.Tensor:
    return vae.decode(z, return_dict=False)[0]


def parallel_decode(vae, z: torch.Tensor, comm: PatchComm,
                    decode: Callable = plain_decode) -> torch.Tensor | None:
    """z [B, C, F, H, W], the whole latent on every rank -> the decoded video on rank 0 (None on
    the others), equal to `decode(vae, z)` on one device up to rounding."""
    grid = comm.grid
    if tuple(z.shape[-2:]) != (grid.height, grid.width):
        raise PatchGridError(f"latent {list(z.shape)} does not match the grid's "
                             f"{grid.height}x{grid.width} latent pixels")
    if getattr(vae, "use_tiling", False):
        raise PatchGridError("tiled decode and patch parallel are alternatives; disable tiling")
    local = grid.local(z, comm.rank).contiguous()
    with torch.no_grad(), patch_parallel(decoder_parts(vae), comm) as plan:
        halo = max((layer.halo for layer in plan), default=0)
        if grid.min_patch() < halo:  # the same on every rank, so all stop before any exchange
            raise PatchGridError(f"patches of {grid.min_patch()} latent pixels cannot lend a "
                                 f"halo of {halo}; use fewer ranks")
        y = decode(vae, local)
    scale, rest = divmod(y.shape[-2], local.shape[-2])
    if rest or y.shape[-1] != scale * local.shape[-1]:
        raise PatchGridError(f"a {list(local.shape[-2:])} patch decoded to {list(y.shape[-2:])}; "
                             "expected one integer spatial scale")
    return comm.gather_frame(y, scale)

"""How far a cached run's latents are from the uncached run's (benchmark_workload.md)."""

from __future__ import annotations

import math

import torch


def fidelity(latents: torch.Tensor, reference: torch.Tensor, noise: torch.Tensor | None = None) -> dict:
    """PSNR over the reference's value range, relative L2, and (given the initial noise) the
    error relative to how far the reference moved from the noise: random-weight models keep much
    of the noise, which inflates PSNR, and the last figure does not flatter them."""
    x, ref = latents.double(), reference.double()
    err = (x - ref).norm().item()
    mse = (x - ref).square().mean().item()
    peak = (ref.max() - ref.min()).item()
    out = {
        "psnr_db": math.inf if mse == 0 else 10 * math.log10(peak * peak / mse),
        "rel_l2": err / max(ref.norm().item(), 1e-30),
    }
    if noise is not None:
        out["rel_to_displacement"] = err / max((ref - noise.double()).norm().item(), 1e-30)
    return out

"""VAE patch parallel (seed 004) on local gloo ranks: the split decode of tiny random VAEs of all
three architectures equals the single-process decode within 1e-5 relative (fp32), on 2 and 4
ranks, for frames that split evenly and frames that do not; a naive split (no halos, no gathered
attention) does not, which shows the comparison can fail. Plus the generic layer rules on a toy
decoder (GroupNorm, trilinear upsampling, replicate padding), the refusals, and the grid."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from modules.vae import VAES, build_tiny
from vae_parallel import (
    PatchComm,
    PatchGrid,
    PatchGridError,
    PatchParallelMode,
    parallel_decode,
    plain_decode,
    plan_grid,
    plan_layers,
    split_sizes,
)
from vae_parallel.launch import RankFailure, run_ranks

TOL = 1e-5
FRAMES = 2  # latent frames: the second one runs on Wan's temporal cache and HY's causal mask
# (id, VAE, z, latent height, width, grid or None for the planned one) per world size.
# 4x6 splits evenly on 2 (1x2) and 4 (2x2) ranks; 5x7 does not (4+3 columns, 3+2 rows).
CASES = {
    2: [("wan2.1-even", "wan2.1-vae", 16, 4, 6, None), ("wan2.1-uneven", "wan2.1-vae", 16, 5, 7, None),
        ("wan2.2-even", "wan2.2-vae", 48, 4, 6, None), ("wan2.2-uneven", "wan2.2-vae", 48, 5, 7, None),
        ("hy-even", "hunyuanvideo-1.5-vae", 32, 4, 6, None),
        ("hy-uneven", "hunyuanvideo-1.5-vae", 32, 5, 7, None),
        ("wan2.1-rows-uneven", "wan2.1-vae", 16, 5, 7, (2, 1)),
        ("hy-rows-uneven", "hunyuanvideo-1.5-vae", 32, 5, 7, (2, 1))],
    4: [("wan2.1-even", "wan2.1-vae", 16, 4, 6, None), ("wan2.1-uneven", "wan2.1-vae", 16, 5, 7, None),
        ("wan2.2-even", "wan2.2-vae", 48, 4, 6, None), ("wan2.2-uneven", "wan2.2-vae", 48, 5, 7, None),
        ("hy-even", "hunyuanvideo-1.5-vae", 32, 4, 6, None),
        ("hy-uneven", "hunyuanvideo-1.5-vae", 32, 5, 7, None),
        # one-pixel patches: the smallest that can lend a halo of one
        ("wan2.2-columns-1px", "wan2.2-vae", 48, 4, 7, (1, 4)),
        ("hy-columns-1px", "hunyuanvideo-1.5-vae", 32, 4, 7, (1, 4))],
}


class ToyVAE(nn.Module):
    """The layers the diffusers VAEs do not have but the rules cover: replicate padding,
    GroupNorm (whole-frame statistics), trilinear and nearest upsampling."""

    def __init__(self):
        super().__init__()
        self.decoder = nn.Sequential(
            nn.Conv3d(4, 8, 3, padding=1, padding_mode="replicate"), nn.GroupNorm(2, 8), nn.SiLU(),
            nn.Upsample(scale_factor=(1, 2, 2), mode="trilinear"),
            nn.Conv3d(8, 8, 3, padding=1), nn.GroupNorm(4, 8),
            nn.Upsample(scale_factor=(1, 2, 2), mode="nearest"),
            nn.Conv3d(8, 3, (1, 3, 3), padding=(0, 1, 1)))

    def decode(self, z, return_dict=False):
        return (self.decoder(z),)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _naive(vae, z, comm):
    """Each rank decodes its patch alone: what the halos and the gathered K/V fix."""
    with torch.no_grad():
        y = plain_decode(vae, comm.grid.local(z, comm.rank).contiguous())
    return comm.gather_frame(y, y.shape[-2] // comm.grid.rows[comm.row])


def _untouched(vae):
    return not any(m._forward_pre_hooks or "forward" in m.__dict__ for m in vae.modules())


def _compare(rank, vae, z, comm, naive=True):
    """Parallel decode against the single-process one, in fp32 (the acceptance bar) and fp64
    (where rounding is ~1e-16, so any error of the method itself would stand out)."""
    out = {}
    for dtype in (torch.float32, torch.float64):
        vae, z = vae.to(dtype), z.to(dtype)
        video = parallel_decode(vae, z, comm)
        seams = _naive(vae, z, comm) if naive and dtype == torch.float32 else None
        if rank == 0:
            with torch.no_grad():
                reference = plain_decode(vae, z)
            key = "err" if dtype == torch.float32 else "err64"
            out[key] = _rel(video, reference)
            if seams is not None:
                out.update(naive=_rel(seams, reference), shape=tuple(video.shape),
                           ref_shape=tuple(reference.shape),
                           unclamped=float((reference.abs() < 0.999).float().mean()))
    if rank == 0:
        out.update(grid=comm.grid, untouched=_untouched(vae))
    return out


def decode_cases(rank, world_size):
    """Runs on every rank; rank 0 returns {case: errors, grid, ...}."""
    out = {}
    for case, name, z_dim, h, w, shape in CASES[world_size]:
        vae = build_tiny(VAES[name], z_dim, seed=1)
        z = torch.randn(1, z_dim, FRAMES, h, w, generator=torch.Generator().manual_seed(2))
        out[case] = _compare(rank, vae, z, PatchComm(plan_grid(world_size, h, w, shape)))
    torch.manual_seed(3)
    toy = ToyVAE().eval()
    z = torch.randn(1, 4, 2, 5, 7, generator=torch.Generator().manual_seed(4))
    out["toy-groupnorm-trilinear"] = _compare(rank, toy, z, PatchComm(plan_grid(world_size, 5, 7)))
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def results():
    """One launch per world size runs every case (process start-up dominates)."""
    return {world: run_ranks(world, decode_cases)[0] for world in CASES}


@pytest.mark.parametrize("world", sorted(CASES))
def test_patch_parallel_decode_equals_the_single_process_decode(results, world):
    cases = results[world]
    assert set(cases) == {c[0] for c in CASES[world]} | {"toy-groupnorm-trilinear"}
    for case, r in cases.items():
        assert r["shape"] == r["ref_shape"], case
        assert r["err"] <= TOL, f"{case} on {world} ranks ({r['grid']}): rel err {r['err']:.2e}"
        assert r["err64"] <= 1e-12, f"{case} on {world} ranks in fp64: rel err {r['err64']:.2e}"
        # the check has teeth: without halos and gathered K/V the seams show
        assert r["naive"] > 1e-3, f"{case}: a naive split already matches ({r['naive']:.2e})"
        if not case.startswith("toy"):  # the VAEs clamp to [-1, 1]; the toy does not
            assert r["unclamped"] > 0.9, f"{case}: the tiny VAE saturates; a weak comparison"
        assert r["untouched"], f"{case}: hooks or forward overrides were left on the VAE"


@pytest.mark.parametrize("world", sorted(CASES))
def test_uneven_cases_really_split_unevenly(results, world):
    grids = {case: r["grid"] for case, r in results[world].items()}
    for case, grid in grids.items():
        even = len(set(grid.rows)) == 1 and len(set(grid.cols)) == 1
        assert even == case.endswith("-even"), (case, grid)


# --- in-process: grid, planning, refusals -------------------------------------------------------

def test_grid_plans_the_least_halo_and_splits_as_evenly_as_possible():
    assert split_sizes(7, 2) == (4, 3) and split_sizes(7, 4) == (2, 2, 2, 1)
    assert plan_grid(2, 4, 5).shape == (1, 2)  # 4/1 + 5/2 < 4/2 + 5/1
    assert plan_grid(4, 45, 80).shape == (2, 2)
    assert plan_grid(8, 45, 80).shape == (2, 4)
    grid = plan_grid(4, 5, 7)
    assert grid.rows == (3, 2) and grid.cols == (4, 3)
    assert grid.bounds(3) == (3, 5, 4, 7) and grid.bounds(3, scale=8) == (24, 40, 32, 56)
    assert grid.neighbours(0) == {"up": None, "down": 2, "left": None, "right": 1}
    frame = torch.arange(35).view(5, 7)
    pieces = [grid.local(frame, r) for r in range(4)]
    top = torch.cat(pieces[:2], 1)
    assert torch.equal(torch.cat([top, torch.cat(pieces[2:], 1)], 0), frame)


def test_grid_refuses_splits_that_cannot_work():
    with pytest.raises(PatchGridError, match="cannot split a 1x2 latent"):
        plan_grid(4, 1, 2)
    with pytest.raises(PatchGridError, match="expected 4"):
        plan_grid(4, 8, 8, (1, 2))
    with pytest.raises(PatchGridError, match="at least one latent row"):
        PatchGrid((2, 0), (3,))


def test_every_spatial_layer_of_the_three_vaes_has_a_rule():
    kinds = {}
    for name, spec in VAES.items():
        vae = build_tiny(spec, spec.z_dim)
        kinds[name] = {layer.kind for layer in plan_layers([vae.post_quant_conv, vae.decoder]
                                                           if hasattr(vae, "post_quant_conv")
                                                           else [vae.decoder])}
    assert kinds["wan2.1-vae"] == {"wan_causal_conv", "conv", "attention"}  # conv: resample's Conv2d
    assert kinds["wan2.2-vae"] == {"wan_causal_conv", "conv", "attention"}
    assert kinds["hunyuanvideo-1.5-vae"] == {"hy_causal_conv", "attention"}


@pytest.mark.parametrize("layer, message", [
    (nn.Conv2d(4, 4, 3, stride=2, padding=1), "stride"),
    (nn.Conv2d(4, 4, 3), "changes the frame size"),
    (nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular"), "padding_mode"),
    (nn.AvgPool2d(2), "AvgPool2d"),
    (nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True), "align_corners"),
    (nn.Upsample(scale_factor=1.5), "integer"),
    (nn.Upsample(size=(8, 8)), "fixed size"),
])
def test_layers_without_a_patch_rule_are_refused_by_name(layer, message):
    with pytest.raises(PatchGridError, match=message):
        plan_layers([nn.Sequential(layer)])


def test_the_guard_refuses_functional_ops_that_mix_patches():
    x = torch.randn(1, 2, 4, 4)
    with PatchParallelMode(comm=None):
        assert F.interpolate(x, scale_factor=2, mode="nearest").shape[-1] == 8  # local: allowed
        with pytest.raises(PatchGridError, match="attention outside"):
            F.scaled_dot_product_attention(x, x, x)
        with pytest.raises(PatchGridError, match="nearest with integer scales"):
            F.interpolate(x, scale_factor=2, mode="bilinear")
        with pytest.raises(PatchGridError, match="group_norm"):
            F.group_norm(x, 2)


def _fails_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(RankFailure, match="rank 1 failed(.|\n)*rank one refuses"):
        run_ranks(2, _fails_on_rank_one, timeout=60)

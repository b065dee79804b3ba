"""Run by tests/test_stage3_jax.py in a fresh process with 8 emulated CPU devices (the flag must
be set before jax starts). For each tiny VAE: its JAX decode on one device against the
diffusers decode, for clips of 3 and 2 latent frames, with what the loop compiled; then the rows
split over 2, 4 or 8 devices against that one-device decode, and the collectives each compiled
program holds. Prints one JSON object of measured facts."""

import os
import sys

os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                           "--xla_backend_optimization_level=0")  # compiles faster
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from modules.vae import VAES, build_tiny  # noqa: E402
from tests.sp_jax_check import collectives  # noqa: E402
from tpu.vae import JaxVaeDecoder
from tpu.vae_plan import make_mesh

# VAE -> (latent channels, latent [H, W], meshes): H splits over 8 devices. Every count for each
# way of splitting: the Wan VAEs' strips (Wan2.1's 8 devices also each cutting its band, 2 x 8
# latent pixels, into 2 x 2 strips as on a TPU: tpu.vae_strips.strip_grid) and HunyuanVideo-1.5's GSPMD
# partitioning; 8 for Wan2.2, whose decoder splits as Wan2.1's does (each mesh compiles two
# programs).
CASES = {"wan2.1-vae": (16, (16, 8), (2, 4, 8, (8, (2, 2)))), "wan2.2-vae": (48, (8, 4), (8,)),
         "hunyuanvideo-1.5-vae": (4, (8, 4), (2, 4, 8))}


def check(name: str) -> dict:
    channels, hw, counts = CASES[name]
    vae = build_tiny(VAES[name], channels)
    one = JaxVaeDecoder(vae)
    facts = {"one_device": {}, "meshes": {}}
    pairs = []
    for frames in (3, 2):
        z = torch.randn(1, channels, frames, *hw, generator=torch.Generator().manual_seed(frames))
        pairs.append(one.prepare(tuple(z.shape)))  # compiled here, before the loop
        before = one.compile_counts()
        video = one.decode(z)
        loop = one.compile_counts().lowered - before.lowered
        with torch.no_grad():
            expected = vae.decode(z).sample.float().numpy()
        facts["one_device"][frames] = dict(
            shape=list(video.shape), diffusers_shape=list(expected.shape), loop_compiles=loop,
            max_abs=float(np.abs(video - expected).max()) if video.shape == expected.shape else None)
    facts["same_programs"] = pairs[0] is pairs[1]  # one pair of programs served both lengths
    for case in counts:  # the 2-frame clip, its rows split
        n, grid = case if isinstance(case, tuple) else (case, "auto")
        decoder = JaxVaeDecoder(vae, make_mesh(n), **({} if grid == "auto" else {"strips": grid}))
        first, steady = decoder.prepare(tuple(z.shape))
        out = decoder.decode(z)
        key = n if grid == "auto" else f"{n} x {grid[0]}x{grid[1]} strips"
        facts["meshes"][key] = dict(max_abs=float(np.abs(out - video).max()), shape=list(out.shape),
                                  first=collectives(first.as_text()),
                                  steady=collectives(steady.as_text()))
    return facts


def main():
    torch.set_num_threads(1)  # the diffusers decodes: a second thread spin-waits on busy cores
    print(json.dumps({name: check(name) for name in CASES}))


if __name__ == "__main__":
    main()

"""Run by tests/test_stage3_jax.py in a fresh process with 8 emulated CPU devices (the flag must
be set before jax starts): the JAX VAE decode of each tiny VAE with its rows split over 2, 4 and
8 devices against one device, and the collectives each compiled program holds. Prints one JSON
object of measured facts."""

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
from tpu.vae import JaxVaeDecoder, make_mesh  # noqa: E402

# (VAE, latent channels, latent [F, H, W], device counts): H splits over 8 devices. Every count
# for one Wan VAE, 8 for the others (each mesh compiles two programs: ~4 min for all nine).
CASES = [("wan2.1-vae", 16, (2, 16, 8), (2, 4, 8)), ("wan2.2-vae", 48, (2, 8, 4), (8,)),
         ("hunyuanvideo-1.5-vae", 4, (2, 8, 4), (8,))]


def main():
    facts = {}
    for name, channels, shape, counts in CASES:
        vae = build_tiny(VAES[name], channels)
        z = torch.randn(1, channels, *shape, generator=torch.Generator().manual_seed(0))
        one = JaxVaeDecoder(vae).decode(z)
        for n in counts:
            decoder = JaxVaeDecoder(vae, make_mesh(n))
            first, steady = decoder.prepare(tuple(z.shape))
            out = decoder.decode(z)
            facts[f"{name}/{n}"] = dict(max_abs=float(np.abs(out - one).max()),
                                        shape=list(out.shape),
                                        first=collectives(first.as_text()),
                                        steady=collectives(steady.as_text()))
    print(json.dumps(facts))


if __name__ == "__main__":
    main()

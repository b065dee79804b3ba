"""The Wan2.2 VAE (TI2V-5B's: 48 latent channels, the 2x2 patchify, the DupUp3D shortcut
upsamplers) decoded on strips against diffusers' AutoencoderKLWan decode of the same tiny random
weights. tests/test_vae_strips.py checks strips on the Wan2.1 VAE; tests/test_stage3_jax.py the
Wan2.2 decode on one device and on rows split over 8 (never on strips)."""

import numpy as np
import pytest
import torch

from modules.vae import VAES, build_tiny
from tpu import vae as tv

FP32_ATOL = 1e-4  # tests/test_stage3_jax.py's: XLA's conv and reduction order against torch's


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The diffusers decode on one thread: with both cores busy, a second OpenMP thread
    spin-waits for its turn."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_wan22_decode_on_2x2_strips_is_the_diffusers_decode():
    """2 latent frames (the first program and a steady one) of the tiny VAE's 4 x 4 latent
    frame, cut into 2 x 2 strips of 2 x 2 latent pixels: every 3x3 conv reads its neighbours'
    lines through the halo, the shortcut upsamplers repeat pixels across strip edges, and the
    patchify's 2x2 pixels are put back after the strips are joined."""
    vae = build_tiny(VAES["wan2.2-vae"], 48)
    z = torch.randn(1, 48, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    decoder = tv.JaxVaeDecoder(vae, strips=(2, 2))
    video = decoder.decode(z)
    assert decoder.strips is not None and decoder.strips.batch == 4
    with torch.no_grad():
        want = vae.decode(z).sample.float().numpy()
    assert video.shape == want.shape == (1, 3, 5, 64, 64)
    assert np.abs(video - want).max() < FP32_ATOL  # seen: 2.1e-6

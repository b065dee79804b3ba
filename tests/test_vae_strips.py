"""On a TPU the Wan decoders run each device's band of the frame as a batch of strips
(tpu.vae_strips.Strips): libtpu cuts a conv of a batch under 8 into 8 width batches and relays out its
input and output around it. Checked here on one CPU device: the grid each band takes, a decode on
strips equal to the decode of the whole frame, and grids that do not divide refused by name.
The strips over 8 emulated devices: tests/vae_jax_check.py."""

import numpy as np
import pytest
import torch

from modules.vae import VAES, build_tiny
from tpu import vae as tv
from tpu import vae_strips, vae_wan


def test_a_tpu_band_takes_the_grid_of_at_least_8_strips_with_the_least_halo():
    # Wan2.2 TI2V-5B, 704 x 1280 over v6e-8 by columns: 44 x 10 latent pixels a chip. 4 x 2
    # strips of 88 x 40 at the last convs add (90*42)/(88*40) - 1 = 7.4% halo; 11 x 1 (32 x 80)
    # 8.9%, 2 x 5 (176 x 16) 13.8%
    assert vae_strips.strip_grid(44, 10, "tpu") == (4, 2)
    # Wan2.2 I2V-A14B, 720 x 1280 by columns: 90 x 20 a chip; 9 x 1 strips of 80 x 160: 3.8%
    assert vae_strips.strip_grid(90, 20, "tpu") == (9, 1)
    # 8 x 8: 4 x 2 and 2 x 4 add 19.5%, 8 x 1 28.9%, 4 x 4 26.6%; of the tie the wider strips
    assert vae_strips.strip_grid(8, 8, "tpu") == (4, 2)
    assert vae_strips.strip_grid(44, 10, "cpu") == (1, 1)  # elsewhere the frame's band stays whole
    assert vae_strips.strip_grid(3, 2, "tpu") == (1, 1)  # no grid of 8 divides 3 x 2


@pytest.mark.parametrize("grid", [(2, 2), (1, 4), (4, 1)])
def test_strips_decode_what_the_whole_frame_decodes(grid):
    torch.set_num_threads(1)
    vae = build_tiny(VAES["wan2.1-vae"], 16)
    z = torch.randn(1, 16, 2, 8, 8, generator=torch.Generator().manual_seed(1))
    whole = tv.JaxVaeDecoder(vae, strips=(1, 1))
    strips = tv.JaxVaeDecoder(vae, strips=grid)
    video, cut = whole.decode(z), strips.decode(z)
    assert whole.strips is None and strips.strips.batch == grid[0] * grid[1]
    assert video.shape == cut.shape == (1, 3, 5, 64, 64)
    assert np.abs(video - cut).max() < 1e-5  # fp32 sums in another order; seen 2e-6
    with torch.no_grad():
        assert np.abs(vae.decode(z).sample.float().numpy() - cut).max() < 1e-4


def test_grids_that_do_not_divide_the_band_are_refused():
    vae = build_tiny(VAES["wan2.1-vae"], 16)
    z = torch.randn(1, 16, 1, 8, 6)
    with pytest.raises(ValueError, match=r"strips 4 x 4: each device's band of the latent frame "
                                         r"is 8 x 6; expected divisors of those"):
        tv.JaxVaeDecoder(vae, strips=(4, 4)).prepare(tuple(z.shape))
    with pytest.raises(ValueError, match="strips=\\(0, 2\\): expected 'auto' or \\(rows, columns"):
        tv.JaxVaeDecoder(vae, strips=(0, 2))
    with pytest.raises(ValueError, match="for a Wan VAE"):
        tv.JaxVaeDecoder(build_tiny(VAES["hunyuanvideo-1.5-vae"], 4), strips=(2, 2))


@pytest.mark.parametrize("cin,cout,ft", [(1024, 1024, 2), (1024, 512, 1), (48, 12, 1), (8, 16, 2)])
def test_the_shortcut_upsampler_repeats_pixels_to_the_same_numbers(cin, cout, ft):
    """Wan2.2's DupUp3D through tpu.vae's route: repeats 8 (sub-pixels share a channel), 2 (the
    columns do: the TI2V-5B VAE's last up block), 1 (diffusers' transpose), 16; bit for bit."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import DupUp3D

    m = DupUp3D(cin, cout, ft, 2)
    x = torch.randn(2, cin, 3, 5, 4, generator=torch.Generator().manual_seed(cin + cout))
    for first in (False, True):
        assert torch.equal(vae_wan.dup_up(m, x, first_chunk=first), m(x, first_chunk=first))


@pytest.mark.parametrize("per_call", [2, 3])
def test_steady_calls_of_several_frames_decode_what_diffusers_does_and_compile_nothing(per_call):
    """A steady call of k latent frames; a clip whose frames after the first do not fill the last
    call pads it with zero frames (the convs are causal) and drops their video."""
    torch.set_num_threads(1)
    vae = build_tiny(VAES["wan2.1-vae"], 16)
    decoder = tv.JaxVaeDecoder(vae, frames_per_call=per_call)
    for frames in (4, 2):  # 3 frames after the first: k=2 pads its second call, k=3 fills one
        z = torch.randn(1, 16, frames, 8, 8, generator=torch.Generator().manual_seed(frames))
        decoder.prepare(tuple(z.shape))
        before = decoder.compile_counts().lowered
        video = decoder.decode(z)
        assert decoder.compile_counts().lowered == before  # one pair of programs, both lengths
        with torch.no_grad():
            want = vae.decode(z).sample.float().numpy()
        assert video.shape == want.shape == (1, 3, 4 * frames - 3, 64, 64)
        assert np.abs(video - want).max() < 1e-4


def test_frames_per_call_is_a_positive_integer_and_wan_only():
    vae = build_tiny(VAES["wan2.1-vae"], 16)
    assert tv.JaxVaeDecoder(vae).per_call == vae_wan.WAN_FRAMES_PER_CALL
    for bad in (0, "2", 1.5):
        with pytest.raises(ValueError, match="expected 'auto' or a positive integer"):
            tv.JaxVaeDecoder(vae, frames_per_call=bad)
    hunyuan = build_tiny(VAES["hunyuanvideo-1.5-vae"], 4)
    assert tv.JaxVaeDecoder(hunyuan).per_call == 1
    with pytest.raises(ValueError, match="above 1 for a Wan VAE only"):
        tv.JaxVaeDecoder(hunyuan, frames_per_call=2)

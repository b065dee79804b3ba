"""A TPU computes a float32 convolution at XLA's DEFAULT precision from bfloat16 operands with
float32 sums; on a TPU the Wan decoders state that rounding in their programs (tpu.vae,
conv_operands), so weights, carried caches and conv inputs move half the bytes. Checked here on
CPU, where the rounding is forced, against torch with each conv's operands rounded by hand."""

import copy

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

from compat.torchax_compat import import_torchax
from modules.vae import VAES, build_tiny
from tpu import vae as tv
from tpu import vae_wan

torchax = import_torchax()
env = torchax.default_env()


def _rounded(t):
    return t.to(torch.bfloat16).to(t.dtype) if isinstance(t, torch.Tensor) else t


@pytest.mark.parametrize("dims", [2, 3])
def test_a_rounded_conv_is_the_conv_of_rounded_operands_summed_in_float32(dims):
    g = torch.Generator().manual_seed(dims)
    x = torch.randn(1, 16, *(4, 6, 5)[-dims:], generator=g)
    w = torch.randn(8, 16, *(3,) * dims, generator=g)
    b = torch.randn(8, generator=g)
    pad = (1,) * dims
    conv = F.conv3d if dims == 3 else F.conv2d
    exact = conv(_rounded(x).double(), _rounded(w).double(), b.double(), 1, pad).numpy()

    def run(x, w, b):
        return vae_wan.rounded_conv(x, w, b, (1,) * dims, pad, (1,) * dims, 1, torch.bfloat16)

    with env:
        got = np.asarray(torchax.interop.jax_view(run)(jnp.asarray(x.numpy()), jnp.asarray(
            w.numpy()), jnp.asarray(b.numpy())))
    scale = np.abs(exact).max()
    assert got.dtype == np.float32  # summed and returned in float32, not rounded to bfloat16
    assert np.abs(got - exact).max() < 1e-5 * scale
    unrounded = conv(x.double(), w.double(), b.double(), 1, pad).numpy()
    assert np.abs(unrounded - exact).max() > 1e-3 * scale  # the rounding is what is checked


def _torch_with_rounded_convs(vae):
    ref = copy.deepcopy(vae)
    with torch.no_grad():
        for part in (ref.decoder, ref.post_quant_conv):
            for m in part.modules():
                if isinstance(m, (WanCausalConv3d, torch.nn.Conv2d)):
                    m.weight.copy_(_rounded(m.weight))
                    m.register_forward_pre_hook(lambda m, args: tuple(map(_rounded, args)))
    return ref


def test_the_wan_decoder_rounds_on_tpu_only_and_decodes_like_torch_with_rounded_convs():
    assert vae_wan.conv_operand_dtype(torch.float32, "tpu") == torch.bfloat16
    assert vae_wan.conv_operand_dtype(torch.float32, "cpu") is None
    assert vae_wan.conv_operand_dtype(torch.bfloat16, "tpu") is None
    vae = build_tiny(VAES["wan2.2-vae"], 48)
    assert tv.JaxVaeDecoder(vae).operands is None  # on this CPU: float32 as stored

    decoder = tv.JaxVaeDecoder(vae, conv_operands=torch.bfloat16)
    convs = vae_wan.conv_weights(vae)
    assert "vae.post_quant_conv.weight" in convs and "vae.decoder.conv_out.weight" in convs
    dtypes = {name: str(p.dtype) for name, p in decoder.params.items()}
    assert {dtypes[n] for n in convs} == {"bfloat16"}
    assert {d for n, d in dtypes.items() if n not in convs} == {"float32"}  # norms, biases

    reference = _torch_with_rounded_convs(vae)
    for frames in (1, 2):  # the first program alone; then the steady one after it
        z = torch.randn(1, 48, frames, 8, 4, generator=torch.Generator().manual_seed(frames))
        video = decoder.decode(z)
        with torch.no_grad():
            want = reference.decode(z).sample.float().numpy()
            fp32 = vae.decode(z).sample.float().numpy()
        # A flipped rounding (the two sum in different orders) moves what follows by a bfloat16
        # step, so the test takes the mean: measured 1.6e-5 (1 frame) and 4.3e-4 (2 frames),
        # against 1.5e-3 and 2.1e-3 for the float32 decode.
        err, unrounded = np.abs(video - want).mean(), np.abs(fp32 - want).mean()
        assert err < 0.3 * unrounded, (frames, err, unrounded)
    first, _ = decoder.prepare(tuple(z.shape))
    _, state = first(decoder.params, decoder._put(z[:, :, :1], None))
    assert {str(s.dtype) for s in state if s is not None} == {"bfloat16"}  # carried rounded

    hunyuan = build_tiny(VAES["hunyuanvideo-1.5-vae"], 4)
    with pytest.raises(ValueError, match="conv_operands rounds the Wan decoders' convs"):
        tv.JaxVaeDecoder(hunyuan, conv_operands=torch.bfloat16)

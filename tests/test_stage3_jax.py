"""Stage 3 on JAX (tpu/vae.py): each tiny VAE's JAX decode against the diffusers decode, no
compile in the decode loop for clips of two lengths, the rows split over 2/4/8 emulated devices
against one (those three in one child process), and the command end to end after stage 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from commands.stage3 import to_frames
from modules.vae import VAES, build_tiny, to_vae_latents
from sampling.stage_io import CONFIG, VIDEO

ROOT = Path(__file__).resolve().parents[1]

# (VAE, latent channels, latent [H, W]) of the tiny VAEs (modules.vae.build_tiny)
FAMILIES = [("wan2.1-vae", 16, (8, 8)), ("wan2.2-vae", 48, (4, 4)),
            ("hunyuanvideo-1.5-vae", 4, (4, 4))]
FP32_ATOL = 1e-4  # seen: at most 1e-5 (XLA's conv and reduction order against torch's)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The diffusers decodes here on one thread: with both cores busy (pytest -n 2), a second
    OpenMP thread spin-waits for its turn (the tiny Wan2.1 VAE's decode: 0.2 s on one, 2.6 s on
    two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _latents(channels, frames, hw, seed=0):
    return torch.randn(1, channels, frames, *hw, generator=torch.Generator().manual_seed(seed))


def _torch_decode(vae, z):
    with torch.no_grad():
        return vae.decode(z).sample.float().numpy()


def test_jax_decode_equals_diffusers_compiles_nothing_in_the_loop_and_splits_its_rows():
    """One process for the three tiny VAEs (tests/vae_jax_check.py, 8 emulated devices), each
    VAE's one-device programs serving both checks. Clips of 3 and 2 latent frames: the same two
    programs (first frame, steady frame), both compiled before the first loop; the loop of either
    clip lowers nothing; the video is the diffusers decode. Then the 2-frame clip's rows split
    over 2/4/8 devices equal one device (Wan2.2 over 8: it splits as Wan2.1 does; and, for
    Wan2.1, 8 devices each running its band as 2 x 2 strips, as on a TPU): each 3x3 conv
    exchanges one-row halos by collective-permute, attention gathers its K/V; nothing else
    moves."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "vae_jax_check.py")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    every = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(every) == sorted(f[0] for f in FAMILIES)
    for name, facts in every.items():
        assert sorted(facts["one_device"]) == ["2", "3"], name
        for frames, f in facts["one_device"].items():
            frames = int(frames)
            assert f["shape"] == f["diffusers_shape"], (name, f)
            assert f["shape"][:3] == [1, 3, 4 * (frames - 1) + 1], (name, f)
            assert f["loop_compiles"] == 0, (name, f)  # nothing compiled in the loop
            assert f["max_abs"] < FP32_ATOL, (name, frames, f["max_abs"])
        assert facts["same_programs"], name  # one pair of programs served both lengths

        meshes = facts["meshes"]
        assert sorted(meshes) == {"wan2.1-vae": ["2", "4", "8", "8 x 2x2 strips"],
                                  "wan2.2-vae": ["8"],
                                  "hunyuanvideo-1.5-vae": ["2", "4", "8"]}[name]
        for n, f in meshes.items():
            assert f["max_abs"] < FP32_ATOL, (name, n, f["max_abs"])
            assert f["shape"] == [1, 3, 5, 128, 64], (name, n)
            for program in ("first", "steady"):
                ops = f[program]
                assert ops.get("all-gather", 0) == 2, (name, n, ops)  # the attention's K and V
                assert "all-to-all" not in ops and "reduce-scatter" not in ops, (name, n, ops)
    # Wan: 25 3x3 convs, two one-row halos each; HunyuanVideo also broadcasts its border rows
    assert every["wan2.1-vae"]["meshes"]["8"]["steady"] == {"collective-permute": 50, "all-gather": 2}
    # strips: the halos between a device's own strips are local
    assert every["wan2.1-vae"]["meshes"]["8 x 2x2 strips"]["steady"] == {
        "collective-permute": 50, "all-gather": 2}
    assert every["wan2.2-vae"]["meshes"]["8"]["steady"] == {"collective-permute": 50, "all-gather": 2}


def test_hunyuan_bf16_decode_is_as_near_fp32_as_the_diffusers_bf16_decode():
    """HunyuanVideo-1.5 decodes in half precision officially (fp16; bf16 on a TPU). Against the
    fp32 diffusers decode (outputs up to ~1.6), seen: JAX bf16 max 0.089 / mean 0.0047, diffusers
    bf16 max 0.118 / mean 0.0042; allowed: 1.5x the diffusers bf16 error."""
    from tpu.vae import JaxVaeDecoder

    name, channels, hw = FAMILIES[2]
    z = _latents(channels, 3, hw)
    expected = _torch_decode(build_tiny(VAES[name], channels), z)
    half = build_tiny(VAES[name], channels, dtype=torch.bfloat16)
    torch_error = np.abs(_torch_decode(half, z.bfloat16()) - expected)
    jax_error = np.abs(JaxVaeDecoder(half).decode(z) - expected)
    assert jax_error.max() <= 1.5 * torch_error.max()
    assert jax_error.mean() <= 1.5 * torch_error.mean()


def _run(*args, cwd):
    # torch on one thread in the commands (they build the tiny models with it): with both cores
    # busy a second OpenMP thread spin-waits, and stage 3 took 34 s instead of 18 s
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_stage2_then_stage3_on_jax_writes_the_mp4(tmp_path):
    out = _run(ROOT / "stage2_transformer_flax_deepcache.py", "--model", "hunyuanvideo-tiny",
               "--output_dir", tmp_path / "D", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    out = _run(ROOT / "stage3_vae_decode.py", "--input_dir", tmp_path / "D", "--backend", "jax",
               cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "on jax cpu" in out.stdout
    config = json.loads((tmp_path / "D" / CONFIG).read_text())
    assert config["vae_backend"] == "jax" and config["stage3_compile_time"] > 0
    import imageio.v3 as iio
    frames = iio.imread(tmp_path / "D" / VIDEO, plugin="FFMPEG")
    assert frames.shape == (config["video_length"], config["height"], config["width"], 3)
    # the frames are the diffusers decode of these latents, up to H.264 (luma PSNR, as
    # tests/test_stage3.py)
    from sampling.stage_io import read_stage2
    latents, _, _ = read_stage2(str(tmp_path / "D"))
    vae = build_tiny(VAES["hunyuanvideo-1.5-vae"], latents.shape[1])
    with torch.no_grad():
        expected = to_frames(vae.decode(to_vae_latents(vae, latents)).sample)
    weights = np.array([0.299, 0.587, 0.114])
    mse = (((frames.astype(float) - expected.astype(float)) @ weights) ** 2).mean()
    assert 10 * np.log10(255 ** 2 / max(mse, 1e-12)) > 30


def test_torch_only_flags_are_refused_with_the_jax_backend(tmp_path, capsys):
    from commands.stage3 import main
    from tests.test_stage3 import stage2_dir

    stage2_dir(tmp_path, "hunyuanvideo-tiny")
    assert main(["--input_dir", str(tmp_path), "--backend", "jax", "--tiled"]) == 2
    assert "--backend torch" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / VIDEO)

"""Stage 3 (decode to mp4): end to end after stage 2, torchrun patch parallel, both Wan VAEs,
checkpoint loading in both layouts, tiling, and the errors that must stop a run with nothing
written."""

import dataclasses
import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest
import torch

from commands.stage3 import main, to_frames
from modules.vae import (
    TINY_VAE_SEED,
    VAES,
    VaeError,
    build_tiny,
    load_vae,
    rename_keys,
    spec_for,
    to_diffusers_keys,
    to_vae_latents,
)
from sampling.pipelines import get_pipeline
from sampling.stage_io import CONFIG, LATENTS, VIDEO, write_stage2

ROOT = Path(__file__).resolve().parents[1]


def run_script(*args, cwd=ROOT, launcher=()):
    return subprocess.run([sys.executable, *launcher, str(ROOT / args[0]), *args[1:]], cwd=cwd,
                          capture_output=True, text=True)


def read_video(path):
    """(frames [F, H, W, 3] uint8, metadata) as a player decodes them."""
    import imageio.v3 as iio
    return iio.imread(path, plugin="FFMPEG"), iio.immeta(path, plugin="FFMPEG")


def luma_psnr(a, b):
    weights = np.array([0.299, 0.587, 0.114])  # yuv420p keeps luma at full resolution
    mse = (((a.astype(float) - b.astype(float)) @ weights) ** 2).mean()
    return 10 * np.log10(255 ** 2 / max(mse, 1e-12))


def stage2_dir(path, model, channels=None, seed=0, **config):
    """A stage-2 folder with random latents of the model's default size."""
    pipe = get_pipeline(model)
    shape = list(pipe.latent_shape(*pipe.size))
    if channels is not None:
        shape[1] = channels
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    h, w, f = pipe.size
    write_stage2(str(path), latents, {"model": model},
                 {"prompt": "a cat", "model": model, "height": h, "width": w, "video_length": f,
                  **config})
    return latents


def snapshot(path):
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path))}


# --- end to end ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    """The stage-3 guide's first command (docs/stage3.md), then stage 3, on the random-weight tiny
    HunyuanVideo-1.5: its tiny VAE decodes (the default trained model's latent is the clip)."""
    work = tmp_path_factory.mktemp("e2e")
    out = run_script("stage2_transformer_flax_deepcache.py", "--model", "hunyuanvideo-tiny",
                     "--enable_cache", "--output_dir", str(work / "D"), cwd=work)
    assert out.returncode == 0, out.stderr
    before = json.loads((work / "D" / CONFIG).read_text())
    out = run_script("stage3_vae_decode.py", "--input_dir", str(work / "D"), cwd=work)
    return work / "D", before, out


def test_stage2_then_stage3_writes_a_playable_mp4_of_the_configured_size(pipeline_run):
    folder, before, out = pipeline_run
    assert out.returncode == 0, out.stderr
    frames, meta = read_video(folder / VIDEO)
    assert frames.shape == (before["video_length"], before["height"], before["width"], 3)
    assert meta["fps"] == 24.0 and meta["codec"] == "h264"
    config = json.loads((folder / CONFIG).read_text())
    assert {k: config[k] for k in before} == before  # stage 1 and 2 fields kept
    assert config["output_video"] == str(folder / VIDEO) and config["stage3_decode_time"] > 0
    assert config["video_frames"] == 9 and config["vae_patch_parallel_ranks"] == 1
    assert sorted(os.listdir(folder)) == sorted([CONFIG, LATENTS, VIDEO])  # no temporaries
    # the video is the decode of these latents (H.264 keeps luma to ~40 dB on this noise-like clip)
    from sampling.stage_io import read_stage2
    latents, _, _ = read_stage2(str(folder))
    vae = build_tiny(VAES["hunyuanvideo-1.5-vae"], 4, seed=TINY_VAE_SEED)
    with torch.no_grad():
        expected = to_frames(vae.decode(to_vae_latents(vae, latents)).sample)
    assert luma_psnr(frames, expected) > 30


def test_torchrun_patch_parallel_writes_the_same_video(pipeline_run, tmp_path):
    folder, _, single = pipeline_run
    assert single.returncode == 0, single.stderr
    out = run_script("stage3_vae_decode.py", "--input_dir", str(folder), "--output_dir",
                     str(tmp_path), "--patch_parallel", "--grid", "2x1",
                     launcher=("-m", "torch.distributed.run", "--nproc_per_node", "2"))
    assert out.returncode == 0, out.stderr
    assert "on 2 rank(s), patch grid 2x1" in out.stdout
    config = json.loads((tmp_path / CONFIG).read_text())
    assert config["vae_patch_parallel_ranks"] == 2 and config["vae_patch_grid"] == [2, 1]
    parallel, _ = read_video(tmp_path / VIDEO)
    reference, _ = read_video(folder / VIDEO)
    assert parallel.shape == reference.shape
    # The two decodes differ by float rounding, a level at most in the frames; H.264 turns a
    # few of those into a few levels (seen: 80 of 138,240 values off by 2-3 once the stage-2
    # latents changed). A seam or halo bug moves whole rows by tens of levels.
    diff = np.abs(parallel.astype(int) - reference.astype(int))
    assert diff.max() <= 4 and (diff > 1).mean() < 1e-3, (diff.max(), (diff > 1).sum())


@pytest.mark.parametrize("model", ["wan-tiny-i2v", "wan-tiny-ti2v"])
def test_both_wan_vaes_decode_to_the_configured_size(tmp_path, model, capsys):
    """wan-tiny-i2v decodes with the Wan2.1 VAE (8x), wan-tiny-ti2v with the Wan2.2 VAE (16x,
    patchify 2)."""
    stage2_dir(tmp_path, model)
    assert main(["--input_dir", str(tmp_path), "--fps", "16"]) == 0
    assert spec_for(get_pipeline(model)).name in capsys.readouterr().out
    h, w, f = get_pipeline(model).size
    frames, meta = read_video(tmp_path / VIDEO)
    assert frames.shape == (f, h, w, 3) and meta["fps"] == 16.0


# --- errors: a clear message, exit 2, nothing written -----------------------------------------------

def _fails(argv, capsys, *patterns):
    assert main(argv) == 2
    err = capsys.readouterr().err
    for pattern in patterns:
        assert re.search(pattern, err), err
    return err


def test_missing_vae_checkpoint_stops_before_decoding(tmp_path, capsys):
    stage2_dir(tmp_path, "hunyuanvideo-tiny")
    before = snapshot(tmp_path)
    _fails(["--input_dir", str(tmp_path), "--vae_path", str(tmp_path / "nope.safetensors")], capsys,
           r"--vae_path .*nope\.safetensors does not exist", r"expected a diffusers VAE folder")
    assert snapshot(tmp_path) == before


def test_latents_of_the_wrong_channel_count_stop_with_the_expected_count(tmp_path, capsys):
    stage2_dir(tmp_path, "hunyuanvideo-tiny", channels=5)
    before = snapshot(tmp_path)
    _fails(["--input_dir", str(tmp_path)], capsys, r"latents have 5 channels",
           r"expects 4 \(shape \[1, 4, F, H, W\]\)")
    assert snapshot(tmp_path) == before


def test_a_vae_of_another_latent_width_is_refused(tmp_path, capsys):
    stage2_dir(tmp_path / "in", "wan-tiny-i2v")
    build_tiny(VAES["wan2.1-vae"], 16).save_pretrained(str(tmp_path / "vae16"))
    _fails(["--input_dir", str(tmp_path / "in"), "--vae_path", str(tmp_path / "vae16")], capsys,
           r"decodes 16 latent channels; the wan-tiny-i2v latents have 4")
    assert VIDEO not in os.listdir(tmp_path / "in")


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_unwritable_output_path_stops_before_decoding(tmp_path, capsys, where):
    stage2_dir(tmp_path / "in", "hunyuanvideo-tiny")
    (tmp_path / "taken").write_text("not a folder")
    target = tmp_path / "taken" if where == "a file" else tmp_path / "taken" / "sub"
    _fails(["--input_dir", str(tmp_path / "in"), "--output_dir", str(target)], capsys,
           r"--output_dir .*taken", r"expected a folder")
    assert sorted(os.listdir(tmp_path)) == ["in", "taken"]
    assert VIDEO not in os.listdir(tmp_path / "in")


def test_latents_that_contradict_the_config_are_refused(tmp_path, capsys):
    stage2_dir(tmp_path, "hunyuanvideo-tiny", height=128)
    _fails(["--input_dir", str(tmp_path)], capsys, r"decode to height 64; generation_config.json "
           r"says 128")


def test_flag_conflicts_are_refused(tmp_path, capsys):
    stage2_dir(tmp_path, "hunyuanvideo-tiny")
    _fails(["--input_dir", str(tmp_path), "--tiled", "--patch_parallel"], capsys,
           "alternatives")
    _fails(["--input_dir", str(tmp_path), "--tiled", "--tile_size", "40"], capsys,
           r"--tile_size 40: expected a multiple of the VAE's spatial stride 16")
    _fails(["--input_dir", str(tmp_path / "missing")], capsys, "is not a directory")
    _fails(["--input_dir", str(tmp_path), "--grid", "2x2"], capsys, "--grid needs --patch_parallel")


def test_several_ranks_without_patch_parallel_or_too_many_are_refused(tmp_path, capsys, monkeypatch):
    stage2_dir(tmp_path, "hunyuanvideo-tiny")  # latent 4x5
    monkeypatch.setenv("WORLD_SIZE", "2")
    _fails(["--input_dir", str(tmp_path)], capsys, "launched on 2 ranks without --patch_parallel")
    monkeypatch.setenv("WORLD_SIZE", "32")
    _fails(["--input_dir", str(tmp_path), "--patch_parallel"], capsys,
           r"32 ranks cannot split a 4x5 latent")
    assert VIDEO not in os.listdir(tmp_path)


def test_a_full_disk_while_encoding_says_so_and_leaves_the_previous_video_and_config(
        tmp_path, monkeypatch, capsys):
    stage2_dir(tmp_path, "hunyuanvideo-tiny")
    assert main(["--input_dir", str(tmp_path)]) == 0
    before = snapshot(tmp_path)
    real = imageio.get_writer

    def failing_writer(*args, **kwargs):
        writer = real(*args, **kwargs)
        calls = []

        def append(frame):
            calls.append(1)
            if len(calls) == 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            type(writer).append_data(writer, frame)
        writer.append_data = append
        return writer

    monkeypatch.setattr(imageio, "get_writer", failing_writer)
    capsys.readouterr()
    assert main(["--input_dir", str(tmp_path), "--fps", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could not write output_video.mp4" in err
    assert "No space left on device (the disk is full)" in err
    assert snapshot(tmp_path) == before  # old video and config intact, no temporary left


# --- checkpoints ---------------------------------------------------------------------------------

def test_a_diffusers_folder_loads_the_same_weights(tmp_path, capsys):
    spec = VAES["hunyuanvideo-1.5-vae"]
    tiny = build_tiny(spec, 4, seed=TINY_VAE_SEED)
    tiny.save_pretrained(str(tmp_path / "vae"))
    loaded = load_vae(spec, str(tmp_path / "vae"))
    assert all(torch.equal(a, b) for a, b in zip(tiny.state_dict().values(),
                                                  loaded.state_dict().values(), strict=True))
    stage2_dir(tmp_path / "in", "hunyuanvideo-tiny")
    assert main(["--input_dir", str(tmp_path / "in"), "--vae_path", str(tmp_path / "vae")]) == 0
    assert "hunyuanvideo-1.5-vae (" + str(tmp_path / "vae") in capsys.readouterr().out


def _hy_levels_to_official(side: str) -> list[tuple[str, str]]:
    """HunyuanVideo-1.5's official layout names the encoder's levels ("down") and the
    decoder's ("up") alike."""
    return [(rf"\.{side}_blocks\.(\d+)\.resnets\.(\d+)\.", rf".{side}.\1.block.\2."),
            (rf"\.{side}_blocks\.(\d+)\.{side}samplers\.0\.", rf".{side}.\1.{side}sample.")]


# diffusers -> official names, written from the official module layouts (the inverse of what
# modules.vae converts), to check the conversion on every key of a model.
_TO_OFFICIAL = {
    "wan2.2-vae": [
        (r"\.norm1\.", ".residual.0."), (r"\.conv1\.", ".residual.2."), (r"\.norm2\.", ".residual.3."),
        (r"\.conv2\.", ".residual.6."), (r"\.conv_shortcut\.", ".shortcut."),
        (r"^quant_conv\.", "conv1."), (r"^post_quant_conv\.", "conv2."), (r"\.conv_in\.", ".conv1."),
        (r"\.norm_out\.", ".head.0."), (r"\.conv_out\.", ".head.2."),
        (r"\.mid_block\.resnets\.0\.", ".middle.0."), (r"\.mid_block\.attentions\.0\.", ".middle.1."),
        (r"\.mid_block\.resnets\.1\.", ".middle.2."),
        (r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.", r"decoder.upsamples.\1.upsamples.\2."),
        (r"^decoder\.up_blocks\.(\d+)\.upsampler\.", r"decoder.upsamples.\1.upsamples.3."),
        (r"^encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.", r"encoder.downsamples.\1.downsamples.\2."),
        (r"^encoder\.down_blocks\.(\d+)\.downsampler\.", r"encoder.downsamples.\1.downsamples.2.")],
    "hunyuanvideo-1.5-vae": [
        *_hy_levels_to_official("down"), *_hy_levels_to_official("up"),
        (r"\.mid_block\.resnets\.0\.", ".mid.block_1."), (r"\.mid_block\.resnets\.1\.", ".mid.block_2."),
        (r"\.mid_block\.attentions\.0\.to_(q|k|v)\.", r".mid.attn_1.\1."),
        (r"\.mid_block\.attentions\.0\.", ".mid.attn_1.")],
}


def _official(state, spec):
    return rename_keys(state, _TO_OFFICIAL[spec.name])


@pytest.mark.parametrize("name", sorted(_TO_OFFICIAL))
def test_official_layout_keys_of_the_released_vaes_convert_to_diffusers(name):
    from diffusers import AutoencoderKLHunyuanVideo15, AutoencoderKLWan
    spec = VAES[name]
    cls = AutoencoderKLWan if spec.class_name == "AutoencoderKLWan" else AutoencoderKLHunyuanVideo15
    with torch.device("meta"):
        released = cls(**spec.config).state_dict()
    official = _official(released, spec)
    assert not any("mid_block" in k or "resnets" in k for k in official)  # really renamed
    assert set(to_diffusers_keys(spec, official)) == set(released)


@pytest.mark.parametrize("suffix, layout", [(".safetensors", "diffusers"), (".pth", "official")])
def test_a_single_file_loads_in_either_layout(tmp_path, suffix, layout):
    # single files carry no config: load_vae uses the spec's (here a tiny one, as a test stand-in)
    base = VAES["wan2.2-vae"]
    spec = dataclasses.replace(base, config=base.tiny_config(48))
    tiny = build_tiny(spec, 48, seed=5)
    state = tiny.state_dict() if layout == "diffusers" else _official(tiny.state_dict(), spec)
    path = str(tmp_path / f"vae{suffix}")
    if suffix == ".safetensors":
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in state.items()}, path)
    else:
        torch.save(state, path)
    loaded = load_vae(spec, path)
    assert all(torch.equal(tiny.state_dict()[k], v) for k, v in loaded.state_dict().items())


def test_a_checkpoint_of_another_vae_is_refused_by_name(tmp_path):
    tiny = build_tiny(VAES["hunyuanvideo-1.5-vae"], 32)
    torch.save(tiny.state_dict(), tmp_path / "hy.pth")
    with pytest.raises(VaeError, match=r"does not fit the wan2.2-vae: missing \d+ keys"):
        load_vae(VAES["wan2.2-vae"], str(tmp_path / "hy.pth"))
    torch.save({"weight": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(VaeError, match="neither diffusers nor official wan2.2-vae keys"):
        load_vae(VAES["wan2.2-vae"], str(tmp_path / "other.pth"))


# --- tiling, latents and frames ------------------------------------------------------------------

def test_tiled_decode_runs_diffusers_tiles_and_keeps_the_size(tmp_path, monkeypatch):
    from diffusers import AutoencoderKLHunyuanVideo15
    calls = []
    real = AutoencoderKLHunyuanVideo15.tiled_decode
    monkeypatch.setattr(AutoencoderKLHunyuanVideo15, "tiled_decode",
                        lambda self, z: calls.append(z.shape) or real(self, z))
    stage2_dir(tmp_path, "hunyuanvideo-tiny")
    assert main(["--input_dir", str(tmp_path), "--tiled", "--tile_size", "64"]) == 0
    assert calls, "the tiled path was not taken"
    frames, _ = read_video(tmp_path / VIDEO)
    assert frames.shape == (9, 64, 80, 3)
    assert json.loads((tmp_path / CONFIG).read_text())["vae_tiled"] is True


def test_latents_are_denormalised_as_the_diffusers_pipelines_do():
    from diffusers import AutoencoderKLWan
    wan = AutoencoderKLWan(base_dim=8, z_dim=2, num_res_blocks=1, latents_mean=[1.0, -2.0],
                           latents_std=[0.5, 4.0])
    z = torch.ones(1, 2, 1, 1, 1)
    assert to_vae_latents(wan, z).flatten().tolist() == [1.5, 2.0]  # z * std + mean
    hy = build_tiny(VAES["hunyuanvideo-1.5-vae"], 4)
    assert torch.allclose(to_vae_latents(hy, z[:, :1]), z[:, :1] / 1.03682)


def test_frames_map_minus_one_to_black_and_one_to_white():
    video = torch.tensor([-1.0, 0.0, 1.0, 2.0]).view(1, 1, 4, 1, 1).expand(1, 3, 4, 1, 1)
    frames = to_frames(video)
    assert frames.dtype == np.uint8 and frames.shape == (4, 1, 1, 3)
    assert frames[:, 0, 0, 0].tolist() == [0, 128, 255, 255]

"""Stage 3 on speech-to-video latents: stage 2 on the tiny S2V model, then one video of every
clip, each decoded with its motion history in front as the official WanS2V.generate does, on
torch and on JAX; the frame count, a hand-written per-clip oracle, JAX against torch, no compile
after the first clip, and stage files whose clip layout does not fit refused."""

from __future__ import annotations

import json
import os

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from commands import stage3
from modules.vae import VAES, build_tiny
from sampling.pipelines import get_pipeline
from sampling.stage_io import CONFIG, LATENTS, VIDEO, read_stage2_tensors, write_stage2

NAME = "wan-tiny-s2v"  # 64 x 64, 16-frame clips: 4 latent frames of 8 x 8 each
CLIP_FRAMES = 16
# the official rule (Wan2.2 wan/speech2video.py @ 42bf4cf, WanS2V.generate): motion_frames 73,
# so (73 + 3) // 4 = 19 latent frames of history; the VAE's temporal stride is 4
HISTORY = 19
STRIDE = 4
FP32_ATOL = 1e-4  # tests/test_stage3_jax.py's tolerance for the JAX decode of a Wan VAE


@pytest.fixture
def one_thread():
    """The tiny VAE's convolutions on one thread: on 2 shared cores, two threads are several
    times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _stage1(folder, clips, motion_frames=None):
    pipe = get_pipeline(NAME)
    shape = pipe.latent_shape(*pipe.size)
    tensors = pipe.synthesize(shape, True, False, seed=3)
    tensors["audio_embeds"] = tensors["audio_embeds"][..., : CLIP_FRAMES * clips]
    if motion_frames:  # a history shorter than 19 latent frames: zeros in front of it
        tensors["motion_latents"] = torch.randn(1, 16, motion_frames, 8, 8,
                                                generator=torch.Generator().manual_seed(5))
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(folder / "stage1_embeddings.safetensors"))
    (folder / CONFIG).write_text(json.dumps({"model": NAME}))
    return tensors


@pytest.fixture(scope="module")
def stage2_runs(tmp_path_factory):
    """name -> (stage-2 folder, stage-1 tensors, clips): 2 clips without a motion history (the
    official drop_first_motion), 2 clips continuing a given 5-frame history. (Every clip after
    the first decodes 19 + 4 latent frames: two clips per run keep the tests short.)"""
    from commands.stage2 import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs = {}
    try:
        for name, clips, motion in (("dropped", 2, None), ("history", 2, 5)):
            work = tmp_path_factory.mktemp(name)
            tensors = _stage1(work / "in", clips, motion)
            assert main(["--model", NAME, "--input_dir", str(work / "in"), "--output_dir",
                         str(work / "D"), "--num_inference_steps", "2", "--backend", "torch",
                         "--no_progress"]) == 0
            runs[name] = (work / "D", tensors, clips)
    finally:
        torch.set_num_threads(threads)
    return runs


def _vae():
    return build_tiny(VAES["wan2.1-vae"], 16, seed=stage3.TINY_VAE_SEED)


def official_clips(vae, latents, clips, ref_latents, motion_latents=None):
    """Per clip (decode latents, its float video), written out from WanS2V.generate: decode
    [motion | clip] (the first clip without a history: [ref | clip]), keep the last
    infer_frames frames, and 3 fewer on a first clip without a history; the next history is
    the last 19 latent frames of [history | clip], zeros in front of a shorter one."""
    frames = latents.shape[2] // clips
    infer_frames = STRIDE * frames
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)

    def last_history(x):
        x = x[:, :, -HISTORY:]
        return torch.cat([torch.zeros(1, 16, HISTORY - x.shape[2], 8, 8), x], dim=2)

    motion = None if motion_latents is None else last_history(motion_latents)
    out = []
    for r in range(clips):
        x = latents[:, :, r * frames: (r + 1) * frames].float()
        drop = r == 0 and motion is None
        decode_latents = torch.cat([ref_latents if drop else motion, x], dim=2)
        with torch.no_grad():
            image = vae.decode(decode_latents * std + mean).sample
        image = image[:, :, -infer_frames:]
        if drop:
            image = image[:, :, 3:]
        out.append((decode_latents, image))
        motion = last_history(x if motion is None else torch.cat([motion, x], dim=2))
    return out


def _frames(video):
    return ((video[0] / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()


@pytest.fixture(scope="module")
def oracle(stage2_runs):
    """name -> the official per-clip decodes of that stage-2 run's latents (torch, fp32)."""
    vae, out = _vae(), {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, (folder, tensors, clips) in stage2_runs.items():
            latents = read_stage2_tensors(str(folder))[0]["latents"]
            out[name] = official_clips(vae, latents, clips, tensors["ref_latents"],
                                       tensors.get("motion_latents"))
    finally:
        torch.set_num_threads(threads)
    return out


def _decode(folder, backend, monkeypatch, out_dir):
    """Stage 3 in this process; returns the uint8 frames it handed the mp4 writer."""
    written = []
    real = stage3.write_video

    def spy(directory, frames, fps, config, **kw):
        written.append(frames.copy())
        return real(directory, frames, fps, config, **kw)

    monkeypatch.setattr(stage3, "write_video", spy)
    assert stage3.main(["--input_dir", str(folder), "--output_dir", str(out_dir), "--backend",
                        backend]) == 0
    assert len(written) == 1
    return written[0]


@pytest.mark.parametrize("name", ["dropped", "history"])
def test_torch_video_is_every_clip_decoded_after_its_history(name, stage2_runs, oracle, tmp_path,
                                                             monkeypatch, one_thread):
    folder, _, clips = stage2_runs[name]
    frames = _decode(folder, "torch", monkeypatch, tmp_path)
    # the official count: every clip's infer_frames, 3 fewer for a first clip without history
    expected = clips * CLIP_FRAMES - (3 if name == "dropped" else 0)
    video = iio.imread(tmp_path / VIDEO, plugin="FFMPEG")
    assert video.shape == frames.shape == (expected, 64, 64, 3)
    config = json.loads((tmp_path / CONFIG).read_text())
    assert config["video_frames"] == expected and config["video_length"] == CLIP_FRAMES
    assert config["num_clips"] == clips
    assert config["motion_history_given"] == (name == "history")
    # each clip is the hand-written official decode of its [history | clip], sliced by hand
    hand = np.concatenate([_frames(image) for _, image in oracle[name]])
    np.testing.assert_array_equal(frames, hand)


def test_jax_video_equals_torch_and_later_clips_compile_nothing(stage2_runs, oracle, tmp_path,
                                                                monkeypatch, capsys, one_thread):
    from tpu.compile import compile_counts
    from tpu.vae import JaxVaeDecoder

    decodes = []  # (latent shape, programs lowered during the call, video)
    real = JaxVaeDecoder.decode

    def counted(self, z):
        before = compile_counts().lowered
        video = real(self, z)
        decodes.append((tuple(z.shape), compile_counts().lowered - before, video))
        return video

    monkeypatch.setattr(JaxVaeDecoder, "decode", counted)
    folder, _, clips = stage2_runs["dropped"]
    frames = _decode(folder, "jax", monkeypatch, tmp_path)
    assert "loop compiles 0" in capsys.readouterr().out
    expected = oracle["dropped"]
    assert [d[0] for d in decodes] == [tuple(z.shape) for z, _ in expected]
    assert [d[0][2] for d in decodes] == [1 + 4, HISTORY + 4]
    # the first clip's programs serve the later, longer window: nothing compiles after it
    # (nor during it: stage 3 compiles before its decode loop)
    assert [d[1] for d in decodes] == [0] * clips
    for (_, _, video), (_, image) in zip(decodes, expected, strict=True):
        np.testing.assert_allclose(video[:, :, -image.shape[2]:], image.numpy(), rtol=0,
                                   atol=FP32_ATOL)
    hand = np.concatenate([_frames(image) for _, image in expected])
    assert frames.shape == hand.shape == (clips * CLIP_FRAMES - 3, 64, 64, 3)
    # within 1e-4 of the torch decode: a frame value rounds to the same level or the next one
    assert np.abs(frames.astype(int) - hand.astype(int)).max() <= 1
    assert json.loads((tmp_path / CONFIG).read_text())["vae_backend"] == "jax"


def _rewrite(folder, out, latents=None, drop_meta=(), drop_tensors=(), **meta):
    tensors, metadata, config = read_stage2_tensors(str(folder))
    extra = {k: v for k, v in tensors.items() if k != "latents" and k not in drop_tensors}
    metadata = {k: v for k, v in metadata.items() if k not in drop_meta and k != "stage2_pair_id"}
    config = {k: v for k, v in config.items() if k != "stage2_pair_id"}
    write_stage2(str(out), tensors["latents"] if latents is None else latents,
                 {**metadata, **meta}, config, extra=extra)


@pytest.mark.parametrize("case, change, message", [
    ("clips", dict(num_clips=3), "latents have 8 latent frames; its metadata records 3 clips of 4"),
    ("frames", dict(clip_latent_frames=3), "records 2 clips of 3 (6)"),
    ("ref", dict(drop_tensors=("ref_latents",)), "lacks ref_latents"),
    ("motion", dict(motion_history_given=True), "lacks motion_latents"),
    ("layout", dict(drop_meta=("clip_latent_frames", "motion_history_given")),
     "records no clip_latent_frames, motion_history_given"),
])
def test_a_clip_layout_that_does_not_fit_is_refused_with_nothing_written(
        stage2_runs, tmp_path, capsys, case, change, message):
    folder, _, _ = stage2_runs["dropped"]
    bad = tmp_path / case
    _rewrite(folder, bad, **change)
    before = sorted(os.listdir(bad))
    assert stage3.main(["--input_dir", str(bad), "--backend", "torch"]) == 2
    assert message in capsys.readouterr().err
    assert sorted(os.listdir(bad)) == before and not (bad / VIDEO).exists()
    assert LATENTS in before

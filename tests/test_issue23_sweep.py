"""Issue 23's sweep of bad inputs, as a table: each case exits 2 with one line naming what was
wrong and what was expected, writes nothing and leaves the inputs as they were; none exits 0 with
a wrong result. (Tampered checkpoints: test_checkpoint_strict.py; tampered profiles:
test_profile_validation.py; platforms, devices and commands.aot: test_platform_refusals.py; kill -9:
test_kill_points.py.)"""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest
import torch

import stage2_transformer_flax_deepcache as stage2_script
import stage3_vae_decode as stage3
from commands import stage2
from sampling import clips
from sampling.pipelines import get_pipeline
from sampling.stage_io import CONFIG, EMBEDDINGS, LATENTS, read_stage2, write_stage
from tests.test_refusals import refused, snapshot

FAST = ["--backend", "torch", "--num_inference_steps", "2", "--no_progress",
        "--compile_cache_dir", "none"]
LONG = "a" * 300


def stage1(folder, name, mutate=None):
    pipe = get_pipeline(name)
    tensors = pipe.synthesize(pipe.latent_shape(*pipe.size), True, False, seed=5)
    if mutate:
        mutate(tensors)
    write_stage(str(folder), tensors, EMBEDDINGS, {}, {"model": name})
    return str(folder)


def zero(key):
    return lambda t: t[key].zero_()


def huge(key):
    return lambda t: t[key].fill_(3e38)


def longer(key, by):
    return lambda t: t.update({key: torch.cat([t[key]] * by, dim=1)})


# (case, argv builder(tmp) -> argv, message) ; "IN" is a stage-1 folder the builder made
CASES = [
    ("guidance 1e39", lambda tmp: ["--guidance_scale", "1e39"],
     "--guidance_scale 1e+39: expected a number in [0, 100]"),
    ("all-zero prompt mask", lambda tmp: ["--input_dir", stage1(tmp / "in", "hunyuanvideo-tiny",
                                                                 zero("prompt_embeds_mask"))],
     "prompt_embeds_mask marks no valid token"),
    ("all-zero negative mask", lambda tmp: ["--input_dir", stage1(
        tmp / "in", "hunyuanvideo-tiny", zero("negative_prompt_embeds_mask"))],
     "negative_prompt_embeds_mask marks no valid token"),
    ("embeddings 3e38", lambda tmp: ["--input_dir", stage1(tmp / "in", "hunyuanvideo-tiny",
                                                            huge("prompt_embeds"))],
     "prompt_embeds holds values up to 3e+38; expected |x| <= 1e+06"),
    ("Wan text longer than text_len", lambda tmp: ["--input_dir", stage1(
        tmp / "in", "wan-tiny-ti2v", longer("prompt_embeds", 4))],
     f"{EMBEDDINGS}: prompt_embeds has 32 entries along dim 1"),
    ("telemetry onto the stage-1 input", lambda tmp: [
        "--input_dir", stage1(tmp / "in", "wan-tiny-ti2v"), "--output_dir", str(tmp / "out"),
        "--telemetry_json", str(tmp / "in" / EMBEDDINGS)],
     f"would overwrite --input_dir {EMBEDDINGS}"),
    ("telemetry onto the stage-1 config", lambda tmp: [
        "--input_dir", stage1(tmp / "in", "wan-tiny-ti2v"), "--output_dir", str(tmp / "out"),
        "--plot_png", str(tmp / "in" / CONFIG)],
     f"would overwrite --input_dir {CONFIG}"),
    ("csv onto the latents", lambda tmp: ["--output_dir", _made(tmp / "out"), "--telemetry_csv",
                                          str(tmp / "out" / LATENTS)],
     f"the run writes its {LATENTS} (--output_dir) there too"),
    ("two reports at one path", lambda tmp: ["--telemetry_csv", str(tmp / "t"),
                                             "--telemetry_json", str(tmp / "t")],
     "the run writes --telemetry_json there too"),
    ("a 300-character output_dir", lambda tmp: ["--output_dir", str(tmp / LONG)],
     "a name of 300 bytes"),
    ("an output_dir over PATH_MAX", lambda tmp: ["--output_dir", str(tmp / "/".join(["d" * 200] * 21))],
     "(PATH_MAX 4096)"),
    ("an output_dir through a symlink loop", lambda tmp: [
        "--output_dir", str(_loop(tmp) / "x")], "is a loop of symbolic links"),
    ("a 300-character telemetry_json", lambda tmp: ["--telemetry_json", str(tmp / LONG)],
     "--telemetry_json"),
    ("a billion steps", lambda tmp: ["--num_inference_steps", "1000000000"],
     "--num_inference_steps 1000000000: expected an integer in [1, 1000]"),
    ("two million rows", lambda tmp: ["--height", "32000000"],
     "tokens per model call"),
    ("S2V frames", lambda tmp: ["--model", "wan-tiny-s2v", "--video_length", "17"],
     "--video_length 17: expected a multiple of 4 frames"),
    ("S2V height", lambda tmp: ["--model", "wan-tiny-s2v", "--height", "60"],
     "--height 60: expected a positive multiple of 64"),
    ("a config that is not UTF-8", lambda tmp: ["--input_dir", _config(tmp, b"\xff\xfe{}")],
     f"{CONFIG} is not UTF-8 text"),
    ("a config nested 100k deep", lambda tmp: ["--input_dir", _config(
        tmp, b"[" * 100_000 + b"]" * 100_000)], f"{CONFIG} is JSON nested too deeply"),
]


def _config(tmp, data: bytes) -> str:
    (tmp / "in").mkdir()
    (tmp / "in" / CONFIG).write_bytes(data)
    return str(tmp / "in")


def _made(folder):
    folder.mkdir()
    return str(folder)


def _loop(tmp):
    os.symlink(tmp / "b", tmp / "a")
    os.symlink(tmp / "a", tmp / "b")
    return tmp / "a"


@pytest.mark.parametrize("case, build, message", CASES, ids=[c[0] for c in CASES])
def test_stage2_refuses_before_any_work(tmp_path, monkeypatch, capsys, case, build, message):
    monkeypatch.chdir(tmp_path)
    argv = build(tmp_path)
    before = snapshot(tmp_path)
    refused(stage2_script.main, [*FAST, *argv], capsys, message)
    assert snapshot(tmp_path) == before  # nothing written, every input as it was


def test_a_size_whose_attention_does_not_fit_the_host_is_refused_before_compiling(
        tmp_path, monkeypatch, capsys):
    """JAX on the CPU holds every attention score: 2 heads x 937,500^2 tokens is terabytes."""
    monkeypatch.chdir(tmp_path)
    refused(stage2_script.main, ["--model", "hunyuanvideo-tiny", "--height", "999984",
                                 "--num_inference_steps", "2", "--compile_cache_dir", "none"], capsys,
            "--height 999984", "on the host CPU", "expected a smaller size")
    assert os.listdir(tmp_path) == []


def test_latents_that_come_out_non_finite_are_an_error_and_keep_the_previous_pair(
        tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert stage2_script.main([*FAST, "--output_dir", str(out)]) == 0
    before = snapshot(out)
    real = stage2.load_models

    def overflowing(*args, **kwargs):  # finite weights whose products overflow fp32
        models = real(*args, **kwargs)
        with torch.no_grad():
            for model in models.values():
                for p in model.parameters():
                    p.fill_(1e30)
        return models
    monkeypatch.setattr(stage2, "load_models", overflowing)
    refused(stage2_script.main, [*FAST, "--output_dir", str(out), "--seed", "3"], capsys,
            "sampling gave non-finite latents", "nothing was written")
    assert snapshot(out) == before


def test_stage2_into_a_decoded_folder_drops_the_old_video_fields(tmp_path):
    out = tmp_path / "out"
    stage1(out, "hunyuanvideo-tiny")
    assert stage2_script.main([*FAST, "--input_dir", str(out)]) == 0
    assert stage3.main(["--input_dir", str(out)]) == 0
    assert "output_video" in json.loads((out / CONFIG).read_text())
    assert stage2_script.main([*FAST, "--input_dir", str(out), "--seed", "4"]) == 0
    config = json.loads((out / CONFIG).read_text())
    assert "output_video" not in config and "stage3_decode_time" not in config
    assert config["fps"] is not None  # a setting, kept


def test_the_last_seed_samples_every_s2v_clip(tmp_path, monkeypatch):
    """Clip c starts from the noise of seed + c (sampling/clips.py, as the official code): from
    the last seed, 2^64 - 1, the second clip's seed passes torch's range and wraps, as a 64-bit
    counter does, to (2^64 - 1 + 1) mod 2^64 = 0. Each clip's loop starts from that noise."""
    started = []
    sample_once = clips.sample_once

    def recorded(backend, config, sample, **kw):
        started.append(sample.noise.clone())  # the torch backend's noise is a host tensor
        return sample_once(backend, config, sample, **kw)

    monkeypatch.setattr(clips, "sample_once", recorded)
    assert stage2_script.main([*FAST, "--model", "wan-tiny-s2v", "--seed", str(2 ** 64 - 1),
                               "--num_clips", "2", "--output_dir", str(tmp_path)]) == 0
    pipe = get_pipeline("wan-tiny-s2v")
    shape = pipe.latent_shape(*pipe.size)
    wrapped = [torch.randn(shape, generator=torch.Generator().manual_seed(seed))
               for seed in (2 ** 64 - 1, 0)]
    assert len(started) == 2 and not torch.equal(*wrapped)
    for clip, (noise, want) in enumerate(zip(started, wrapped, strict=True)):
        assert torch.equal(noise, want), clip
    latents = read_stage2(str(tmp_path))[0]
    assert latents.shape[2] == 2 * shape[2] and torch.isfinite(latents).all()


def test_stage2_latents_get_the_usual_file_mode(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    assert stage2_script.main([*FAST, "--output_dir", str(tmp_path)]) == 0
    for name in (LATENTS, CONFIG):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o666 & ~umask


def _latents_dir(folder, latents):
    from sampling.stage_io import write_stage2
    pipe = get_pipeline("hunyuanvideo-tiny")
    write_stage2(str(folder), latents, {"model": pipe.name}, {"model": pipe.name})


@pytest.mark.parametrize("argv, shape, message", [
    (["--fps", "1e-300"], None, "--fps 1e-300: expected a finite number >= 0.1 and <= 1000"),
    (["--fps", "1e12"], None, "--fps 1000000000000.0: expected a finite number >= 0.1 and <= 1000"),
    ([], (1, 4, 0, 4, 5), "expected at least one latent frame"),
    ([], (1, 4, 3, 0, 5), "expected at least one latent frame"),
])
def test_stage3_refuses_before_decoding(tmp_path, capsys, argv, shape, message):
    _latents_dir(tmp_path, torch.randn(shape or (1, 4, 3, 4, 5)))
    before = snapshot(tmp_path)
    refused(stage3.main, ["--input_dir", str(tmp_path), *argv], capsys, message)
    assert snapshot(tmp_path) == before


def test_a_full_disk_under_tensorboard_is_one_line_and_leaves_no_events_file(
        tmp_path, capsys, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import record_writer

    def full(self, data):  # runs in tensorboard's writer thread
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    (tmp_path / "tb").mkdir()
    refused(stage2_script.main, [*FAST, "--output_dir", str(tmp_path / "out"),
                                 "--tensorboard_dir", str(tmp_path / "tb")], capsys,
            "--tensorboard_dir", "the disk is full", "nothing was written")
    assert os.listdir(tmp_path / "tb") == [] and not (tmp_path / "out" / LATENTS).exists()


def test_empty_compile_cache_entries_are_removed(tmp_path):
    from tpu.compile import remove_empty_entries
    (tmp_path / "jit_a-cache").write_bytes(b"")
    (tmp_path / "jit_b-cache").write_bytes(b"program")
    assert remove_empty_entries(str(tmp_path)) == 1
    assert os.listdir(tmp_path) == ["jit_b-cache"]

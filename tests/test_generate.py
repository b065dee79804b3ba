"""Prompt to mp4 (issues 25 and 28): the stage-1 command and the one-process generate command on
the built-in trained tiny model, the README's first example as a user runs it, several prompts on
programs compiled once, and bad input refused before any model work."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

import generate
import stage1_encode
from bench.fixtures.analyser import analyse
from commands import generate as generate_cmd
from sampling.pipelines import DEFAULT_PIPELINE, get_pipeline
from sampling.stage_io import CONFIG, EMBEDDINGS, LATENTS, VIDEO, read_stage1
from tests.test_refusals import listing, refused
from tests.test_stage3 import read_video, run_script

README_PROMPT = "red circle moves right on blue"
PIPE = get_pipeline(DEFAULT_PIPELINE)
# the fixtures' name of its latent mapping (bench/fixtures/videos.py)
PIPE_MAPPING = {"pixel-anchored": "anchored", "pixel-deltas": "deltas"}.get(PIPE.latent, "pixels")


def shown(path):
    """What the analyser reads in an mp4 of the trained model: the clip at its sampled size
    (stage 3 writes it `Pipeline.enlarge` times larger; block means undo that)."""
    frames, _ = read_video(path)
    k = PIPE.enlarge
    f, h, w, _ = frames.shape
    return frames.reshape(f, h // k, k, w // k, k, 3).mean((2, 4)) / 255.0


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """The README's first command, as a user runs it on a fresh clone."""
    work = tmp_path_factory.mktemp("readme")
    out = run_script("generate.py", "--prompt", README_PROMPT, "--enable_cache", cwd=work)
    return work, out


def test_the_readme_prompt_becomes_a_video_that_shows_it(readme_run):
    work, out = readme_run
    assert out.returncode == 0, out.stderr
    video = work / "outputs" / VIDEO
    assert str(video.relative_to(work)) in out.stdout
    seen = analyse(shown(video))
    assert (seen["foreground"], seen["background"], seen["direction"]) == ("red", "blue", "right"), seen
    config = json.loads((work / "outputs" / CONFIG).read_text())
    assert config["model"] == DEFAULT_PIPELINE and config["prompt"] == README_PROMPT
    assert config["cache_enabled"] and config["cache_modes"]  # --enable_cache reached stage 2
    assert config["vae_backend"] == "jax"  # stage 3's default backend, as stage 2's
    assert sorted(os.listdir(work / "outputs")) == sorted([CONFIG, EMBEDDINGS, LATENTS, VIDEO])


def test_three_prompts_compile_the_stage2_programs_once(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# colours and directions\n"
                       "green square moves down on black\n\n"
                       '{"prompt": "yellow triangle moves left on magenta", "seed": 3}\n'
                       "white circle moves up on red\n")
    args = generate_cmd.build_parser().parse_args(
        ["--prompts", str(prompts), "--enable_cache", "--compare", "--output_dir",
         str(tmp_path / "out")])
    report = generate_cmd.run(args)
    assert [Path(v).parent.name for v in report["videos"]] == ["001", "002", "003"]
    first, *rest = report["stage2"]
    assert first["compiles"]["warmup"]["lowered"] > 0  # the first prompt compiles ...
    assert [r["compiles"]["warmup"]["lowered"] for r in rest] == [0, 0]  # ... the others reuse
    assert all(r["compiles"]["loop"]["lowered"] == 0 for r in report["stage2"])
    seeds = [json.loads((tmp_path / "out" / d / CONFIG).read_text())["seed"]
             for d in ("001", "002", "003")]
    assert seeds == [42, 3, 44]  # the base seed + the line's index, unless the line gives one
    directions = 0
    for folder, asked in (("001", ("green", "black", "down")),
                          ("002", ("yellow", "magenta", "left")), ("003", ("white", "red", "up"))):
        seen = analyse(shown(tmp_path / "out" / folder / VIDEO))
        assert (seen["foreground"], seen["background"]) == asked[:2], (folder, seen)
        directions += seen["direction"] == asked[2]
    # the model follows the direction on all 168 held-out prompts of its card
    assert directions == 3
    # --compare: the uncached video beside the cached one, and a strip of both
    for folder, sampled in zip(("001", "002", "003"), report["stage2"], strict=True):
        uncached = read_video(tmp_path / "out" / folder / generate_cmd.UNCACHED_VIDEO)[0]
        cached = read_video(tmp_path / "out" / folder / VIDEO)[0]
        assert uncached.shape == cached.shape
        from PIL import Image
        strip = np.asarray(Image.open(tmp_path / "out" / folder / generate_cmd.STRIP))
        f, h, w, _ = cached.shape
        assert strip.shape[1] == f * w and strip.shape[0] > 2 * h
        # the strip's rows are the two videos (up to the mp4's compression)
        assert np.abs(strip[:h].astype(int) - np.concatenate(list(cached), 1)).mean() < 8
        assert np.abs(strip[-h:].astype(int) - np.concatenate(list(uncached), 1)).mean() < 8
        # the speedup is this prompt's uncached loop over its cached one, and that loop compiled
        # nothing (a compile in it would be counted as uncached time)
        cmp = sampled["compare"]
        assert cmp["speedup"] == cmp["uncached_loop_seconds"] / sampled["time"]["loop_seconds"]
        assert cmp["loop_compiles_uncached"]["lowered"] == 0, (folder, cmp)


def test_compare_into_a_relative_output_dir(tmp_path, monkeypatch, capsys):
    """--compare with a relative --output_dir, as a user types it: the stage folder's journal
    names the report folder in full and the stage folder relatively; both are one place. The
    console shows the measured speedup and PSNR, not the estimate alone (issue 62)."""
    monkeypatch.chdir(tmp_path)
    args = generate_cmd.build_parser().parse_args(
        ["--prompt", README_PROMPT, "--enable_cache", "--compare", "--output_dir", "videos"])
    report = generate_cmd.run(args)
    err = capsys.readouterr().err
    # each stage says when it starts, not only when it ends (issue 62)
    lines = err.splitlines()
    starts = [k for k, line in enumerate(lines) if "stage 1 encoding" in line]
    assert starts and "stage 1 " in lines[starts[0] + 1]
    assert any("stage 3 decoding into videos ..." in line for line in lines)
    measured = report["stage2"][0]["compare"]["speedup"]
    assert f"speedup {measured:.2f}x measured against uncached (estimated " in err
    assert "dB" in err.split("measured against uncached")[1].split("\n")[0]
    for name in (VIDEO, generate_cmd.UNCACHED_VIDEO, generate_cmd.STRIP):
        assert (tmp_path / "videos" / name).is_file(), name
    assert not [p.name for p in (tmp_path / "videos").iterdir() if p.name.startswith(".")]


def test_the_console_speedup_is_the_measured_one_where_compare_ran():
    r = {"speedup": {"estimated": 1.26, "schedule_ideal": 1.46}}
    assert generate_cmd.speedup_text(r) == "speedup 1.26x estimated (schedule ideal 1.46x)"
    r["compare"] = {"speedup": 0.95, "psnr_db": 38.24}
    assert generate_cmd.speedup_text(r) == ("speedup 0.95x measured against uncached (estimated "
                                            "1.26x, schedule ideal 1.46x), PSNR 38.2 dB")


def test_stage1_writes_what_stage2_reads(tmp_path):
    assert stage1_encode.main(["--prompt", "A blue square moves up on white.",
                               "--output_dir", str(tmp_path)]) == 0
    tensors, config = read_stage1(str(tmp_path), PIPE.stage1_specs(
        PIPE.latent_shape(*PIPE.size), cfg_on=True, image=False))
    assert config["model"] == PIPE.name
    assert (config["height"], config["width"], config["video_length"]) == PIPE.size
    # the articles and the full stop are dropped: the same words as the trained prompt
    from encoders.word_table import FOLDER, WordTable
    table = WordTable.load(os.path.join(PIPE.builtin_path, FOLDER))
    assert np.array_equal(tensors["prompt_embeds"][0].numpy(),
                          table.encode("blue square moves up on white"))
    assert not tensors["negative_prompt_embeds"].any()  # the empty prompt of CFG training


def test_a_real_model_on_random_encoders_says_so(tmp_path, capsys):
    """Issue 62: `--model wan2.2-ti2v-5b` without --encoder_path encoded with tiny random
    encoders in silence; now only with --random_encoders, and the summary says so."""
    assert stage1_encode.main(["--model", "wan2.2-ti2v-5b", "--prompt", "a cat on a sofa",
                               "--random_encoders", "--output_dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "encoders: TINY RANDOM (--random_encoders, no --encoder_path)" in out
    assert stage1_encode.main(["--model", "wan2.2-ti2v-5b", "--prompt", "a cat on a sofa",
                               "--output_dir", str(tmp_path / "no")]) == 2
    assert "--random_encoders to mean it" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def test_stage1_tiny_random_encoders_feed_stage2(tmp_path):
    """The tiny random pipelines' stage 1 goes through the real encoders' code (no hub)."""
    from commands import stage2
    for model in ("wan-tiny-ti2v", "hunyuanvideo-tiny"):
        folder = tmp_path / model
        assert stage1_encode.main(["--model", model, "--prompt", "a cat on a sofa",
                                   "--output_dir", str(folder)]) == 0
        assert stage2.main(["--input_dir", str(folder), "--num_inference_steps", "2",
                            "--backend", "torch", "--no_progress"]) == 0
        assert json.loads((folder / CONFIG).read_text())["model"] == model


def _prompts(tmp_path, text):
    path = tmp_path / "p.txt"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("lines, needles", [
    ('{"prompt": "red circle moves right on blue"\n', ("line 1: not valid JSON",)),
    ('red circle moves right on blue\n{"prompt": "x", "colour": 1}\n', ("line 2: unknown key colour",)),
    ('{"prompt": ""}\n', ('line 1: no "prompt" text',)),
    ('{"prompt": "red circle", "seed": -1}\n', ('line 1: "seed" -1',)),
    ("# only a comment\n\n", ("holds no prompt",)),
    ("purple circle moves right on blue\n", ("p.txt line 1: 'purple circle", "unknown word purple",
                                             "expected words")),
    # a 20,000-word line: the file and line named, the prompt quoted in part (issue 62)
    ("red circle moves right on blue\n\n" + "red " * 20000 + "\n",
     ("p.txt line 3: 'red red", "... (79,999 characters) has 20000 words", "at most 16")),
    ('{"prompt": "red circle moves right on blue", "negative_prompt": "purple"}\n',
     ('line 1 "negative_prompt": \'purple\' has unknown word purple',)),
    ('{"prompt": "red circle moves right on blue", "image": "/no/such.png"}\n',
     ("--image", "/no/such.png does not exist")),
    ('{"prompt": "red circle moves right on blue", "audio": "/no/such.wav"}\n',
     ("--audio", "expected no audio")),
])
def test_a_bad_prompt_file_is_refused_before_any_model_work(tmp_path, capsys, lines, needles):
    out = tmp_path / "out"
    refused(generate.main, ["--prompts", _prompts(tmp_path, lines), "--output_dir", str(out)],
            capsys, *needles)
    assert not out.exists()


@pytest.mark.parametrize("argv, needles", [
    ([], ("give --prompt TEXT or --prompts FILE",)),
    (["--prompt", "red circle", "--prompts", "x.txt"], ("one of them",)),
    (["--prompts", "/no/such/prompts.txt"], ("/no/such/prompts.txt does not exist",)),
    (["--prompt", "red circle moves right on blue", "--image", "/no/img.png"], ("/no/img.png",)),
    (["--prompt", "red circle moves right on blue", "--height", "32"], ("--height: 32", "expected 16")),
    (["--prompt", "red circle moves right on blue", "--num_inference_steps", "0"],
     ("--num_inference_steps 0",)),
    (["--prompt", "red circle moves right on blue", "--fps", "0"], ("--fps 0",)),
    (["--prompt", "red circle moves right on blue", "--encoder_path", "/no/enc"],
     ("--encoder_path /no/enc",)),
    (["--prompt", "red circle moves right on blue", "--input_dir", "."], ("--input_dir",)),
    # before stage 1 runs, not after it (issue 62: minutes with real encoders)
    (["--prompt", "a cat walks", "--model", "wan2.2-ti2v-5b", "--model_path", "/no/such/ckpt",
      "--random_encoders"], ("--model_path /no/such/ckpt does not exist",)),
    # a real model without its encoders: refused unless random encoders are asked for (issue 62)
    (["--prompt", "a cat walks", "--model", "wan2.2-ti2v-5b", "--model_path", "."],
     ("--encoder_path: not given; wan2.2-ti2v-5b would encode the prompt with tiny random "
      "encoders and its video would be noise", "--random_encoders to mean it")),
    (["--prompt", "a man speaks", "--model", "wan-tiny-s2v"], ("--image: not given", "wan-tiny-s2v")),
])
def test_bad_flags_are_refused_before_any_model_work(tmp_path, capsys, argv, needles):
    out = tmp_path / "out"
    refused(generate.main, [*argv, "--output_dir", str(out)], capsys, *needles)
    assert not out.exists()


def test_a_picture_that_is_no_image_is_refused_by_stage1(tmp_path, capsys):
    bad = tmp_path / "first.png"
    bad.write_bytes(b"not a png")
    out = tmp_path / "out"
    refused(stage1_encode.main, ["--prompt", README_PROMPT, "--image", str(bad),
                                 "--output_dir", str(out)], capsys, "--image", "cannot be read")
    assert listing(tmp_path) == ["first.png"]


def test_the_trained_hunyuanvideo_twin_makes_a_video(tmp_path):
    """HunyuanVideo-1.5's trained tiny model (assets/tiny-hunyuanvideo15) through the same
    commands: the word table writes its masks as the fixture trainer fed them, the latent's
    position anchor comes off in stage 3, and the video shows the prompted colours and direction."""
    pipe = get_pipeline("hunyuanvideo-tiny-trained")
    args = generate_cmd.build_parser().parse_args(
        ["--model", pipe.name, "--prompt", README_PROMPT, "--enable_cache",
         "--output_dir", str(tmp_path)])
    generate_cmd.run(args)
    tensors, _ = read_stage1(str(tmp_path), pipe.stage1_specs(
        pipe.latent_shape(*pipe.size), cfg_on=True, image=False))
    words = len(README_PROMPT.split())
    assert tensors["prompt_embeds_mask"][0].tolist() == [1] * words + [0] * (16 - words)
    assert tensors["negative_prompt_embeds_mask"][0].tolist() == [1] + [0] * 15  # first always
    assert not tensors["prompt_embeds_mask_2"].any() and not tensors["prompt_embeds_2"].any()
    frames, _ = read_video(tmp_path / VIDEO)
    k = pipe.enlarge
    f, h, w, _ = frames.shape
    shown_clip = frames.reshape(f, h // k, k, w // k, k, 3).mean((2, 4)) / 255.0
    seen = analyse(shown_clip)
    # the twin follows colours and direction on all held-out prompts of its card
    assert (seen["foreground"], seen["background"], seen["direction"]) == ("red", "blue", "right")
    # the video is the latent with the anchor taken off (the fixtures' own inverse), up to the
    # mp4's compression; the anchor's ramps reach 1, half the colour range
    from bench.fixtures import videos as V
    from sampling.stage_io import read_stage2
    latents, _, _ = read_stage2(str(tmp_path))
    assert np.abs(shown_clip - V.from_latent(latents[0].numpy(), "anchored")).mean() < 0.03


def test_an_image_becomes_the_first_frame_latent_the_model_was_trained_on(tmp_path):
    """Image to video: stage 1 takes the picture to the latent of the clip's first frame by the
    model's own mapping (here the position-anchored pixels), as the fixture trainer built it
    (bench/fixtures/videos.to_latent), up to the PNG's 8 bits."""
    from PIL import Image

    from bench.fixtures import videos as V
    clip = V.render(V.Clip((V.Obj("red", "circle", "right"),), "blue"), (4,))
    png = tmp_path / "first.png"
    Image.fromarray((clip[0] * 255).round().astype(np.uint8)).save(png)
    assert stage1_encode.main(["--prompt", README_PROMPT, "--image", str(png),
                               "--output_dir", str(tmp_path / "s1")]) == 0
    tensors, _ = read_stage1(str(tmp_path / "s1"), PIPE.stage1_specs(
        PIPE.latent_shape(*PIPE.size), cfg_on=True, image=True))
    want = V.to_latent(clip, PIPE_MAPPING)[:, :1]
    assert np.abs(tensors["image_latents"][0].numpy() - want).max() < 2 / 255


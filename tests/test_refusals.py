"""Bad input stops before any work, in one line naming the flag (or file), the value and what is
expected, with exit code 2, nothing written and the inputs untouched (issue 16): every numeric
flag of stage 2, stage 3 and the calibration, output paths, optional sinks, full disks, torchrun
worlds that do not fit the flags.

Commands run in this process (their main) where they stop before sampling: fast, and the gate,
backend and loop are never reached."""

import errno
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stage2_transformer_flax_deepcache as stage2
import stage3_vae_decode as stage3
from commands import calibrate
from sampling import journal, stage_io
from sampling.pipelines import get_pipeline
from sampling.stage_io import CONFIG, EMBEDDINGS, LATENTS, VIDEO, write_stage, write_stage2

ROOT = Path(__file__).resolve().parents[1]
UNWRITABLE = "/proc/issue16"  # refused to everyone, root included (permission bits are not)


def listing(path):
    return sorted(str(p.relative_to(path)) for p in Path(path).rglob("*"))


def snapshot(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(Path(path).rglob("*"))
            if p.is_file()}


def refused(main, argv, capsys, *needles):
    """main(argv) exits 2 with one line on stderr holding every needle, and prints nothing else."""
    capsys.readouterr()
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    return err


# --- stage 2: numeric flags --------------------------------------------------------------------

STAGE2_FLAGS = [
    (["--num_inference_steps", "0"], "--num_inference_steps 0: expected an integer in [1, 1000]"),
    (["--num_inference_steps", "-3"], "--num_inference_steps -3: expected an integer in [1, 1000]"),
    (["--height", "0"], "--height 0: expected a positive height"),
    (["--width", "0"], "--width 0: expected a positive width"),
    (["--video_length", "0"], "--video_length 0: expected a positive video_length"),
    (["--video_length", "6"], "--video_length 6: expected 4k + 1 frames"),
    (["--height", "100"], "--height 100: expected a positive multiple of 16"),
    (["--sample_shift", "0"], "--sample_shift 0.0: expected a finite number > 0"),
    (["--sample_shift", "nan"], "--sample_shift nan: expected a finite number > 0"),
    (["--guidance_scale", "nan"], "--guidance_scale nan: expected a number in [0, 100]"),
    (["--guidance_scale", "-2"], "--guidance_scale -2.0: expected a number in [0, 100]"),
    (["--seed", str(2 ** 64)], f"--seed {2 ** 64}: expected an integer in"),
    (["--warmup_steps", "-1"], "--warmup_steps -1: expected an integer >= 0"),
    (["--sp_size", "0"], "--sp_size 0: expected an integer >= 1"),
    (["--budget_speedup", "0"], "--budget_speedup 0.0: expected a finite number >= 1"),
    (["--budget_rel_err", "0"], "--budget_rel_err 0.0: expected a finite number > 0"),
    (["--teacache", "--teacache_thresh", "nan"], "--teacache_thresh nan: expected a finite number >= 0"),
    (["--teacache", "--teacache_ema", "1"], "--teacache_ema 1.0: expected a finite number >= 0.0 and < 1"),
    (["--fbcache", "--fb_thresh", "-1"], "--fb_thresh -1.0: expected a finite number >= 0"),
    (["--fbcache", "--fb_downsample", "0"], "--fb_downsample 0: expected an integer >= 1"),
    (["--fbcache", "--fb_ema", "inf"], "--fb_ema inf: expected a finite number"),
    (["--fbcache", "--fb_metric", "residual_tensor_rel_l1", "--fb_saliency", "-1"],
     "--fb_saliency -1.0: expected a finite number >= 0"),
    (["--enable_cache", "--cache_step_interval", "0"], "--cache_step_interval 0: expected an integer >= 1"),
    (["--enable_cache", "--cache_start_step", "-1"], "--cache_start_step -1: expected an integer >= 0"),
    (["--enable_cache", "--cache_steps", "0,3,3"],
     "--cache_steps 0,3,3: expected distinct step indices >= 0"),
    (["--enable_cache", "--cache_steps", "0,-3"],
     "--cache_steps 0,-3: expected distinct step indices >= 0"),
    (["--enable_cache", "--cache_steps", "0,3", "--cache_step_interval", "2"],
     "--cache_steps names the computed steps; --cache_step_interval would be ignored"),
    (["--enable_cache", "--cache_start_step", "5", "--cache_end_step", "3"],
     "--cache_end_step 3: expected a step >= the start step 5"),
    (["--teacache", "--cache_warmup", "-1"], "--cache_warmup -1: expected an integer >= 0"),
    (["--teacache", "--cache_last_steps", "-2"], "--cache_last_steps -2: expected an integer >= 0"),
    (["--teacache", "--fn_blocks", "-1"], "--fn_blocks -1: expected an integer >= 0"),
    (["--teacache", "--bn_blocks", "9"], "--bn_blocks 9: probe blocks (0) + tail blocks (9) exceed "
     "the hunyuanvideo-tiny model's 4 blocks; expected fn + bn <= 4"),
    (["--teacache", "--bn_blocks", "2", "--bn_ids", "2"], "--bn_ids 2: expected distinct indices in [0, 2)"),
    (["--teacache", "--ctrl_guard", "-0.5"], "--ctrl_guard -0.5: expected a finite number >= 0"),
    (["--teacache", "--scene_guard", "nan"], "--scene_guard nan: expected a finite number >= 0"),
    (["--teacache", "--offload_watermark", "1.5"], "--offload_watermark 1.5: expected a fraction"),
    (["--fbcache", "--forecast_reach", "-1"], "--forecast_reach -1.0: expected a finite number >= 0"),
    (["--fbcache", "--forecast", "2", "--forecast_gate", "true"], "--forecast_gate True: expected "
     "--forecast 1 or 2 with --fb_metric residual_tensor_rel_l1"),
]


def _case_id(value):
    return " ".join(value) if isinstance(value, list) else ""


@pytest.mark.parametrize("argv, message", STAGE2_FLAGS, ids=_case_id)
def test_stage2_refuses_each_numeric_flag_it_cannot_use(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    # the random-weight tiny HunyuanVideo-1.5: the sizes and blocks the messages name are its
    refused(stage2.main, ["--model", "hunyuanvideo-tiny", *argv, "--compile_cache_dir", "none"],
            capsys, message)
    assert listing(tmp_path) == []


@pytest.mark.parametrize("argv, message", [
    (["--weight_sharding", "fsdp"], "give --sp_size > 1 or --cfg_parallel"),
    (["--backend", "torch", "--weight_sharding", "replicated"], "the torch backend keeps them whole"),
])
def test_stage2_refuses_a_weight_sharding_it_cannot_apply(tmp_path, monkeypatch, capsys, argv,
                                                         message):
    monkeypatch.chdir(tmp_path)
    refused(stage2.main, [*argv, "--compile_cache_dir", "none"], capsys, "--weight_sharding", message)
    assert listing(tmp_path) == []


def _budget_profile(path, model="wan-tiny-ti2v", steps=20):
    fb = {"fbcache": {"threshold": 0.1, "metric": "residual_tensor_rel_l1"}}
    path.write_text(json.dumps({"budget": {
        "format": 2, "model": model, "seeds": [1, 2, 3], "steps": steps, "candidates": [
            {"label": "FBCache 0.1", "config": fb, "rel_l2": [1e-3, 1.2e-3, 1.1e-3],
             "computed": [0.5, 0.5, 0.5]}]}}))
    return str(path)


@pytest.mark.parametrize("case, message", [
    ("no profile", "--budget_rel_err/--budget_speedup and --budget_profile go together"),
    ("no target", "--budget_profile needs a target"),
    ("technique", "budgeted mode chooses the technique; drop --fbcache"),
    ("other model", "was calibrated for hunyuanvideo-tiny; this run is wan-tiny-ti2v"),
    ("other steps", "was calibrated at 20 steps"),
    ("old profile", "holds the older TeaCache-only threshold curve, calibrate again"),
    ("missing", "cannot read it"),
])
def test_stage2_refuses_a_budget_it_cannot_keep(tmp_path, monkeypatch, capsys, case, message):
    monkeypatch.chdir(tmp_path)
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    good = _budget_profile(profiles / "good.json")
    old = profiles / "old.json"
    old.write_text(json.dumps({"budget_curve": [[0.1, 1e-3, 0.5]]}))
    argv = {"no profile": ["--budget_rel_err", "0.01"],
            "no target": ["--budget_profile", good],
            "technique": ["--budget_profile", good, "--budget_rel_err", "0.01", "--fbcache"],
            "other model": ["--budget_profile", _budget_profile(profiles / "hy.json",
                                                                "hunyuanvideo-tiny"),
                            "--budget_rel_err", "0.01"],
            "other steps": ["--budget_profile", good, "--budget_rel_err", "0.01",
                            "--num_inference_steps", "12"],
            "old profile": ["--budget_profile", str(old), "--budget_rel_err", "0.01"],
            "missing": ["--budget_profile", str(profiles / "none.json"), "--budget_rel_err",
                        "0.01"]}[case]
    before = snapshot(tmp_path)
    refused(stage2.main, ["--model", "wan-tiny-ti2v", *argv, "--compile_cache_dir", "none"],
            capsys, message)
    assert snapshot(tmp_path) == before


def test_the_main_command_with_zero_steps_exits_2_and_writes_nothing(tmp_path):
    """The acceptance line of issue 16, as a new user runs it in a fresh folder."""
    out = subprocess.run([sys.executable, str(ROOT / "stage2_transformer_flax_deepcache.py"),
                          "--num_inference_steps", "0"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == ("stage2_transformer_flax_deepcache.py: error: "
                                  "--num_inference_steps 0: expected an integer in [1, 1000]")
    assert listing(tmp_path) == []


def stage1_dir(path, **config):
    pipe = get_pipeline("wan-tiny-ti2v")
    tensors = pipe.synthesize(pipe.latent_shape(*pipe.size), True, False, seed=5)
    write_stage(str(path), tensors, EMBEDDINGS, {}, {"model": "wan-tiny-ti2v", **config})


@pytest.mark.parametrize("key, value, message", [
    ("num_inference_steps", 0, "num_inference_steps 0: expected an integer in [1, 1000]"),
    ("height", 0, "height 0: expected a positive height"),
    ("video_length", 0, "video_length 0: expected a positive video_length"),
    ("seed", "abc", "seed 'abc': expected an integer in"),
    ("guidance_scale", "high", "guidance_scale 'high': expected a number in [0, 100]"),
])
def test_stage1_config_values_are_checked_like_flags(tmp_path, capsys, key, value, message):
    stage1_dir(tmp_path, **{key: value})
    before = snapshot(tmp_path)
    refused(stage2.main, ["--input_dir", str(tmp_path), "--compile_cache_dir", "none"], capsys,
            f"{tmp_path / CONFIG}: {message}")
    assert snapshot(tmp_path) == before


# --- stage 2: output paths and optional sinks ---------------------------------------------------

@pytest.mark.parametrize("flag", ["--telemetry_csv", "--telemetry_json", "--plot_png"])
def test_report_files_in_an_unwritable_folder_are_refused_before_sampling(tmp_path, monkeypatch,
                                                                          capsys, flag):
    monkeypatch.chdir(tmp_path)
    refused(stage2.main, [flag, "/proc/t.out", "--compile_cache_dir", "none"], capsys,
            f"{flag} /proc/t.out: its folder /proc is not writable")
    assert listing(tmp_path) == []


def test_an_output_dir_that_cannot_be_written_is_refused_before_sampling(tmp_path, monkeypatch,
                                                                         capsys):
    monkeypatch.chdir(tmp_path)
    refused(stage2.main, ["--output_dir", f"{UNWRITABLE}/out", "--compile_cache_dir", "none"],
            capsys, f"--output_dir {UNWRITABLE}/out is not writable (in /proc)")
    (tmp_path / "file").write_text("x")
    refused(stage2.main, ["--output_dir", "file/out", "--compile_cache_dir", "none"], capsys,
            "--output_dir file/out:", "file is a file; expected a folder to write into")
    assert listing(tmp_path) == ["file"]


@pytest.mark.parametrize("name", [LATENTS, CONFIG])
def test_a_file_name_held_by_a_folder_is_refused_before_sampling(tmp_path, capsys, name):
    (tmp_path / "out" / name).mkdir(parents=True)
    refused(stage2.main, ["--output_dir", str(tmp_path / "out"), "--compile_cache_dir", "none"],
            capsys, f"{tmp_path / 'out' / name} is a folder; expected that name free")
    assert listing(tmp_path) == ["out", f"out/{name}"]


def _command(name, folder):
    """(main, its leading flags) of stage 2, or of stage 3 on a stage-2 folder made in `folder`."""
    if name == "stage2":
        return stage2.main, []
    stage2_dir(folder / "in")
    return stage3.main, ["--input_dir", str(folder / "in")]


@pytest.mark.parametrize("command", ["stage2", "stage3"])
def test_a_compile_cache_dir_that_is_a_file_or_cannot_be_made_is_refused(tmp_path, monkeypatch,
                                                                         capsys, command):
    """Alike in stage 2 and stage 3 (one resolution, tpu.compile.check_cache_dir)."""
    monkeypatch.chdir(tmp_path)
    main, argv = _command(command, tmp_path)
    (tmp_path / "file").write_text("x")
    before = snapshot(tmp_path)
    refused(main, [*argv, "--compile_cache_dir", "file"], capsys,
            "--compile_cache_dir file exists and is not a directory",
            "or 'none' to run without the persistent compilation cache")
    refused(main, [*argv, "--compile_cache_dir", "file/jax"], capsys,
            "--compile_cache_dir file/jax:", "is a file")
    refused(main, [*argv, "--compile_cache_dir", f"{UNWRITABLE}/jax"], capsys,
            f"--compile_cache_dir {UNWRITABLE}/jax is not writable")
    refused(main, [*argv, "--compile_cache_dir", ""], capsys, "--compile_cache_dir '': expected a path")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("flag, module, package", [
    ("--plot_png", "matplotlib", "matplotlib"),
    ("--tensorboard_dir", "torch.utils.tensorboard", "tensorboard"),
])
def test_a_sink_whose_package_does_not_import_is_refused_with_the_install_line(
        tmp_path, monkeypatch, capsys, flag, module, package):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, module, None)  # import now raises ImportError
    refused(stage2.main, [flag, "sink.out", "--compile_cache_dir", "none"], capsys,
            f"{flag} needs the {package} package", f"pip install {package}")
    assert listing(tmp_path) == []


@pytest.mark.parametrize("command", ["stage2", "stage3"])
def test_a_bucket_compile_cache_without_etils_is_refused_with_the_install_line(
        tmp_path, monkeypatch, capsys, command):
    """--compile_cache_dir gs://...: JAX reaches a bucket through etils.epath; without it the
    run stops before any work, saying what to install (requirements-tpu.txt has it)."""
    monkeypatch.chdir(tmp_path)
    main, argv = _command(command, tmp_path)
    before = snapshot(tmp_path)
    monkeypatch.setitem(sys.modules, "etils", None)  # import now raises ImportError
    refused(main, [*argv, "--compile_cache_dir", "gs://bucket/jax-cache"], capsys,
            "--compile_cache_dir gs://bucket/jax-cache is a bucket URL",
            "pip install 'etils[epath,epath-gcs]'")
    assert snapshot(tmp_path) == before


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("fails", ["latents", "config", "telemetry"])
def test_a_full_disk_while_writing_stage2_says_so_and_keeps_the_previous_files(
        tmp_path, monkeypatch, capsys, fails):
    argv = ["--backend", "torch", "--num_inference_steps", "2", "--output_dir", str(tmp_path / "out"),
            "--no_progress"]
    assert stage2.main(argv) == 0
    before = snapshot(tmp_path)
    if fails == "latents":
        monkeypatch.setattr(stage_io, "write_tensors", _enospc)
    elif fails == "config":
        monkeypatch.setattr(stage_io, "open", _enospc, raising=False)
    else:
        argv += ["--telemetry_json", str(tmp_path / "t.json")]

        def full_for_the_report(path, *args, **kwargs):  # temporaries are named after the file
            return (_enospc if "t.json" in str(path) else open)(path, *args, **kwargs)
        monkeypatch.setattr(journal, "open", full_for_the_report, raising=False)  # Staged.add
    capsys.readouterr()
    assert stage2.main([*argv, "--seed", "7"]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "No space left on device" in err, err
    if fails == "telemetry":  # reports are prepared before the stage files: none of them new
        assert f"--telemetry_json {tmp_path / 't.json'} could not be written" in err
    assert "the disk is full" in err and "files of earlier runs are as they were" in err
    assert snapshot(tmp_path) == before


def test_only_rank_0_speaks_for_a_refusal(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", "1")
    capsys.readouterr()
    assert stage2.main(["--num_inference_steps", "0"]) == 2
    assert capsys.readouterr() == ("", "")


# --- stage 3 ----------------------------------------------------------------------------------

def stage2_dir(path, latents=None, **config):
    pipe = get_pipeline("hunyuanvideo-tiny")
    if latents is None:
        latents = torch.randn(pipe.latent_shape(*pipe.size), generator=torch.Generator().manual_seed(0))
    h, w, f = pipe.size
    write_stage2(str(path), latents, {"model": pipe.name},
                 {"model": pipe.name, "height": h, "width": w, "video_length": f, **config})
    return latents


@pytest.mark.parametrize("latents, message", [
    ("nan", "latents holds NaN or Inf values"),
    ("inf", "latents holds NaN or Inf values"),
    ("int64", "latents has dtype torch.int64; expected one of torch.float32"),
    ("int32", "latents has dtype torch.int32"),
])
def test_stage3_refuses_latents_that_are_not_finite_floats(tmp_path, capsys, latents, message):
    z = torch.randn(get_pipeline("hunyuanvideo-tiny").latent_shape(64, 80, 9))
    if latents in ("nan", "inf"):
        z[0, 1, 1, 1, 1] = float(latents)
    else:
        z = (z * 10).to(getattr(torch, latents))
    stage2_dir(tmp_path, z)
    before = snapshot(tmp_path)
    refused(stage3.main, ["--input_dir", str(tmp_path)], capsys, f"{tmp_path / LATENTS}: {message}")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("argv, message", [
    (["--fps", "0"], "--fps 0.0: expected a finite number >= 0.1 and <= 1000"),
    (["--fps", "nan"], "--fps nan: expected a finite number >= 0.1 and <= 1000"),
    (["--fps", "inf"], "--fps inf: expected a finite number >= 0.1 and <= 1000"),
    (["--output_dir", ""], "--output_dir '': expected a folder path"),
    (["--output_dir", f"{UNWRITABLE}/video"], f"--output_dir {UNWRITABLE}/video is not writable"),
])
def test_stage3_refuses_flags_it_cannot_use_before_decoding(tmp_path, capsys, argv, message):
    stage2_dir(tmp_path)
    before = snapshot(tmp_path)
    refused(stage3.main, ["--input_dir", str(tmp_path), *argv], capsys, message)
    assert snapshot(tmp_path) == before


def test_stage3_checks_the_config_values_it_reads(tmp_path, capsys):
    stage2_dir(tmp_path, fps="fast")
    refused(stage3.main, ["--input_dir", str(tmp_path)], capsys,
            f"{tmp_path / CONFIG}: fps 'fast': expected a finite number >= 0.1 and <= 1000")
    stage2_dir(tmp_path, fps=0)
    refused(stage3.main, ["--input_dir", str(tmp_path)], capsys, "fps 0: expected a finite number >= 0.1 and <= 1000")
    stage2_dir(tmp_path, height="tall")
    refused(stage3.main, ["--input_dir", str(tmp_path)], capsys, "height 'tall': expected an integer")


@pytest.mark.parametrize("name", [VIDEO, CONFIG])
def test_stage3_refuses_a_file_name_held_by_a_folder(tmp_path, capsys, name):
    stage2_dir(tmp_path / "in")
    (tmp_path / "out" / name).mkdir(parents=True)
    refused(stage3.main, ["--input_dir", str(tmp_path / "in"), "--output_dir", str(tmp_path / "out")],
            capsys, f"{tmp_path / 'out' / name} is a folder")
    assert listing(tmp_path / "out") == [name]


def test_stage3_grid_must_be_positive(tmp_path, monkeypatch, capsys):
    stage2_dir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    refused(stage3.main, ["--input_dir", str(tmp_path), "--patch_parallel", "--grid=0x2"], capsys,
            "--grid '0x2': expected ROWSxCOLS of positive integers")


# --- calibration --------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--samples", "0"], "--samples 0: expected an integer >= 1"),
    (["--num_inference_steps", "0"], "--num_inference_steps 0: expected an integer >= 2"),
    (["--num_inference_steps", "1"], "--num_inference_steps 1: expected an integer >= 2"),
    (["--degree", "-1"], "--degree -1: expected an integer >= 0"),
    (["--samples", "1", "--num_inference_steps", "4", "--degree", "3"],
     "--degree 3: a fit of degree 3 needs more than 3 points"),
    (["--first_seed", "-1"], "--first_seed -1: expected an integer"),
    (["--budget", "--samples", "1"], "--samples 1: expected 2 or more"),
    (["--model_path", ""], "--model_path '': expected a path"),
])
def test_calibrate_refuses_flags_it_cannot_use(tmp_path, capsys, argv, message):
    refused(calibrate.main, [*argv, "--out", str(tmp_path / "p.json")], capsys, message)
    assert listing(tmp_path) == []


def test_calibrate_refuses_an_out_path_it_cannot_write_before_sampling(tmp_path, capsys):
    refused(calibrate.main, ["--out", "/proc/p.json"], capsys,
            "--out /proc/p.json: its folder /proc is not writable")
    (tmp_path / "p.json").mkdir()
    refused(calibrate.main, ["--out", str(tmp_path / "p.json")], capsys,
            "expected a file in an existing, writable folder")
    refused(calibrate.main, ["--model_path", str(tmp_path / "missing"), "--out",
                             str(tmp_path / "q.json")], capsys, "missing")
    assert listing(tmp_path) == ["p.json"]


# --- torchrun worlds that do not fit the flags ------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(cwd, script, *args, nproc=2):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           str(nproc), "--master_port", str(_free_port()), str(ROOT / script), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def our_lines(stderr: str, prog: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(prog)]


def ranks_exited_2(stderr: str) -> bool:
    """torchrun's failure report names the exit code of each rank it saw fail (the launcher exits
    1 itself): the first rank to finish refused with 2; the launcher then stops the others with
    SIGTERM, so they show 2 if they ended first, else -15 (or 143 inside our handler). Never 1
    (a traceback) or 0 (a run)."""
    codes = dict(re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: (-?\d+)", stderr))
    return "2" in codes.values() and set(codes.values()) <= {"2", "-15", "143"}


def test_torchrun_worlds_that_do_not_fit_stage2_stop_in_one_line(tmp_path):
    prog = "stage2_transformer_flax_deepcache.py: error:"
    jax = torchrun(tmp_path, "stage2_transformer_flax_deepcache.py", "--compile_cache_dir", "none")
    assert our_lines(jax.stderr, prog) == [
        f"{prog} launched as 2 processes (torchrun), but --backend jax runs as one process per host "
        "(its devices split the tokens with --sp_size; several hosts: --multihost); add --backend "
        "torch, or run one process"], jax.stderr[-3000:]
    assert ranks_exited_2(jax.stderr)
    world = torchrun(tmp_path, "stage2_transformer_flax_deepcache.py", "--backend", "torch")
    lines = our_lines(world.stderr, prog)
    assert len(lines) == 1 and "2 process(es) were launched, but --sp_size 1 needs 1" in lines[0]
    assert ranks_exited_2(world.stderr)
    assert "stage2_transformer_flax_deepcache.py\", line" not in jax.stderr + world.stderr
    assert listing(tmp_path) == []


def test_torchrun_patch_grid_that_does_not_fit_the_ranks_stops_in_one_line(tmp_path):
    stage2_dir(tmp_path)
    before = snapshot(tmp_path)
    out = torchrun(tmp_path, "stage3_vae_decode.py", "--input_dir", str(tmp_path), "--patch_parallel",
                   "--grid", "1x3")
    prog = "stage3_vae_decode.py: error:"
    assert our_lines(out.stderr, prog) == [
        f"{prog} grid 1x3 has 3 patches; expected 2, one per rank"], out.stderr[-3000:]
    assert ranks_exited_2(out.stderr), out.stderr[-3000:]
    assert "stage3_vae_decode.py\", line" not in out.stderr
    assert snapshot(tmp_path) == before


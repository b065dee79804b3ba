"""Wan2.2 S2V sampling: the clip-by-clip loop against a plain reference, both backends, the
gate reset per clip, the audio guard, compile discipline across clips, stage files and the CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cache import CMConfig, TeaCacheConfig
from sampling.clips import sample_clips
from sampling.pipelines import get_pipeline
from sampling.run import noise_for
from sampling.schedulers import make_scheduler
from sampling.stages import SignalPlan
from tests.model_inputs import random_model, rel_err
from torch_backend.backend import TorchBackend
from tpu.backend import JaxBackend

ROOT = Path(__file__).resolve().parents[1]
NAME = "wan-tiny-s2v"
STEPS = 8


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The torch runs here (the backend and the eager reference) on one thread: with both cores
    busy (pytest -n 2), a second OpenMP thread spin-waits for its turn, ~40x slower (wan-tiny-s2v's
    plain reference: 0.7 s on one thread, 30 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def setup(seed=0, motion=False, clips=2):
    pipe = get_pipeline(NAME)
    shape = pipe.latent_shape(*pipe.size)
    tensors = pipe.synthesize(shape, True, False, seed)
    tensors["audio_embeds"] = tensors["audio_embeds"][..., : 16 * clips]
    if motion:  # a given history: the first clip shows its motion tokens
        tensors["motion_latents"] = torch.randn(1, 16, 7, *shape[3:],
                                                generator=torch.Generator().manual_seed(9))
    return pipe, {None: random_model(NAME, std=0.2)}, shape, tensors


_SHARED: dict = {}  # SignalPlan -> the JaxBackend the TeaCache tests share (its programs compiled once)


def backend_for(backend_cls, config, models, *, shared=False):
    """A fresh backend for `config`'s plan; shared=True: on JAX, one per plan for the tests that
    ask (their runs then compile nothing the first did not)."""
    plan = SignalPlan.from_config(config)
    if not shared or backend_cls is not JaxBackend:
        return backend_cls(models, plan)
    if plan not in _SHARED:
        _SHARED[plan] = backend_cls(models, plan)
    return _SHARED[plan]


def run(backend_cls, config, *, motion=False, shared=False, **kw):
    pipe, models, shape, tensors = setup(motion=motion)
    backend = backend_for(backend_cls, config, models, shared=shared)
    clips = sample_clips(backend, config, pipe, tensors, shape, seed=0, solver=pipe.solver,
                         steps=kw.pop("steps", STEPS), shift=pipe.shift, **kw)
    return clips, tensors


def plain_reference(tensors, motion=None):
    """Caching off, written out: per clip model.forward on cond (the clip's audio) and uncond (no
    audio), CFG 4.5, UniPC; the first clip hides its motion unless a history was given; the next
    history is the last 19 latent frames of [history | clip]."""
    pipe = get_pipeline(NAME)
    model = random_model(NAME, std=0.2)
    shape = pipe.latent_shape(*pipe.size)
    audio = tensors["audio_embeds"]
    history = torch.zeros(1, 16, 19, 8, 8) if motion is None else \
        torch.cat([torch.zeros(1, 16, 12, 8, 8), motion], dim=2)
    visible = torch.tensor([0.0 if motion is None else 1.0])
    out = []
    for clip in range(tensors["audio_embeds"].shape[-1] // 16):
        sched = make_scheduler("unipc", STEPS, 3.0)
        x = noise_for(shape, clip)
        window = audio[..., 16 * clip: 16 * (clip + 1)]
        common = (tensors["ref_latents"], history)
        with torch.no_grad():
            for i, t in enumerate(sched.timesteps):
                tt = torch.tensor([t])
                cond = model(x, tt, tensors["prompt_embeds"], *common, window, visible)
                uncond = model(x, tt, tensors["negative_prompt_embeds"], *common,
                               torch.zeros_like(window), visible)
                x = sched.step(i, uncond + 4.5 * (cond - uncond), x,
                               lambda terms: sum(w * v for w, v in terms))
        out.append(x)
        history = torch.cat([history, x], dim=2)[:, :, -19:]
        visible = torch.ones(1)
    return torch.cat(out, dim=2)


def test_caching_off_clip_loop_equals_the_plain_reference_on_jax():
    clips, tensors = run(JaxBackend, CMConfig())
    want = plain_reference(tensors)
    assert clips.latents.shape == (1, 16, 8, 8, 8)
    assert rel_err(clips.latents, want) < 1e-4
    # every clip ran the first clip's programs: nothing compiled after warm-up
    assert clips.trajectories[0].warmup_compiles.lowered > 0
    assert all(t.loop_compiles.lowered == 0 for t in clips.trajectories)


def test_a_negative_prompt_of_another_length_compiles_nothing_in_the_loop():
    """Stage-1 files hold the prompt and the negative prompt at their own lengths: the uncond
    branch's programs compile in the warm-up, not inside the loop's first full step (where they
    made the estimated speedup 8.90x against a schedule ideal of 2.17x, issue 40)."""
    config = CMConfig(teacache=TeaCacheConfig(threshold=0.12))
    pipe, models, shape, tensors = setup()
    tensors["prompt_embeds"] = tensors["prompt_embeds"][:, :3]  # 3 tokens against 16
    backend = backend_for(JaxBackend, config, models)
    clips = sample_clips(backend, config, pipe, tensors, shape, seed=0, solver=pipe.solver,
                         steps=STEPS, shift=pipe.shift)
    assert clips.trajectories[0].warmup_compiles.lowered > 0
    assert [t.loop_compiles.lowered for t in clips.trajectories] == [0, 0]


def test_torch_and_jax_take_the_same_decisions_per_clip():
    config = CMConfig(teacache=TeaCacheConfig(threshold=0.12))
    jax_clips, _ = run(JaxBackend, config, motion=True, shared=True)  # the first clip shows a given history
    torch_clips, tensors = run(TorchBackend, config, motion=True)
    def trace(clips):
        return [(r["clip"], r["step"], r["branch"], r["action"])
                for r in clips.merged().gate.telemetry.trace]
    assert trace(jax_clips) == trace(torch_clips)
    assert any(a == "skip" for *_, a in trace(jax_clips))
    assert rel_err(jax_clips.latents, torch_clips.latents) < 1e-4
    # caching off, the given history: the plain reference (torch, eager)
    off, _ = run(TorchBackend, CMConfig(), motion=True)
    assert rel_err(off.latents, plain_reference(tensors, tensors["motion_latents"])) < 1e-5


def test_the_gate_starts_afresh_every_clip():
    config = CMConfig(teacache=TeaCacheConfig(threshold=0.05))
    clips, _ = run(TorchBackend, config)
    gates = [t.gate for t in clips.trajectories]
    assert len({id(g) for g in gates}) == 2
    for gate in gates:
        first = gate.telemetry.trace[0]
        assert first["step"] == 0 and first["action"] == "compute" and first["reason"] == "warmup"
        assert gate.telemetry.trace[-1]["step"] == STEPS - 1
    summary = clips.merged().gate.summary()
    assert summary["branches"]["cond"]["total"] == 2 * STEPS
    assert len(summary["clips"]) == 2


def _guarded(backend_cls, ctrl_guard, change_at=5):
    """Clip 1's speech is revised at step `change_at` (a streaming front end)."""
    pipe, models, shape, tensors = setup()
    config = CMConfig(teacache=TeaCacheConfig(threshold=10.0), ctrl_guard=ctrl_guard)
    backend = backend_for(backend_cls, config, models, shared=True)
    revised = torch.randn(1, 25, 16, 16, generator=torch.Generator().manual_seed(5))
    clips = sample_clips(backend, config, pipe, tensors, shape, seed=0, solver="unipc",
                         steps=STEPS, shift=3.0, audio_updates={1: {change_at: revised}})
    return clips


@pytest.mark.parametrize("backend_cls", [JaxBackend, TorchBackend])
def test_the_audio_guard_computes_where_the_speech_changes(backend_cls):
    on = _guarded(backend_cls, 0.1)
    off = _guarded(backend_cls, 0.0)
    def rows(clips, clip):
        return {(r["step"], r["branch"]): r for r in clips.trajectories[clip].gate.telemetry.trace}
    assert rows(on, 1)[(5, "cond")]["reason"] == "control_change"
    for branch in ("cond", "uncond"):  # uncond follows cond: both compute at the change
        assert rows(on, 1)[(5, branch)]["action"] == "compute"
        assert rows(off, 1)[(5, branch)]["action"] == "skip"
    assert rows(on, 1)[(5, "cond")]["signal_control_delta"] > 0.1
    # the other clip saw no change and skips as without the guard
    assert [r["action"] for r in rows(on, 0).values()] == [r["action"] for r in rows(off, 0).values()]
    if backend_cls is JaxBackend:  # the change measure compiled in the first clip's warm-up
        assert all(t.loop_compiles.lowered == 0 for t in on.trajectories)


def test_fused_cfg_equals_separate_branches():
    separate, _ = run(TorchBackend, CMConfig())
    fused, _ = run(TorchBackend, CMConfig(cfg_mode="fused"), fused_cfg=True)
    assert rel_err(fused.latents, separate.latents) < 1e-5


def test_clip_counts_and_geometry_are_checked():
    pipe, _, shape, tensors = setup(clips=3)
    assert pipe.clip_count(tensors, shape) == 3
    with pytest.raises(ValueError, match="multiple of the 16 frames of a clip"):
        pipe.clip_count({**tensors, "audio_embeds": tensors["audio_embeds"][..., :40]}, shape)
    with pytest.raises(ValueError, match="multiple of 4"):
        pipe.latent_shape(64, 64, 17)
    with pytest.raises(ValueError, match="multiple of 64"):
        pipe.latent_shape(64, 96, 16)
    real = get_pipeline("wan2.2-s2v-14b")
    assert (real.solver, real.shift, real.steps, real.guidance) == ("unipc", 3.0, 40, 4.5)
    assert real.latent_shape(*real.size) == (1, 16, 20, 88, 160)


# --- the command ---------------------------------------------------------------------------------

def _cli(cwd, *args, devices=None, **extra_env):
    # torch on one thread (the command builds the model with it): with both cores busy a second
    # OpenMP thread spin-waits for its turn
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"OMP_NUM_THREADS": "1"} | extra_env
    if devices:
        env["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={devices} "
                            "--xla_backend_optimization_level=0")
    return subprocess.run([sys.executable, str(ROOT / "stage2_transformer_flax_deepcache.py"),
                           "--model", NAME, *args, "--no_progress"], cwd=cwd, env=env,
                          capture_output=True, text=True)


def _refused(capsys, *args):
    """(exit code, stderr) of the command's own main in this process: a refusal comes before any
    model or device work, so a child apiece would only add an import of torch and JAX."""
    from commands.stage2 import main

    code = main([*args, "--no_progress"])
    return code, capsys.readouterr().err


def test_acceptance_command_runs_every_clip_without_loop_compiles(tmp_path):
    out = _cli(tmp_path, "--teacache", "--compare", "--num_inference_steps", "12",
               "--telemetry_csv", "trace.csv")
    assert out.returncode == 0, out.stderr
    assert "x 3 clips" in out.stdout and "clip 2:" in out.stdout and "PSNR" in out.stdout
    assert re.search(r"\), loop 0\b", out.stdout)  # no compile in the loop
    latents = load_file(str(tmp_path / "stage_outputs" / "stage2_latents.safetensors"))["latents"]
    assert latents.shape == (1, 16, 12, 8, 8)
    config = json.loads((tmp_path / "stage_outputs" / "generation_config.json").read_text())
    assert config["num_clips"] == 3 and config["video_length"] == 16
    header, *rows = (tmp_path / "trace.csv").read_text().splitlines()
    assert header.endswith(",clip") and rows[-1].endswith(",2") and len(rows) == 3 * 12 * 2
    # stage 3 decoding these clips into one video: tests/test_stage3_s2v.py


def test_clips_on_a_sequence_and_cfg_parallel_mesh_compile_nothing_in_the_loop(tmp_path, monkeypatch,
                                                                              capsys):
    out = _cli(tmp_path, "--teacache", "--sp_size", "2", "--cfg_parallel", "--num_inference_steps",
               "6", "--num_clips", "2", devices=4)
    assert out.returncode == 0, out.stderr
    assert "x4 (sp 2, cfg 2, weights fsdp)" in out.stdout and "clip 1: pair" in out.stdout
    assert re.search(r"\), loop 0\b", out.stdout)  # no compile in the loop
    # as one rank of a 2-process torchrun world would see it (the world itself fits the flags)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code, err = _refused(capsys, "--model", NAME, "--backend", "torch", "--sp_size", "2")
    assert code == 2 and "sequence/CFG parallel on the JAX backend only" in err


def _stage1(directory, tensors, **config):
    directory.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(directory / "stage1_embeddings.safetensors"))
    (directory / "generation_config.json").write_text(json.dumps({"model": NAME, **config}))


def test_stage_files_drive_the_clips_and_bad_ones_stop_before_sampling(tmp_path, monkeypatch,
                                                                        capsys):
    _, _, _, tensors = setup(motion=True, clips=3)
    good = tmp_path / "good"
    _stage1(good, tensors, num_inference_steps=4)
    out = _cli(tmp_path, "--input_dir", str(good), "--num_clips", "2")
    assert out.returncode == 0, out.stderr
    latents = load_file(str(good / "stage2_latents.safetensors"))["latents"]
    assert latents.shape == (1, 16, 8, 8, 8)
    monkeypatch.chdir(tmp_path)
    cases = {
        "audio": ({**tensors, "audio_embeds": tensors["audio_embeds"][..., :20]},
                  "multiple of the 16 frames"),
        "ref": ({k: v for k, v in tensors.items() if k != "ref_latents"}, "lacks ref_latents"),
        "layers": ({**tensors, "audio_embeds": tensors["audio_embeds"][:, :24]},
                   "audio_embeds has shape [1, 24, 16, 48]"),
    }
    for name, (bad, message) in cases.items():
        folder = tmp_path / name
        _stage1(folder, bad)
        before = sorted(os.listdir(folder))
        code, err = _refused(capsys, "--model", NAME, "--input_dir", str(folder))
        assert code == 2 and message in err, (name, err)
        assert sorted(os.listdir(folder)) == before
    code, err = _refused(capsys, "--model", NAME, "--input_dir", str(good), "--num_clips", "4")
    assert code == 2 and "holds 3 clips" in err
    code, err = _refused(capsys, "--num_clips", "2")
    assert code == 2 and "--num_clips belongs to speech-to-video" in err
    assert sorted(os.listdir(tmp_path)) == ["audio", "good", "layers", "ref"]

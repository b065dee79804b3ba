"""End-to-end runs of the main command and of the flag mapping."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cache import ConfigError
from cache.flags import config_of
from commands import stage1, stage2
from commands.stage2 import build_parser
from sampling.cache_cli import cache_flags
from sampling.pipelines import DEFAULT_PIPELINE, DEFAULT_PROMPT, get_pipeline
from sampling.stage_io import EMBEDDINGS, read_stage2, write_stage

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "stage2_transformer_flax_deepcache.py"),
                           *args], cwd=cwd, capture_output=True, text=True)


def test_main_command_samples_with_deepcache_and_writes_the_stage_files(tmp_path):
    """The docs' stage-2 command (docs/stages.md) in a fresh folder: the model trained here, on
    its default prompt encoded in-process."""
    out = cli("--enable_cache", "--compare", "--telemetry_json", "t.json",
              "--compile_cache_dir", str(tmp_path / "jax-cache"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "computed  25  reused  25" in out.stdout and "loop 0" in out.stdout
    assert f"inputs: prompt {DEFAULT_PROMPT!r} (encoded here)" in out.stdout
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["model"] == DEFAULT_PIPELINE and report["compiles"]["loop"]["lowered"] == 0
    assert report["prompt"] == DEFAULT_PROMPT and not report["synthetic_inputs"]
    assert report["branches"] == {b: {"computed": 25, "reused": 25} for b in ("cond", "uncond")}
    assert report["compare"]["rel_l2"] > 0 and report["compare"]["psnr_db"] > 20
    assert len(report["trace"]) == 100
    latents, meta, config = read_stage2(str(tmp_path / "stage_outputs"))
    assert list(latents.shape) == report["latent_shape"] and latents.dtype == torch.float32
    assert meta["deepcache_enabled"] == "true" and meta["cache_start_step"] == "11"
    assert config["num_inference_steps"] == 50 and config["synthetic_inputs"] is False
    assert config["prompt"] == DEFAULT_PROMPT  # stage 3 and a rerun read it as stage 1's
    # a second process, of fewer steps, finds every program in the persistent compilation cache
    # (the same run twice: tests/test_compile_cache.py)
    out = cli("--enable_cache", "--num_inference_steps", "4", "--telemetry_json", "t2.json",
              "--compile_cache_dir", str(tmp_path / "jax-cache"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    compiles = json.loads((tmp_path / "t2.json").read_text())["compiles"]
    assert compiles["warmup"]["cache_hits"] >= 3 and compiles["loop"]["lowered"] == 0
    assert compiles["process"]["compiled"] == 0 and "0 compiled by XLA in all" in out.stdout


def _latents(argv, given=None):
    request = stage2.request_of(stage2.build_parser().parse_args(
        [*argv, "--num_inference_steps", "6", "--no_progress", "--compile_cache_dir", "none"]))
    spec = stage2.resolve(request, given)
    stage2.check_prompt_used(request, spec)
    backend, opened = stage2.open_backend(spec)
    return stage2.sample_and_write(spec, backend, True, opened)[0].as_dict(), spec


def test_without_inputs_stage2_samples_its_prompt_as_stage1_would_encode_it(tmp_path):
    """No --input_dir: the default model's prompt is encoded in-process, exactly as stage 1
    writes it (the same latents as from the stage-1 tensors), and another prompt changes them;
    a random-weight model is one --model away, on synthetic inputs."""
    report, r = _latents(["--output_dir", str(tmp_path / "a")])
    assert report["model"] == DEFAULT_PIPELINE and report["prompt"] == DEFAULT_PROMPT
    s1 = stage1.request_of(stage1.build_parser().parse_args(["--prompt", DEFAULT_PROMPT]))
    tensors, _, config = stage1.encode(stage1.pipeline_of(s1.model),
                                       stage1.encoder_request(s1.inputs, DEFAULT_PROMPT), None, "cpu")
    staged, _ = _latents(["--output_dir", str(tmp_path / "b")], (tensors, config))
    a, b = (read_stage2(str(tmp_path / d))[0] for d in "ab")
    assert torch.equal(a, b) and not staged["synthetic_inputs"]
    _latents(["--prompt", "blue square moves left on red", "--output_dir", str(tmp_path / "c")])
    assert not torch.equal(a, read_stage2(str(tmp_path / "c"))[0])
    report, _ = _latents(["--model", "hunyuanvideo-tiny", "--output_dir", str(tmp_path / "d")])
    assert report["prompt"] is None and report["synthetic_inputs"]
    assert read_stage2(str(tmp_path / "d"))[2]["synthetic_inputs"] is True


@pytest.mark.parametrize("argv, message", [
    (["--model", "hunyuanvideo-tiny", "--prompt", "a cat"],
     "--prompt: stage 2 holds no text encoder for hunyuanvideo-tiny"),
    (["--prompt", "purple dog"], "--prompt: 'purple dog' has unknown words dog, purple"),
    (["--prompt", "red circle", "--input_dir", "."], "--prompt and --input_dir are alternatives"),
    (["--height", "32"], "--height: 32; expected 16: wan-tiny-trained was trained on 4 frames"),
])
def test_a_prompt_stage2_cannot_encode_is_refused_before_any_work(tmp_path, argv, message):
    out = cli(*argv, "--output_dir", str(tmp_path / "out"), "--compile_cache_dir", "none",
              cwd=tmp_path)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()


def test_input_dir_pipeline_adds_stage2_fields_and_keeps_stage1(tmp_path):
    pipe = get_pipeline("wan-tiny-ti2v")
    shape = pipe.latent_shape(*pipe.size)
    tensors = pipe.synthesize(shape, True, True, seed=5)  # with a first frame: TI2V image mode
    stage1 = {"prompt": "a cat", "model": "wan-tiny-ti2v", "guidance_scale": 4.0, "seed": 7}
    write_stage(str(tmp_path), tensors, EMBEDDINGS, {}, stage1)
    before = (tmp_path / EMBEDDINGS).read_bytes()
    out = cli("--input_dir", str(tmp_path), "--num_inference_steps", "6", "--teacache",
              "--compile_cache_dir", "none")
    assert out.returncode == 0, out.stderr
    latents, meta, config = read_stage2(str(tmp_path))
    assert config["prompt"] == "a cat" and config["seed"] == 7 and config["guidance_scale"] == 4.0
    assert config["num_inference_steps"] == 6 and config["synthetic_inputs"] is False
    assert torch.equal(latents[:, :, :1], tensors["image_latents"])  # the first frame is kept
    assert (tmp_path / EMBEDDINGS).read_bytes() == before  # the input is never rewritten


@pytest.mark.parametrize("case, message", [
    ("missing_key", "lacks negative_prompt_embeds"),
    ("wrong_shape", "prompt_embeds has shape"),
    ("wrong_dtype", "dtype torch.int64"),
    ("unknown_model", "unknown model 'wan-giant'"),
    ("bad_size", "height 100: expected a positive multiple of 32"),
])
def test_malformed_input_dir_stops_before_sampling_and_writes_nothing(tmp_path, case, message):
    pipe = get_pipeline("wan-tiny-ti2v")
    tensors = pipe.synthesize(pipe.latent_shape(*pipe.size), True, False, seed=5)
    config = {"model": "wan-tiny-ti2v"}
    if case == "missing_key":
        del tensors["negative_prompt_embeds"]
    elif case == "wrong_shape":
        tensors["prompt_embeds"] = tensors["prompt_embeds"][..., :5]
    elif case == "wrong_dtype":
        tensors["prompt_embeds"] = tensors["prompt_embeds"].long()
    elif case == "unknown_model":
        config["model"] = "wan-giant"
    elif case == "bad_size":
        config["height"] = 100
    write_stage(str(tmp_path), tensors, EMBEDDINGS, {}, config)
    listing = sorted(p.name for p in tmp_path.iterdir())
    out = cli("--input_dir", str(tmp_path), "--compile_cache_dir", "none")
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert out.stdout == "" and sorted(p.name for p in tmp_path.iterdir()) == listing


def test_bad_flags_exit_nonzero_with_a_message(tmp_path):
    out = cli("--teacache", "--teacache_thresh", "-1", cwd=tmp_path)
    assert out.returncode == 2 and "TeaCacheConfig.threshold" in out.stderr and out.stdout == ""
    out = cli("--fb_metric", "hidden_rel_l1", cwd=tmp_path)
    assert out.returncode == 2 and "fbcache is not enabled" in out.stderr
    out = cli("--model", "wan2.2-ti2v-5b", cwd=tmp_path)
    assert out.returncode == 2 and "give --model_path" in out.stderr
    out = cli("--teacache", "--cfg_mode", "fused", "--guidance_scale", "1", cwd=tmp_path)
    assert out.returncode == 2 and "needs CFG" in out.stderr
    assert list(tmp_path.iterdir()) == []


def parse(*args):
    return config_of(cache_flags(build_parser().parse_args(list(args))))


def test_flags_map_onto_the_config():
    cfg = parse("--teacache", "--teacache_thresh", "0.12", "--teacache_warmup", "3",
                "--teacache_limits", "max_cached=-1,max_continuous=2", "--cfg_mode", "separate",
                "--fbcache", "--fb_metric", "residual_tensor_rel_l1", "--evaluation_order", "tc,fb")
    assert cfg.teacache.threshold == 0.12 and cfg.warmup == 3
    assert cfg.limits.max_cached is None and cfg.limits.max_continuous == 2
    assert cfg.cfg_mode == "separate" and cfg.modes == ("tc", "fb") and cfg.probe_blocks == 1


def test_unset_flags_keep_the_dataclass_defaults():
    from cache import CMConfig, TeaCacheConfig
    assert parse("--teacache") == CMConfig(teacache=TeaCacheConfig())
    assert parse() == CMConfig()


def test_aliases_must_agree():
    with pytest.raises(ConfigError, match="different values"):
        parse("--teacache", "--teacache_warmup", "1", "--fb_warmup", "2")
    assert parse("--teacache", "--teacache_warmup", "2", "--fb_warmup", "2").warmup == 2


def test_bf16_run_keeps_fp32_islands_and_writes_bf16_latents(tmp_path):
    from modules.checkpoint import cast_model
    from modules.registry import build_model
    model = cast_model(build_model("wan-tiny-i2v"), torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["time_embedding.0.weight"] == torch.float32
    assert dtypes["blocks.0.self_attn.q.weight"] == torch.bfloat16
    out = cli("--model", "wan-tiny-i2v", "--dtype", "bf16", "--num_inference_steps", "6",
              "--compile_cache_dir", "none", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    latents, meta, _ = read_stage2(str(tmp_path / "stage_outputs"))
    assert latents.dtype == torch.bfloat16 and torch.isfinite(latents.float()).all()


def test_torch_backend_from_the_same_command(tmp_path):
    out = cli("--backend", "torch", "--model", "wan-tiny-i2v", "--teacache", "--offload_model",
              "--num_inference_steps", "8", "--telemetry_json", "t.json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["backend"] == "torch" and report["device"] == "cpu"
    assert report["cache"]["config"]["offload"] == "cpu"  # offloaded model: residuals on the host
    assert set(report["experts"]) == {"high", "low"}
    out = cli("--torch_compile", cwd=tmp_path)
    assert out.returncode == 2 and "belong to --backend torch" in out.stderr


def test_presets_resolve_to_one_config_and_flags_override():
    from cache import TeaCacheConfig
    safe = parse("--preset", "safe")
    assert safe.teacache == TeaCacheConfig(threshold=1.5, relative=True) and safe.tail_blocks == 2
    assert safe.noise_adapt == "table:last40"
    hybrid = parse("--preset", "hybrid", "--teacache_thresh", "0.2", "--max_continuous", "5")
    assert hybrid.teacache.threshold == 0.2 and hybrid.limits.max_continuous == 5
    assert hybrid.forecast == 1 and hybrid.noise_adapt == "linear" and hybrid.teacache.relative
    turbo = parse("--preset", "turbo", "--fbcache", "--teacache_relative", "false")
    assert turbo.modes == ("fb", "tc") and turbo.teacache.downsample == 4 and not turbo.cfg_sep_diff
    assert not turbo.teacache.relative and turbo.teacache.threshold == 5.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--preset", "ludicrous"])


def test_a_preset_run_prints_the_resolved_config(tmp_path):
    out = cli("--preset", "balanced", "--num_inference_steps", "12", "--compile_cache_dir", "none",
              cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "preset balanced" in out.stdout and "'bn_blocks': 1" in out.stdout
    assert "'relative': True" in out.stdout

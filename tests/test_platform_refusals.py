"""A platform, device, attention lowering or TPU slice this host or Cloud TPU does not have is
refused up front in one line, exit 2, nothing written (issue 23 items 8, 9, 10): `python -m
commands.aot` sizes, shift, guidance, --json folder and slice shapes (before libtpu is loaded, so
long before any compile); stage 2 with JAX_PLATFORMS naming a missing platform, --device naming
a missing torch device, --attention splash off a TPU; and no libtpu noise on a CPU host.

Commands run in this process (their main) where they can; a subprocess where JAX_PLATFORMS must
be set before JAX is imported."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stage2_transformer_flax_deepcache as stage2
from commands import aot as aot_command
from sampling import platforms
from tpu import aot
from tpu.topology import parse_topology

ROOT = Path(__file__).resolve().parents[1]
STAGE2 = ROOT / "stage2_transformer_flax_deepcache.py"


def listing(path):
    return sorted(str(p.relative_to(path)) for p in Path(path).rglob("*"))


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err, err
    return err.strip()


@pytest.fixture
def no_work(monkeypatch, tmp_path):
    """Run in an empty folder; reaching libtpu (tpu.aot) or a model (stage 2) fails the test."""
    monkeypatch.chdir(tmp_path)

    def reached(*args, **kwargs):
        raise AssertionError("reached past the checks")
    monkeypatch.setattr(aot, "topology_devices", reached)
    monkeypatch.setattr("commands.stage2.load_models", reached)
    monkeypatch.setattr("commands.stage2.open_models", reached)
    return tmp_path


# --- python -m commands.aot -----------------------------------------------------------------

AOT = [
    (["--height", "65"], "--height 65: expected a positive multiple of 32"),
    (["--width", "0"], "--width 0: expected a positive width"),
    (["--sample_shift", "-1"], "--sample_shift -1.0: expected a finite number > 0"),
    (["--guidance_scale", "nan"], "--guidance_scale nan: expected a number in [0, 100]"),
    (["--guidance_scale", "1e39"], "--guidance_scale 1e+39: expected a number in [0, 100]"),
    (["--num_inference_steps", "1000000000"], "--num_inference_steps 1000000000: expected an "
     "integer in [1, 1000]"),
    (["--height", "100000", "--width", "100000"], "--height 100000, --width 100000, "
     "--video_length (default) 9: 29,296,875 tokens per model call (2.6 GiB for one hidden "
     "state of the wan-tiny-ti2v model); expected at most 1,048,576"),
    (["--json", "missing/r.json"], "--json 'missing/r.json': expected a file in an existing, "
     "writable folder"),
    (["--topology", "v6e:2x3"], "--topology v6e:2x3: not a v6e slice Cloud TPU offers; expected "
     "v6e:1x1, v6e:2x2, v6e:2x4, v6e:4x4, v6e:4x8, v6e:8x8, v6e:8x16, v6e:16x16"),
    (["--topology", "v6e:64x64"], "--topology v6e:64x64: not a v6e slice Cloud TPU offers"),
    (["--topology", "v6e:4x2"], "--topology v6e:4x2: not a v6e slice Cloud TPU offers"),
    (["--topology", "v5e:2x8"], "--topology v5e:2x8: not a v5e slice Cloud TPU offers"),
    (["--topology", "v5p:2x2x3"], "--topology v5p:2x2x3: not a v5p slice Cloud TPU offers; "
     "expected v5p:2x2x1, v5p:2x2x2, v5p:2x2x4, v5p:2x4x4, or whole 4x4x4 cubes"),
    (["--topology", "v5p:8x4x4"], "A <= B <= C multiples of 4"),
    (["--topology", "v5p:16x16x28"], "at most 96 cubes (v5p:16x16x24)"),
    (["--topology", "v7x:2x2x3"], "--topology v7x:2x2x3: not a v7x slice Cloud TPU offers; "
     "expected v7x:1x1x1, v7x:2x2x1, v7x:2x2x2, v7x:2x2x4, v7x:2x4x4, or whole 4x4x4 cubes"),
    (["--topology", "v7x:16x24x28"], "at most 144 cubes (v7x:16x24x24)"),
    (["--topology", "v7x:2x2"], "--topology 'v7x:2x2': v7x slices are 3-dimensional, e.g. v7x:2x2x1"),
    (["--topology", "v7x:2x2x1", "--sp_size", "4"], "--sp_size 4 uses 4 device(s); topology "
     "v7x:2x2x1 has 8 (2 a chip): give --sp_size 8, or a 4-device topology"),
    (["--topology", "v6e:2x2", "--sp_size", "8"], "topology v6e:2x2 has 4: give --sp_size 4"),
    (["--swap_experts", "--weight_sharding", "fsdp"], "--swap_experts plans for whole experts"),
]


@pytest.mark.parametrize("argv, message", AOT, ids=[" ".join(a) for a, _ in AOT])
def test_aot_refuses_before_loading_libtpu(no_work, capfd, argv, message):
    capfd.readouterr()
    base = ["--model", "wan-tiny-ti2v", "--topology", "v6e:1x1"]
    assert aot_command.main([*base, *argv]) == 2
    out, err = capfd.readouterr()
    assert out == ""
    assert message in one_line(err)
    assert err.startswith("python -m commands.aot: error: ")
    assert listing(no_work) == []


@pytest.mark.parametrize("name, generation, dims", [
    ("v6e:1x1", "v6e", (1, 1, 1)), ("v6e:2x2", "v6e", (2, 2, 1)), ("v6e:2x4", "v6e", (2, 4, 1)),
    ("v6e:4x4", "v6e", (4, 4, 1)), ("v6e:4x8", "v6e", (4, 8, 1)), ("v6e:8x8", "v6e", (8, 8, 1)),
    ("v6e:8x16", "v6e", (8, 16, 1)), ("v6e:16x16", "v6e", (16, 16, 1)),
    ("v5e:1x1", "v5e", (1, 1, 1)), ("v5e:2x4", "v5e", (2, 4, 1)), ("v5e:16x16", "v5e", (16, 16, 1)),
    ("v5p:2x2x1", "v5p", (2, 2, 1)), ("v5p:2x2x2", "v5p", (2, 2, 2)), ("v5p:2x2x4", "v5p", (2, 2, 4)),
    ("v5p:2x4x4", "v5p", (2, 4, 4)), ("v5p:4x4x4", "v5p", (4, 4, 4)), ("v5p:4x4x8", "v5p", (4, 4, 8)),
    ("v5p:4x8x8", "v5p", (4, 8, 8)), ("v5p:8x16x16", "v5p", (8, 16, 16)),
    ("v5p:4x4x92", "v5p", (4, 4, 92)), ("v5p:16x16x24", "v5p", (16, 16, 24)),
    ("v7x:1x1x1", "v7x", (1, 1, 1)), ("v7x:2x2x1", "v7x", (2, 2, 1)), ("v7x:2x2x2", "v7x", (2, 2, 2)),
    ("v7x:2x2x4", "v7x", (2, 2, 4)), ("v7x:2x4x4", "v7x", (2, 4, 4)), ("v7x:4x4x4", "v7x", (4, 4, 4)),
    ("v7x:4x4x8", "v7x", (4, 4, 8)), ("v7x:4x12x124", "v7x", (4, 12, 124)),
    ("v7x:16x16x32", "v7x", (16, 16, 32)), ("v7x:16x24x24", "v7x", (16, 24, 24))])
def test_every_documented_slice_shape_is_taken(name, generation, dims):
    """Each shape Cloud TPU documents parses to its generation's chip and its chips per axis,
    in the order given (a 2D slice's third axis 1)."""
    chip, parsed = parse_topology(name)
    assert (chip.name, parsed) == (generation, dims)


# --- refusals stage 2 and commands.aot share (one resolution: sampling/run_spec.py) ----------

SHARED = [
    ["--cfg_parallel", "--cfg_mode", "separate"],
    ["--cfg_parallel", "--cfg_mode", "shared_diff"],
    ["--cfg_mode", "fused", "--guidance_scale", "1"],
    ["--height", "100000", "--width", "100000", "--video_length", "9"],
    ["--height", "100000", "--width", "100000"],  # a default size is labelled alike
    ["--height", "65"],
    ["--width", "0"],
    ["--video_length", "8"],
    ["--num_inference_steps", "0"],
    ["--num_inference_steps", "1000000000"],
    ["--sample_shift", "-1"],
    ["--guidance_scale", "abc"],  # one reading of the guidance: sampling/guidance.py
    ["--guidance_scale", "5,4,3"],
    ["--guidance_scale", "5,200"],
]


def _refusal(main, argv, capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    return one_line(err).split(": error: ", 1)[1]


@pytest.mark.parametrize("model", ["wan-tiny-ti2v", "wan-tiny-i2v"])
@pytest.mark.parametrize("flags", SHARED, ids=[" ".join(f) for f in SHARED])
def test_stage2_and_the_compile_refuse_the_same_flags_word_for_word(no_work, capsys, model, flags):
    said = _refusal(stage2.main, ["--model", model, "--compile_cache_dir", "none", *flags], capsys)
    assert _refusal(aot_command.main, ["--model", model, "--topology", "v6e:1x1", *flags],
                    capsys) == said
    assert listing(no_work) == []


def test_a_guidance_pair_is_taken_as_stage_2_takes_it(no_work, monkeypatch, capsys):
    """Wan2.2 I2V-A14B's 'low,high' guidance, one scale per expert: the compile's request holds
    the pair stage 2 resolves from the same flag, and the compile takes it through every check
    (up to libtpu); a one-expert pipeline refuses it alike in both."""
    flags = ["--model", "wan-tiny-i2v", "--guidance_scale", "5,4"]
    request = aot_command.request_of(aot_command.build_parser().parse_args(
        [*flags, "--topology", "v6e:1x1"]))
    assert request.guidance_scale == (5.0, 4.0)
    with pytest.raises(AssertionError, match="reached past the checks"):
        aot.compile_run(request)

    class Resolved(Exception):
        pass

    def resolved(spec, layout=None):
        raise Resolved(spec.guidance)
    monkeypatch.setattr("commands.stage2.open_backend", resolved)
    with pytest.raises(Resolved) as stage2_resolved:
        stage2.main([*flags, "--compile_cache_dir", "none", "--output_dir", str(no_work / "o")])
    assert stage2_resolved.value.args[0] == request.guidance_scale
    one = ["--model", "wan-tiny-ti2v", "--guidance_scale", "5,4"]
    said = _refusal(stage2.main, [*one, "--compile_cache_dir", "none"], capsys)
    assert said == "--guidance_scale '5,4': expected a number in [0, 100]"
    assert _refusal(aot_command.main, [*one, "--topology", "v6e:1x1"], capsys) == said


def test_the_token_bound_is_stated_once_with_its_figures(no_work, capsys):
    said = _refusal(aot_command.main, ["--model", "wan-tiny-ti2v", "--topology", "v6e:1x1",
                                       "--height", "100000", "--width", "100000"], capsys)
    assert said == ("--height 100000, --width 100000, --video_length (default) 9: 29,296,875 "
                    "tokens per model call (2.6 GiB for one hidden state of the wan-tiny-ti2v "
                    "model); expected at most 1,048,576 (9x HunyuanVideo-1.5 720p)")


# --- stage 2: JAX_PLATFORMS, --device, --attention -------------------------------------------

def _stage2(tmp_path, env):
    return subprocess.run([sys.executable, str(STAGE2), "--num_inference_steps", "2",
                           "--output_dir", str(tmp_path / "x")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("value, message", [
    ("tpu", "JAX_PLATFORMS=tpu: no tpu device here (no /dev/accel*, /dev/vfio/<n> or TPU on the "
     "PCI bus); expected a platform this host has: unset JAX_PLATFORMS or set it to cpu"),
    ("cuda", "JAX_PLATFORMS=cuda: no cuda device here (JAX sees no NVIDIA GPU"),
])
def test_a_jax_platform_this_host_lacks_is_one_line(tmp_path, value, message):
    if value == "tpu" and platforms.tpu_evidence() or value == "cuda" and platforms.gpu_evidence():
        pytest.skip(f"this host may have a {value} device")
    out = _stage2(tmp_path, {**os.environ, "JAX_PLATFORMS": value})
    assert out.returncode == 2 and out.stdout == ""
    assert one_line(out.stderr).startswith(f"stage2_transformer_flax_deepcache.py: error: {message}")
    assert listing(tmp_path) == []


CPU_ONLY, ONE_GPU = {"cpu": 1}, {"cpu": 1, "cuda": 1}  # what torch_devices() could say
DEVICES = [
    (CPU_ONLY, "cuda", "--device cuda: no cuda device here"),
    (CPU_ONLY, "npu", "--device npu: no npu device here"),
    (CPU_ONLY, "cuda:0", "--device cuda:0: no cuda device here"),
    (ONE_GPU, "cuda:1", "--device cuda:1: this host has 1 cuda device(s) (cuda:0 to "
     "cuda:0)"),
    (CPU_ONLY, "tpu", "--device 'tpu': expected cuda, npu or cpu"),
    (CPU_ONLY, "cuda:x", "--device 'cuda:x': expected cuda, npu or cpu"),
]


@pytest.mark.parametrize("host, device, message", DEVICES, ids=[d for _, d, _ in DEVICES])
def test_a_torch_device_this_host_lacks_is_one_line(no_work, monkeypatch, capsys, host, device,
                                                    message):
    monkeypatch.setattr(platforms, "torch_devices", lambda: dict(host))
    capsys.readouterr()
    assert stage2.main(["--backend", "torch", "--device", device, "--compile_cache_dir",
                        "none"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in one_line(err), err
    assert listing(no_work) == []


def test_the_real_missing_devices_say_why(no_work, capsys):
    """On this host as it is (no monkeypatch): the reason names what is missing."""
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    assert stage2.main(["--backend", "torch", "--device", "cuda"]) == 2
    err = one_line(capsys.readouterr().err)
    assert "--device cuda: no cuda device here (" in err and "expected one this host has: cpu" in err
    if getattr(torch, "npu", None) is None:
        assert stage2.main(["--backend", "torch", "--device", "npu"]) == 2
        assert "no npu device here (torch_npu is not installed)" in one_line(capsys.readouterr().err)


ATTENTION = [
    ([], "splash", "--attention splash: the splash kernel runs on a TPU only, and this run's JAX "
     "platform is cpu; expected one that runs here: jax_dpa, reference, sdpa, splash_interpret"),
    ([], "flash", "--attention 'flash': expected one of reference, sdpa, jax_dpa, splash, "
     "splash_interpret"),
    (["--backend", "torch"], "splash", "--attention 'splash': expected one of reference, sdpa "
     "with --backend torch (jax_dpa, splash and splash_interpret are the JAX backend's)"),
]


@pytest.mark.parametrize("argv, name, message", ATTENTION, ids=["jax splash", "jax flash",
                                                                "torch splash"])
def test_an_attention_lowering_that_cannot_run_here_is_one_line(no_work, capsys, argv, name,
                                                                message):
    import jax
    if jax.default_backend() == "tpu":
        pytest.skip("splash runs here")
    assert stage2.main([*argv, "--attention", name, "--compile_cache_dir", "none"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in one_line(err), err
    assert listing(no_work) == []


def test_the_jax_attention_names_are_tpu_attentions_lowerings():
    from tpu import attention
    assert set(platforms.JAX_ATTENTION) == set(attention.IMPLEMENTATIONS)


# --- quiet stderr ---------------------------------------------------------------------------

def test_the_default_command_is_silent_on_stderr_with_libtpu_on_a_cpu_host(tmp_path):
    """libtpu (jax[tpu]) installed, JAX_PLATFORMS unset, only a CPU here: no libtpu noise."""
    if not platforms.libtpu_noise_here():
        pytest.skip("libtpu is not installed, or this host has an accelerator")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, str(STAGE2), "--num_inference_steps", "2",
                          "--output_dir", str(tmp_path / "q"), "--compile_cache_dir", "none",
                          "--no_progress"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr == ""
    assert "cpu" in out.stdout and "wrote" in out.stdout


@pytest.mark.parametrize("environ, expected", [
    ({}, "cpu"),  # unset: the CPU, said up front
    ({"JAX_PLATFORMS": ""}, ""),  # set, even to "choose for me": the user's
    ({"JAX_PLATFORMS": "tpu,cpu"}, "tpu,cpu"),
    ({"JAX_FORCE_TPU_INIT": "1"}, None),
])
def test_the_cpu_default_applies_only_where_jax_platforms_is_unset(environ, expected):
    if not platforms.libtpu_noise_here():
        pytest.skip("libtpu is not installed, or this host has an accelerator")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_FORCE_TPU_INIT")}
    out = subprocess.run([sys.executable, "-c", "import os, sampling; "
                          "print(os.environ.get('JAX_PLATFORMS'))"], cwd=ROOT,
                         env={**env, **environ}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.strip() == str(expected)


def test_a_tpu_or_gpu_device_keeps_jax_platforms_unset(monkeypatch):
    monkeypatch.setattr(platforms, "tpu_evidence", lambda: ["/dev/vfio/0"])
    assert not platforms.libtpu_noise_here()
    monkeypatch.setattr(platforms, "tpu_evidence", lambda: [])
    monkeypatch.setattr(platforms, "gpu_evidence", lambda: ["/dev/nvidia0"])
    assert not platforms.libtpu_noise_here()

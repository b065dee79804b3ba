"""Stage 3's decode compiled for a real TPU target without one (libtpu's compile-only devices):
the tiny TI2V VAE through `python -m commands.vae_aot`, its plan, and the command's refusals. (The
decode it compiles is the one tests/test_stage3_jax.py checks against diffusers.)"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commands import vae_aot as vae_aot_command
from sampling.pipelines import get_pipeline
from tpu import vae_aot
from tpu.hbm import hbm_traffic
from tpu.topology import topology_devices
from tpu.vae import JaxVaeDecoder

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "commands.vae_aot", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_command_compiles_the_decode_for_a_slice_and_plans_it(tmp_path):
    """The tiny TI2V VAE (8 x 12 latent rows x columns) on v6e:2x2: rows split over the 4 chips,
    each chip's band cut into strips, a first call and a steady one per further latent frame,
    each a chain of block programs that blocks alike share, halos exchanged between
    neighbours, and a plan that holds the weights, the carried state and the largest step."""
    out = _cli("--model", "wan-tiny-ti2v", "--topology", "v6e:2x2", "--tiny",
               "--json", str(tmp_path / "r.json"), "--hlo_dir", str(tmp_path / "hlo"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "fits" in out.stdout and "steady" in out.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    pipe = get_pipeline("wan-tiny-ti2v")
    shape = pipe.latent_shape(*pipe.size)
    assert (report["devices"], report["split"]) == (4, "rows")
    # each chip's band of 2 x 12 latent pixels as a batch of 8 strips (tpu.vae_strips.strip_grid)
    assert report["strips"] == [2, 4] and "each band as 2 x 4 strips" in out.stdout
    # float32 on a TPU: the convs' operands rounded to bf16 in the program (tpu.vae)
    assert (report["dtype"], report["conv_operands"]) == ("fp32", "bf16")
    assert "fp32, conv operands bf16" in out.stdout
    first, steady = report["programs"]["first"], report["programs"]["steady"]
    assert (first["calls"], steady["calls"]) == (1, shape[2] - 1)
    assert "collective-permute" in steady["collectives"]
    assert not {"all-to-all", "reduce-scatter"} & set(steady["collectives"])
    # the residual blocks alike share their program: fewer programs than calls
    assert steady["programs"] < steady["step_calls"] and first["programs"] < first["step_calls"]
    assert f"{report['programs_compiled']} programs, a compile per core pair" in out.stdout
    m = report["memory"]
    # at its worst step a chip holds the weights, the carried causal caches and, beside them,
    # that step's other arguments, temporaries and outputs (its new caches beside the old:
    # nothing is donated), and the previous call's video chunk on its way to the host: 3
    # channels x 4 frames x 128 x 192 pixels in fp32 over the 4 chips' rows = 294912 bytes
    assert steady["in_flight"] == steady["state_bytes"] + steady["step_bytes"]
    assert steady["state_bytes"] > 0 and steady["step_bytes"] >= steady["output_bytes"] > 0
    assert m["total"] == m["weights"] + steady["in_flight"] + 294912
    assert m["fits"] and 0 < m["weights"] == steady["weight_bytes"]
    assert report["video_shape"][2] == pipe.size[2] and report["tflop"] > 0
    assert report["roofline_seconds"] >= steady["roofline"] * (shape[2] - 1) > 0
    # HBM traffic (tpu/hbm.py), counted from the program text --hlo_dir wrote
    text = (tmp_path / "hlo" / "steady.txt").read_text()  # each step's program, in call order
    modules = ["HloModule " + m for m in text.split("HloModule ")[1:]]
    assert len(modules) == steady["step_calls"]
    assert steady["hbm_bytes"] == pytest.approx(sum(hbm_traffic(m) for m in modules))
    assert 0 < steady["hbm_bytes"] <= steady["bytes_accessed"]
    assert 0 < report["roofline_seconds_traffic"] <= report["roofline_seconds"]


def test_command_refuses_bad_input_before_any_compile(capsys):
    for args, message in [
        (("--model", "wan-tiny-trained", "--topology", "v6e:1x1"), "pixel space"),
        (("--model", "wan-tiny-ti2v", "--topology", "v4:2x2x1"), "expected <generation>"),
        (("--model", "wan-tiny-ti2v", "--topology", "v6e:1x1", "--video_length", "8"),
         "--video_length 8"),
        (("--model", "wan-tiny-s2v", "--topology", "v6e:1x1"), "clip by clip"),
        (("--model", "wan-tiny-ti2v", "--topology", "v6e:1x1", "--hlo_dir", "/dev/null/hlo"),
         "--hlo_dir /dev/null/hlo"),
        (("--model", "wan-tiny-ti2v", "--topology", "v6e:1x1", "--frames_per_call", "0"),
         "--frames_per_call"),
    ]:
        assert vae_aot_command.main(list(args)) == 2, args
        assert message in capsys.readouterr().err, args


def test_the_request_has_one_field_per_flag():
    """`request_of` is the one step from the command line to the library: each field of the
    request is the flag of its name, so a flag renamed or added without its field fails here;
    the sizes, given as text, come as integers."""
    parser = vae_aot_command.build_parser()
    args = parser.parse_args(["--model", "wan-tiny-ti2v", "--topology", "v6e:1x1", "--height", "64",
                              "--frames_per_call", "2"])
    assert {f.name for f in dataclasses.fields(vae_aot.VaeAotRequest)} == set(vars(args))
    request = vae_aot_command.request_of(args)
    assert (request.height, request.width, request.frames_per_call) == (64, None, 2)


def test_an_abstract_decoder_holds_the_decoder_weights_alone_and_refuses_to_decode():
    pipe = get_pipeline("wan-tiny-ti2v")
    _, vae = vae_aot.meta_vae(pipe, torch.float32, tiny=True)
    _, devices = topology_devices("v6e:1x1")
    import numpy as np
    from jax.sharding import Mesh
    decoder = JaxVaeDecoder(vae, Mesh(np.array(devices), ("s",)), abstract=True)
    names = set(decoder.params)
    assert any(n.startswith("vae.decoder.") for n in names)
    assert not any(n.startswith(("vae.encoder.", "vae.quant_conv.")) for n in names)
    with pytest.raises(RuntimeError, match="only compile"):
        decoder.decode(torch.zeros(pipe.latent_shape(*pipe.size)))
    with pytest.raises(ValueError, match="expected mesh"):
        JaxVaeDecoder(vae, None, abstract=True)

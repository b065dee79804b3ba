"""Stage 3's decode compiled for a real TPU target without one (libtpu's compile-only devices):
the tiny VAEs of both families through `tpu.vae_aot`, checked against the same programs compiled
and run on the CPU; the command's refusals."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modules.vae import build_tiny, spec_for, to_vae_latents
from sampling.pipelines import get_pipeline
from tpu import aot, vae_aot
from tpu.vae import JaxVaeDecoder

ROOT = Path(__file__).resolve().parents[1]


def _args(**kw):
    base = dict(model="wan-tiny-ti2v", topology="v6e:1x1", dtype="fp32", height=None, width=None,
                video_length=None, tiny=True, json=None)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("model", ["wan-tiny-ti2v", "wan-tiny-i2v", "hunyuanvideo-tiny"])
def test_tpu_decode_does_the_work_of_the_cpu_decode(model):
    """One chip: the TPU programs' flops are the CPU programs' (the same traced decode), and the
    plan holds at least the weights and the steady program's own temporaries."""
    report = vae_aot.run(_args(model=model))
    pipe = get_pipeline(model)
    shape = pipe.latent_shape(*pipe.size)
    vae = build_tiny(spec_for(pipe), pipe.latent_channels)
    cpu = JaxVaeDecoder(vae)
    first, steady = cpu.prepare(shape)
    for name, compiled in (("first", first), ("steady", steady)):
        tpu = report["programs"][name]
        flops = compiled.cost_analysis()
        flops = (flops[0] if isinstance(flops, list) else flops)["flops"]
        assert tpu["flops"] == pytest.approx(flops, rel=0.1), (name, tpu["flops"], flops)
    assert report["programs"]["first"]["calls"] == 1
    assert report["programs"]["steady"]["calls"] == shape[2] - 1
    steady_p = report["programs"]["steady"]
    m = report["memory"]
    assert m["total"] >= m["weights"] + steady_p["temp_bytes"] and m["fits"]
    assert report["video_shape"][2] == pipe.size[2]
    # the decode the plan stands for really runs: the CPU decoder gives the clip's frames
    z = to_vae_latents(vae, torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    assert cpu.decode(z).shape[2] == pipe.size[2]


def test_rows_split_over_the_chips_that_divide_the_latent_height():
    """v6e:2x2: 4 chips; the tiny TI2V latent is 8 rows high, the tiny I2V one 8 too; each chip's
    steady program then holds a quarter of the rows and exchanges halos with its neighbours."""
    one = vae_aot.run(_args(topology="v6e:1x1"))
    four = vae_aot.run(_args(topology="v6e:2x2"))
    assert four["devices"] == 4 and one["devices"] == 1
    assert "collective-permute" in four["programs"]["steady"]["collectives"]
    assert not one["programs"]["steady"]["collectives"]
    # split by rows, each chip computes about a quarter (plus the halo rows)
    ratio = four["programs"]["steady"]["flops"] / one["programs"]["steady"]["flops"]
    assert 0.2 < ratio < 0.5, ratio


def _cli(*args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "tpu.vae_aot", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_command_prints_the_plan_and_refuses_bad_input(tmp_path):
    out = _cli("--model", "wan-tiny-ti2v", "--topology", "v6e:2x2", "--tiny",
               "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "fits" in out.stdout and "steady" in out.stdout and (tmp_path / "r.json").exists()
    for args, message in [
        (("--model", "wan-tiny-trained", "--topology", "v6e:1x1"), "pixel space"),
        (("--model", "wan-tiny-ti2v", "--topology", "v7x:2x2"), "expected <generation>"),
        (("--model", "wan-tiny-ti2v", "--topology", "v6e:1x1", "--video_length", "8"),
         "--video_length 8"),
        (("--model", "wan-tiny-s2v", "--topology", "v6e:1x1"), "clip by clip"),
    ]:
        bad = _cli(*args)
        assert bad.returncode == 2 and message in bad.stderr, (args, bad.stderr[-2000:])


def test_an_abstract_decoder_refuses_to_decode():
    pipe = get_pipeline("wan-tiny-ti2v")
    _, vae = vae_aot.meta_vae(pipe, torch.float32, tiny=True)
    _, devices = aot.topology_devices("v6e:1x1")
    import numpy as np
    from jax.sharding import Mesh
    decoder = JaxVaeDecoder(vae, Mesh(np.array(devices), ("h",)), abstract=True)
    with pytest.raises(RuntimeError, match="only compile"):
        decoder.decode(torch.zeros(pipe.latent_shape(*pipe.size)))
    with pytest.raises(ValueError, match="expected mesh"):
        JaxVaeDecoder(vae, None, abstract=True)

"""Sequence and CFG parallel on JAX, on 8 emulated CPU devices (tests/sp_jax_check.py runs in its
own process: the device-count flag must be set before jax starts, and this process has started it).

For tiny models of both families and of Wan2.2 S2V (one clip, its motion history shown), with
caching off, TeaCache and FBCache (its tensor metric, so the stored reference is sharded too):
sp = 2, 4, 8 and CFG parallel (cfg 2 x sp 2, cfg 2 x sp 4)
give the single-device latents within 1e-5 relative and the same per-step decision trace (one
controller decides for every shard, from signals reduced over sp), the loop compiles nothing,
and the probe holds exactly one all-reduce however many signals it reads.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("hunyuanvideo-tiny", "wan-tiny-i2v", "wan-tiny-s2v")


@pytest.fixture(scope="module")
def facts():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = {name: subprocess.Popen([sys.executable, str(ROOT / "tests" / "sp_jax_check.py"), name],
                                    cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name in FAMILIES}  # all at once: the cores stay busy
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr[-3000:]
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_sharded_runs_equal_one_device_with_the_same_decisions(facts, name):
    cases = facts[name]["cases"]
    assert {(c["sp"], c["cfg"]) for c in cases} >= {(2, 1), (4, 1), (8, 1), (2, 2), (4, 2)}
    assert {(c["sp"], c["cfg"]) for c in cases if c["weights"] == "fsdp"} == {(4, 1), (2, 2), (8, 1)}
    for case in cases:
        # FSDP: the Linear weights of every block live split over the mesh; nothing else is
        assert (case["split_weights"] > 0) == (case["weights"] == "fsdp"), case
        assert case["rel_err"] < 1e-5, case
        assert case["trace_equal"], case
        assert case["loop_compiles"] == 0, case
        if case["config"] != "off":
            assert case["reused"] > 0, case  # the gate did skip, on reduced signals


@pytest.mark.parametrize("name", FAMILIES)
def test_one_all_reduce_per_probe_for_every_signal(facts, name):
    f = facts[name]
    assert f["probe_signal_columns"] >= 2  # TeaCache and FBCache (tensor metric, with saliency)
    assert f["probe_collectives"].get("all-reduce") == 1
    assert f["traced_signal_psums"] == 1
    # the blocks themselves talk through Ulysses all-to-all or gathered K/V, never all-reduce
    assert "all-reduce" not in f["middle_collectives"]
    assert f["middle_collectives"].get("all-to-all", 0) + f["middle_collectives"].get("all-gather", 0) > 0
    # split (FSDP) weights are gathered for each block: more all-gathers, still no all-reduce
    assert f["fsdp_middle_collectives"].get("all-gather", 0) > f["middle_collectives"].get("all-gather", 0)
    assert "all-reduce" not in f["fsdp_middle_collectives"]


def _cli(tmp_path, *args, devices=None):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if devices:
        env["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={devices} "
                            "--xla_backend_optimization_level=0")
    return subprocess.run([sys.executable, str(ROOT / "stage2_transformer_flax_deepcache.py"),
                           *args, "--no_progress", "--output_dir", "out"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)


def test_cli_runs_sequence_and_cfg_parallel_and_refuses_missing_devices(tmp_path):
    out = _cli(tmp_path, "--teacache", "--sp_size", "2", "--cfg_parallel",
               "--num_inference_steps", "8", devices=4)
    assert out.returncode == 0, out.stderr
    assert "x4 (sp 2, cfg 2, weights fsdp)" in out.stdout and "pair" in out.stdout
    config = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert config["sp_size"] == 2 and config["cfg_parallel"] is True
    bad = tmp_path / "bad"
    bad.mkdir()
    out = _cli(bad, "--sp_size", "4")
    assert out.returncode == 2 and "needs 4 devices" in out.stderr and "xla_force_host" in out.stderr
    out = _cli(bad, "--cfg_parallel", "--cfg_mode", "separate")
    assert out.returncode == 2 and "--cfg_parallel" in out.stderr
    assert list(bad.iterdir()) == []


@pytest.mark.parametrize("sp", [3, 7])
def test_loop_compiles_nothing_when_sp_divides_neither_tokens_nor_heads(tmp_path, sp):
    # hunyuanvideo-tiny: 60 tokens and 2 heads; 3 divides the tokens (and the latent's 3 frames),
    # 7 divides nothing: padded shards, gathered K/V
    out = _cli(tmp_path, "--teacache", "--sp_size", str(sp), "--num_inference_steps", "6",
               "--compile_cache_dir", "none", "--telemetry_json", "t.json", devices=8)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["compiles"]["loop"]["lowered"] == 0, report["compiles"]
    assert report["branches"]["cond"]["reused"] > 0

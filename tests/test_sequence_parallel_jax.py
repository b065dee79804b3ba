"""Sequence and CFG parallel on JAX, on 8 emulated CPU devices (tests/sp_jax_check.py runs in its
own process: the device-count flag must be set before jax starts, and this process has started it).

For tiny models of both families and of Wan2.2 S2V (one clip, its motion history shown), with
caching off, TeaCache, FBCache (its tensor metric, so the stored reference is sharded too) and both
at once: sp = 2, 4, 8 and CFG parallel (cfg 2 x sp 2, cfg 2 x sp 4), with replicated and FSDP
weights, give the single-device latents within 1e-5 relative and the same per-step decision trace
(one controller decides for every shard, from signals reduced over sp), the loop compiles nothing,
and the probe holds exactly one all-reduce however many signals it reads. On hunyuanvideo-tiny also
sp = 3 and 7, which divide neither its 60 tokens nor its 2 heads (padded shards, gathered K/V).
S2V (wan-tiny-i2v's transformer with audio and motion frames) runs both caches at once on sp 4
with replicated and FSDP weights and on cfg 2 x sp 4.

One test a family, each running its own child: pytest-xdist spreads them over its workers, and a
child is never run twice for two tests of one family landing on different workers.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sharding.jax_sp import SIGNAL_PSUMS_PER_PROBE

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("hunyuanvideo-tiny", "wan-tiny-i2v", "wan-tiny-s2v")


def _facts(name):
    # torch on one thread in the child (it builds the models): on busy cores a second OpenMP
    # thread spin-waits for its turn
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "sp_jax_check.py"), name], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", FAMILIES)
def test_sharded_runs_equal_one_device_with_the_same_decisions_and_one_all_reduce_per_probe(name):
    f = _facts(name)
    cases = f["cases"]
    if name == "wan-tiny-s2v":  # the i2v transformer's shapes and configs are checked on i2v
        assert {(c["sp"], c["cfg"], c["weights"]) for c in cases} == {
            (4, 1, "replicated"), (4, 1, "fsdp"), (4, 2, "replicated")}
        assert {c["config"] for c in cases} == {"both"}
    else:
        shapes = {(2, 1), (4, 1), (8, 1), (2, 2), (4, 2)}
        if name == "hunyuanvideo-tiny":  # 60 tokens, 2 heads: 3 divides only the tokens, 7 nothing
            shapes |= {(3, 1), (7, 1)}
        assert {(c["sp"], c["cfg"]) for c in cases} == shapes
        fsdp = {(4, 1), (2, 2), (8, 1)} | ({(3, 1)} if name == "hunyuanvideo-tiny" else set())
        assert {(c["sp"], c["cfg"]) for c in cases if c["weights"] == "fsdp"} == fsdp
        assert {c["weights"] for c in cases if c["cfg"] == 1} == {"replicated", "fsdp"}
        assert {c["weights"] for c in cases if c["cfg"] == 2} == {"replicated", "fsdp"}
        assert {c["config"] for c in cases} == {"off", "teacache", "fbcache", "both"}
        assert {c["config"] for c in cases if c["cfg"] == 2} >= {"fbcache", "both"}
    for case in cases:
        # FSDP: the Linear weights of every block live split over the mesh; nothing else is
        assert (case["split_weights"] > 0) == (case["weights"] == "fsdp"), case
        assert case["rel_err"] < 1e-5, case
        assert case["trace_equal"], case
        assert case["loop_compiles"] == 0, case
        if case["config"] != "off":
            assert case["reused"] > 0, case  # the gate did skip, on reduced signals

    # one all-reduce per probe for every signal
    assert f["probe_signal_columns"] >= 2  # TeaCache and FBCache (tensor metric, with saliency)
    assert f["probe_collectives"].get("all-reduce") == 1
    assert f["traced_signal_psums"] == 1 == SIGNAL_PSUMS_PER_PROBE  # as the layout states
    # the blocks themselves talk through Ulysses all-to-all or gathered K/V, never all-reduce
    assert "all-reduce" not in f["middle_collectives"]
    assert f["middle_collectives"].get("all-to-all", 0) + f["middle_collectives"].get("all-gather", 0) > 0
    # split (FSDP) weights are gathered for each block: more all-gathers, still no all-reduce
    assert f["fsdp_middle_collectives"].get("all-gather", 0) > f["middle_collectives"].get("all-gather", 0)
    assert "all-reduce" not in f["fsdp_middle_collectives"]


def _cli(tmp_path, *args, devices=None):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"OMP_NUM_THREADS": "1"}
    if devices:
        env["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={devices} "
                            "--xla_backend_optimization_level=0")
    return subprocess.run([sys.executable, str(ROOT / "stage2_transformer_flax_deepcache.py"),
                           *args, "--no_progress", "--output_dir", "out"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)


def test_cli_runs_sequence_and_cfg_parallel_and_refuses_missing_devices(tmp_path, monkeypatch, capsys):
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
    # a flag check, before any model or device work: the command's main in this process
    from commands.stage2 import main
    monkeypatch.chdir(bad)
    assert main(["--cfg_parallel", "--cfg_mode", "separate", "--no_progress", "--output_dir", "out"]) == 2
    assert "--cfg_parallel" in capsys.readouterr().err
    assert list(bad.iterdir()) == []

"""Multi-host stage 2 (issue 24): two processes x 4 emulated CPU devices on localhost, joined by
jax.distributed with a local coordinator, through the real stage-2 command, against one process
with 8 emulated devices. Process 0 alone writes and prints; the latents are the same."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from sampling.stage_io import CONFIG, LATENTS, read_stage2

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--num_inference_steps", "2", "--sp_size", "4", "--cfg_parallel", "--enable_cache",
        "--compile_cache_dir", "none", "--no_progress"]


def _env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_hosts_sample_what_one_host_samples_and_only_process_0_writes(tmp_path):
    script = str(ROOT / "stage2_transformer_flax_deepcache.py")
    one = subprocess.run([sys.executable, script, *ARGS, "--output_dir", str(tmp_path / "one")],
                         env=_env(8), capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-2000:]

    address = f"127.0.0.1:{_port()}"
    out, telemetry = tmp_path / "two", tmp_path / "t.json"
    procs = [subprocess.Popen(
        [sys.executable, script, *ARGS, "--multihost", "--coordinator_address", address,
         "--num_processes", "2", "--process_id", str(i), "--output_dir", str(out),
         "--telemetry_json", str(telemetry)],
        env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-2000:]

    (stdout0, _), (stdout1, _) = results
    # one summary (gloo's own "[Gloo] Rank n is connected" lines go to stdout on every process)
    assert stdout0.count("stage 2:") == 1 and "stage 2:" not in stdout1 and "wrote" not in stdout1
    assert "2 hosts x 4 local" in stdout0
    assert sorted(os.listdir(out)) == [CONFIG, LATENTS]  # one pair
    assert sorted(os.listdir(tmp_path)) == ["one", "t.json", "two"]
    two_latents = read_stage2(str(out))[0]
    assert torch.equal(two_latents, read_stage2(str(tmp_path / "one"))[0])
    report = json.loads(telemetry.read_text())
    assert report["failsafes"] == {}
    assert report["compiles"]["loop"]["lowered"] == 0

"""Multi-host stage 2 (issue 24): two processes x 4 emulated CPU devices on localhost, joined by
jax.distributed with a local coordinator, through the real stage-2 command, against one process
with 8 emulated devices, both loading one checkpoint. Process 0 alone writes and prints; the
latents are the same; each process reads from the checkpoint only the rows its devices keep."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from modules.checkpoint import save_checkpoint
from modules.registry import build_model
from modules.safetensors_reader import read_headers
from sampling.stage_io import CONFIG, LATENTS, read_stage2
from tests.model_inputs import random_model

ROOT = Path(__file__).resolve().parents[1]
MODEL = "wan-tiny-ti2v"
ARGS = ["--model", MODEL, "--num_inference_steps", "1", "--sp_size", "4", "--cfg_parallel",
        "--enable_cache", "--compile_cache_dir", "none", "--no_progress"]
COUNTED = str(ROOT / "tests" / "counted_stage2.py")  # the command, its reads and compiles recorded


def cpu_env(devices: int) -> dict:
    # LLVM's cheapest code generation halves the compiles here; every run has it alike
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
                         "--xla_backend_optimization_level=0")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _merged(ranges) -> dict[str, list[tuple[int, int]]]:
    """file -> sorted, merged [begin, end) byte ranges."""
    out: dict[str, list[tuple[int, int]]] = {}
    for file, begin, end in sorted(ranges):
        spans = out.setdefault(file, [])
        if spans and begin <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], end))
        else:
            spans.append((begin, end))
    return out


def _own_rows(headers, process: int, processes: int = 2, devices: int = 8):
    """The byte ranges of the checkpoint that one process's devices keep: with FSDP over the
    8-device mesh, every 2-D block weight is split along dim 0 into 8 row blocks and a process
    holds the 4 of its own devices (process 0 the first half); everything else is whole on
    every device."""
    model = build_model(MODEL, meta=True)
    ranges = []
    for name, info in headers.items():
        row_bytes = math.prod(info.shape[1:]) * info.dtype.itemsize
        rows = info.shape[0]
        if model.block_of(name) is not None and len(info.shape) == 2:
            assert rows % devices == 0, name  # this model's block weights all split along dim 0
            share = rows // processes
            ranges.append((str(info.file), info.offset + process * share * row_bytes,
                           info.offset + (process + 1) * share * row_bytes))
        else:
            ranges.append((str(info.file), info.offset, info.offset + rows * row_bytes))
    return _merged(ranges)


def test_two_hosts_sample_what_one_host_samples_and_only_process_0_writes(tmp_path):
    ckpt = save_checkpoint(random_model(MODEL, std=0.2), tmp_path / "ckpt",
                           max_shard_bytes=64 * 1024)
    args = [*ARGS, "--model_path", str(ckpt)]
    reads = [tmp_path / f"reads{i}.json" for i in ("one", 0, 1)]
    one = subprocess.Popen([sys.executable, COUNTED, str(reads[0]), *args, "--output_dir",
                            str(tmp_path / "one")], env=cpu_env(8), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    address = f"127.0.0.1:{free_port()}"
    out, telemetry = tmp_path / "two", tmp_path / "t.json"
    procs = [subprocess.Popen(
        [sys.executable, COUNTED, str(reads[1 + i]), *args, "--multihost", "--coordinator_address",
         address, "--num_processes", "2", "--process_id", str(i), "--output_dir", str(out),
         "--telemetry_json", str(telemetry)],
        env=cpu_env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    results = [p.communicate(timeout=600) for p in (one, *procs)]
    for p, (_, err) in zip((one, *procs), results, strict=True):
        assert p.returncode == 0, err[-2000:]

    _, (stdout0, _), (stdout1, _) = results
    # one summary (gloo's own "[Gloo] Rank n is connected" lines go to stdout on every process)
    assert stdout0.count("stage 2:") == 1 and "stage 2:" not in stdout1 and "wrote" not in stdout1
    assert "2 hosts x 4 local" in stdout0
    assert sorted(os.listdir(out)) == [CONFIG, LATENTS]  # one pair
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "one", "reads0.json", "reads1.json",
                                            "readsone.json", "t.json", "two"]
    two_latents = read_stage2(str(out))[0]
    assert torch.equal(two_latents, read_stage2(str(tmp_path / "one"))[0])
    report = json.loads(telemetry.read_text())
    assert report["failsafes"] == {}
    assert report["compiles"]["loop"]["lowered"] == 0

    # each process read its own devices' rows of the checkpoint, each byte once, and no other
    headers = read_headers(sorted(ckpt.glob("*.safetensors")))
    assert len({info.file for info in headers.values()}) > 1  # shards with an index
    total = sum(math.prod(i.shape) * i.dtype.itemsize for i in headers.values())
    everything = _own_rows(headers, 0, processes=1)
    for path, expected in ((reads[0], everything), (reads[1], _own_rows(headers, 0)),
                           (reads[2], _own_rows(headers, 1))):
        done = [(file, offset, offset + n)
                for file, offset, n in json.loads(path.read_text())["reads"]]
        assert _merged(done) == expected, path.name
        assert sum(end - begin for _, begin, end in done) == sum(
            end - begin for spans in expected.values() for begin, end in spans), path.name
    split = sum(math.prod(i.shape) * i.dtype.itemsize for n, i in headers.items()
                if build_model(MODEL, meta=True).block_of(n) is not None and len(i.shape) == 2)
    assert split > total / 2  # most of the bytes: each process skipped a quarter of the file
    assert report["load"] == {**report["load"], "bytes_read": total - split // 2,
                              "checkpoint_bytes": total}


def _generate_two_hosts(out, prompts, *extra):
    procs = _two_hosts(out, prompts, *extra)
    results = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-2000:]
    return results


def _two_hosts(out, prompts, *extra) -> list[subprocess.Popen]:
    address = f"127.0.0.1:{free_port()}"
    return [subprocess.Popen(
        [sys.executable, str(ROOT / "generate.py"), "--prompts", str(prompts), "--output_dir",
         str(out), "--enable_cache", "--no_progress", "--num_inference_steps", "4",
         "--compile_cache_dir", "none", "--multihost", "--coordinator_address", address,
         "--num_processes", "2", "--process_id", str(i), "--cfg_parallel", *extra],
        env=cpu_env(1), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in (0, 1)]


def test_a_preempted_two_host_batch_resumes_as_one_host_does(tmp_path):
    """Process 0 reads what each prompt's folder holds and tells process 1: both skip the
    finished prompt and sample only the one whose latents are gone."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("red circle moves right on blue\ngreen square moves up on black\n"
                       "blue circle moves left on white\n")
    out = tmp_path / "out"
    _generate_two_hosts(out, prompts)
    videos = {d: (out / d / "output_video.mp4").read_bytes() for d in ("001", "002", "003")}
    # as a preemption leaves it: the 2nd prompt decoded from its latents next time, the 3rd
    # sampled again from its embeddings
    (out / "002" / "output_video.mp4").unlink()
    config = json.loads((out / "003" / CONFIG).read_text())
    (out / "003" / "output_video.mp4").unlink()
    (out / "003" / LATENTS).unlink()
    stage1 = {k: v for k, v in config.items() if k in ("model", "height", "width", "video_length",
                                                       "prompt", "negative_prompt", "request_id")}
    (out / "003" / CONFIG).write_text(json.dumps(stage1))
    (_, err0), (_, err1) = _generate_two_hosts(out, prompts)
    assert "resuming: 1 of 3 prompt(s) skipped (their video is there), 1 decoded from their " \
           "latents, 1 sampled from their embeddings" in err0, err0
    assert "resuming" not in err1  # process 0 alone prints
    assert {d: (out / d / "output_video.mp4").read_bytes() for d in ("001", "002", "003")} == videos


def test_a_two_host_slice_is_one_worker_of_a_shared_list(tmp_path):
    """Issue 62: a slice beside a one-process worker on one prompt list: the slice's process 0
    claims for it and tells process 1 which prompt comes next; each prompt is made once."""
    import re
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"{c} {s} moves {m} on black\n" for c in ("red", "green")
                               for s in ("circle", "square") for m in ("left", "right")))
    out = tmp_path / "out"
    slice_ = _two_hosts(out, prompts)
    # the one-process worker joins once the slice samples its first prompt (then holds its claim)
    seen = []
    for line in slice_[0].stderr:
        seen.append(line)
        if "stage 2 sampling" in line:
            break
    single = subprocess.Popen(
        [sys.executable, str(ROOT / "generate.py"), "--prompts", str(prompts), "--output_dir",
         str(out), "--enable_cache", "--no_progress", "--num_inference_steps", "4",
         "--compile_cache_dir", "none", "--cfg_parallel"],
        env=cpu_env(2), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (_, rest0), (_, err1) = [p.communicate(timeout=600) for p in slice_]
    err0 = "".join(seen) + rest0
    _, err = single.communicate(timeout=600)
    for p, log in zip((*slice_, single), (err0, err1, err), strict=True):
        assert p.returncode == 0, log[-2000:]
    made = [int(m.group(1)) for log in (err0, err)
            for m in re.finditer(r"^\[(\d+)/8\] stage 3 [\d.]+ s", log, re.M)]
    assert sorted(made) == list(range(1, 9)), (made, err0[-1500:], err[-1500:])
    assert re.search(r"^\[\d+/8\] stage 3 [\d.]+ s", err0, re.M)  # the slice made some
    assert "stage" not in err1  # process 1 samples with process 0 and prints nothing
    index = json.loads((out / "index.json").read_text())
    assert index["done"] == index["of"] == 8


def test_a_mesh_that_leaves_a_host_without_work_is_one_line(tmp_path):
    """Was: a traceback from JAX placing weights on a host with no device in the mesh."""
    address = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(
        [sys.executable, str(ROOT / "stage2_transformer_flax_deepcache.py"), "--model", MODEL,
         "--num_inference_steps", "1", "--compile_cache_dir", "none", "--no_progress",
         "--multihost", "--coordinator_address", address, "--num_processes", "2", "--process_id",
         str(i), "--output_dir", str(tmp_path / "out")],
        env=cpu_env(1), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in (0, 1)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], results
    err = results[0][1]
    assert "Traceback" not in err and "sp=1 x cfg=1 covers 1: expected sp x cfg = 2" in err, err
    assert not (tmp_path / "out").exists()

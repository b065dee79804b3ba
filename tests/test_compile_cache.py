"""A second run with the persistent compilation cache compiles nothing: stage 2 and stage 3 on the
tiny default model, one process each, and the whole job on two processes. Each run is a fresh process;
`compiled` is what the XLA compiler compiled in it, not served by the cache (tpu/compile.py), so
the first run's count is above 0 and the second's is 0. Every compile of a first run leaves one
entry in the folder (none is skipped by JAX's size or compile-time thresholds, none by process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.test_multihost import COUNTED, ROOT, cpu_env, free_port

STAGE2 = [sys.executable, str(ROOT / "stage2_transformer_flax_deepcache.py"), "--enable_cache",
          "--num_inference_steps", "2", "--no_progress"]
STAGE3 = [sys.executable, str(ROOT / "stage3_vae_decode.py"), "-q"]


def _run(argv, report):
    """The process's report (its telemetry or summary JSON) after it ran argv."""
    done = subprocess.run([*argv, str(report)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def stage2_twice(tmp_path_factory):
    """(the two runs' reports, the first run's folder, the cache folder)."""
    tmp = tmp_path_factory.mktemp("stage2")
    cache = tmp / "jax-cache"
    reports = [_run([*STAGE2, "--compile_cache_dir", str(cache), "--output_dir", str(tmp / f"out{i}"),
                     "--telemetry_json"], tmp / f"t{i}.json") for i in (1, 2)]
    return reports, tmp / "out1", cache


def _entries(cache) -> int:
    return len(os.listdir(cache))


def test_a_second_stage2_run_compiles_nothing(stage2_twice):
    (first, second), _, cache = stage2_twice
    compiled = [r["compiles"]["process"]["compiled"] for r in (first, second)]
    assert compiled[0] > 0 and compiled[1] == 0, compiled
    assert _entries(cache) == compiled[0]  # each compile written once, by the first run
    assert second["compiles"]["process"]["cache_hits"] == first["compiles"]["process"]["backend"]


def test_a_second_stage3_run_compiles_nothing(stage2_twice, tmp_path):
    """On stage 2's latents, into stage 2's cache folder (as the default folder is shared)."""
    _, latents, cache = stage2_twice
    before = _entries(cache)
    reports = [_run([*STAGE3, "--input_dir", str(latents), "--output_dir", str(tmp_path / f"v{i}"),
                     "--compile_cache_dir", str(cache), "--summary_json"], tmp_path / f"s{i}.json")
               for i in (1, 2)]
    compiled = [r["compiles"]["process"]["compiled"] for r in reports]
    assert compiled[0] > 0 and compiled[1] == 0, compiled
    assert _entries(cache) == before + compiled[0]
    assert reports[1]["compiles"]["loop"]["backend"] == 0


def _two_processes(tmp_path, run, args) -> list[dict]:
    """Each process's compile counts, of tests/counted_stage2.py on `args` and the multi-host
    flags, on 2 processes x 1 CPU device."""
    address = f"127.0.0.1:{free_port()}"
    records = [tmp_path / f"{run}-{i}.json" for i in (0, 1)]
    procs = [subprocess.Popen(
        [sys.executable, COUNTED, str(records[i]), *args, "--multihost", "--coordinator_address",
         address, "--num_processes", "2", "--process_id", str(i)],
        env=cpu_env(1), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in (0, 1)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-2000:]
    return [json.loads(r.read_text())["compiles"] for r in records]


def _two_process_job(tmp_path, cache, run):
    """(each process's compile counts, process 0's summary) of the whole job (stages 1 to 3,
    `generate`) on 2 processes (CFG parallel), one prompt; process 0 decodes."""
    summary = tmp_path / f"{run}-summary.json"
    compiles = _two_processes(tmp_path, run, [
        "generate", "--prompt", "red circle moves right on blue", "--enable_cache",
        "--num_inference_steps", "2", "--no_progress", "--cfg_parallel", "--compile_cache_dir",
        str(cache), "--output_dir", str(tmp_path / run), "--summary_json", str(summary)])
    assert (tmp_path / run / "output_video.mp4").is_file()
    return compiles, json.loads(summary.read_text())


def test_a_second_two_process_job_compiles_nothing_in_stage2_or_stage3(tmp_path):
    """The whole job on two processes: the second run compiles nothing on either process, the
    decode's programs included. JAX writes the cache from process 0 alone; on CPU every key is
    the process's own (its CPU topology fingerprint is in it), so process 1 writes its entries
    itself (tpu.compile write_own_entries): one entry for each compile of either process. (Was:
    1 a process, the programs the processes agree on each prompt's state with, compiled before
    stage 2 turned the cache on.)"""
    cache = tmp_path / "jax-cache"
    first, summary = _two_process_job(tmp_path, cache, "first")
    assert all(c["compiled"] > 0 for c in first), first
    assert summary["stage3"][0]["compiles"]["prepare"]["compiled"] > 0, summary["stage3"]
    assert _entries(cache) == sum(c["compiled"] for c in first)
    second, summary = _two_process_job(tmp_path, cache, "second")
    assert [c["compiled"] for c in second] == [0, 0], second
    assert summary["stage3"][0]["compiles"]["prepare"]["compiled"] == 0, summary["stage3"]


def test_the_own_entries_writer_takes_both_jax_signatures(monkeypatch):
    """JAX's private _cache_write took host_callbacks last up to 0.10 and dropped it in 0.11
    (the GPU machine's): the wrapper passes on whatever it was given, and a process other than
    0 writes its own entry unless the program has host callbacks (which 0.10 never caches)."""
    from tpu import compile as tc
    given, put = [], []
    monkeypatch.setattr(tc.jax, "process_index", lambda: 1)
    monkeypatch.setattr(tc, "_own_key", lambda backend, devices: True)
    monkeypatch.setattr(tc.jax_compilation_cache, "put_executable_and_time",
                        lambda key, *rest: put.append(key))
    write = tc._writing_own_entries(lambda *args: given.append(args))
    write("k11", 1.0, "m", "b", "e")  # jax 0.11
    write("k10", 1.0, "m", "b", "e", ())  # jax 0.10, no host callbacks
    write("k10cb", 1.0, "m", "b", "e", ("callback",))  # jax 0.10: never cached
    assert given == [("k11", 1.0, "m", "b", "e"), ("k10", 1.0, "m", "b", "e", ()),
                     ("k10cb", 1.0, "m", "b", "e", ("callback",))]
    assert put == ["k11", "k10"]

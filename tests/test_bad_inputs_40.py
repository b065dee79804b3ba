"""Issue 40: inputs and hosts that ended in a traceback, an XLA abort or a trusted lie now end in
one line saying what was wrong and what to do, exit 2, with nothing partial left behind: --multihost
off a TPU slice without a coordinator, a full disk under safetensors, a full disk under JAX's
compile cache (a warning there: the run goes on, and no cut entry is left for other hosts), XLA_FLAGS
that XLA cannot read. (Its budget profiles: tests/test_profile_validation.py.)

Commands run in this process where they can; in a child where JAX would abort or must start fresh
(XLA_FLAGS, jax.distributed)."""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
import warnings

import pytest

import stage2_transformer_flax_deepcache as stage2
from sampling import stage_io
from tests.test_refusals import ROOT, listing, refused, snapshot

STAGE2 = str(ROOT / "stage2_transformer_flax_deepcache.py")
TORCH = ["--backend", "torch", "--num_inference_steps", "2", "--no_progress", "--compile_cache_dir",
         "none"]


def child(argv, cwd, **env):
    """stage 2 in a fresh process: (exit status, stdout, stderr)."""
    environ = dict(os.environ, JAX_PLATFORMS="cpu", **env)
    for name in ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "RANK"):
        environ.pop(name, None)  # no cluster for JAX to find the job's layout in
    out = subprocess.run([sys.executable, STAGE2, *argv], cwd=cwd, env=environ,
                         capture_output=True, text=True, timeout=300)
    return out.returncode, out.stdout, out.stderr


def refused_in_a_child(argv, cwd, needles, **env):
    code, out, err = child(argv, cwd, **env)
    assert code == 2 and out == "", (code, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


# --- 1. --multihost off a TPU slice, no coordinator -------------------------------------------------

def test_multihost_without_a_coordinator_off_a_tpu_slice_is_one_line(tmp_path):
    """Was: jax.distributed.initialize's `ValueError: coordinator_address should be defined.`"""
    refused_in_a_child(["--multihost", "--num_inference_steps", "1", "--compile_cache_dir", "none",
                        "--no_progress", "--output_dir", "out"], tmp_path,
                       ["stage2_transformer_flax_deepcache.py: error: --multihost: JAX found no "
                        "coordinator address: this host is not a TPU slice",
                        "pass --coordinator_address HOST:PORT, --num_processes N and --process_id "
                        "I on every host, or run on a TPU slice"])
    assert listing(tmp_path) == []


# --- 2. a full disk under the stage pair's tensors -----------------------------------------------

def test_a_full_disk_under_the_tensors_write_is_one_line_and_keeps_the_previous_pair(
        tmp_path, monkeypatch, capsys):
    """Was: `safetensors_rust.SafetensorError: ... No space left on device` as a traceback
    (safetensors' save_file wrote its own temporary file; our own write raises the OSError)."""
    argv = [*TORCH, "--output_dir", str(tmp_path / "out")]
    assert stage2.main(argv) == 0
    before = snapshot(tmp_path)

    class Full:  # half the bytes land, then the disk is full
        def __init__(self, path):
            self.f = open(path, "wb")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_for_the_latents(path, mode="r", *args, **kwargs):  # temporaries carry the name
        if "stage2_latents" in str(path) and "b" in mode and "w" in mode:
            return Full(path)
        return open(path, mode, *args, **kwargs)
    monkeypatch.setattr(stage_io, "open", full_for_the_latents, raising=False)
    refused(stage2.main, [*argv, "--seed", "7"], capsys,
            f"could not write stage2_latents.safetensors and generation_config.json in "
            f"{tmp_path / 'out'}: No space left on device (the disk is full); nothing was written, "
            "and files of earlier runs are as they were")
    assert snapshot(tmp_path) == before


# --- 3. a full disk under JAX's persistent compile cache ----------------------------------------

@pytest.fixture
def compile_cache(tmp_path):
    """tpu.compile.enable_compile_cache on a folder of this test; JAX's cache as it was after."""
    import jax
    from jax._src import compilation_cache

    from tpu.compile import enable_compile_cache
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_entry_size_bytes",
             "jax_persistent_cache_min_compile_time_secs")
    before = {name: getattr(jax.config, name) for name in names}
    compilation_cache.reset_cache()
    folder = tmp_path / "jax-cache"
    enable_compile_cache(str(folder))
    yield folder
    compilation_cache.reset_cache()
    for name, value in before.items():
        jax.config.update(name, value)


def test_a_full_disk_under_the_compile_cache_leaves_no_cut_entry_and_the_run_goes_on(
        compile_cache, monkeypatch):
    """Was: JAX writes an entry in place, and a full disk left it 0 bytes or cut, under its final
    name, for the other hosts sharing the folder to read."""
    import jax
    import jax.numpy as jnp
    real_open = io.open  # what pathlib's write_bytes opens files with (JAX's and ours)

    def disk_full(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if "w" in mode and str(file).startswith(str(compile_cache)):
            write = f.write

            def half(data):
                write(bytes(memoryview(data)[: len(data) // 2]))
                f.flush()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            f.write = half
        return f

    monkeypatch.setattr(io, "open", disk_full)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert jax.jit(lambda x: x * 2 + 1)(jnp.arange(3.0)).tolist() == [1.0, 3.0, 5.0]
    assert any("No space left on device" in str(w.message) for w in caught), caught
    assert os.listdir(compile_cache) == []  # no entry, no temporary file
    monkeypatch.setattr(io, "open", real_open)
    assert jax.jit(lambda x: x * 3 + 1)(jnp.arange(3.0)).tolist() == [1.0, 4.0, 7.0]
    entries = {name: (compile_cache / name).stat().st_size for name in os.listdir(compile_cache)}
    assert entries and all(name.endswith("-cache") and size > 0 for name, size in entries.items())


def test_temporary_entries_a_kill_left_are_removed_once_stale(tmp_path):
    from tpu.compile import remove_empty_entries
    (tmp_path / ".jit_a-cache.0123.part").write_bytes(b"cut")
    (tmp_path / ".jit_b-cache.4567.part").write_bytes(b"being written by another host")
    os.utime(tmp_path / ".jit_a-cache.0123.part", (0, 0))
    assert remove_empty_entries(str(tmp_path)) == 1
    assert os.listdir(tmp_path) == [".jit_b-cache.4567.part"]


# --- 4. XLA_FLAGS that XLA cannot read ----------------------------------------------------------

@pytest.mark.parametrize("flags, needles", [
    ("garbage", ["XLA_FLAGS='garbage': expected flags, --name or --name=value",
                 "there is no file 'garbage'", "fix or unset XLA_FLAGS"]),
    ("--no_such_flag", ["XLA_FLAGS: XLA does not know --no_such_flag", "fix or unset XLA_FLAGS"]),
    ("--xla_backend_optimization_level=abc",
     ["XLA_FLAGS: XLA cannot read it (Couldn't interpret value abc for flag "
      "xla_backend_optimization_level)", "fix or unset XLA_FLAGS"]),
    ("--xla_dump_to /tmp/x", ["XLA_FLAGS: '/tmp/x' is no flag; expected --name or --name=value "
                              "(a value joins its flag with =)"]),
], ids=["not a flag", "unknown flag", "bad value", "a value apart from its flag"])
def test_xla_flags_xla_cannot_read_are_one_line_before_jax_starts(tmp_path, flags, needles):
    """Was: a fatal XLA log line and exit 1 as JAX started its backend."""
    refused_in_a_child(["--num_inference_steps", "1", "--compile_cache_dir", "none", "--no_progress",
                        "--output_dir", "out"], tmp_path, needles, XLA_FLAGS=flags)
    assert listing(tmp_path) == []


def test_xla_flags_are_not_asked_of_a_torch_run(tmp_path, monkeypatch, capsys):
    """The torch backend never starts XLA: whatever XLA_FLAGS holds, it runs."""
    monkeypatch.setenv("XLA_FLAGS", "garbage")
    assert stage2.main([*TORCH, "--output_dir", str(tmp_path / "out")]) == 0

"""SIGINT/SIGTERM in the middle of stage 2's loop, of its write, or of stage 3's encoding ends in
one line, leaves no partial or temporary file, and leaves the previous outputs as they were; two
stage-2 runs writing one folder at once leave one run's pair, never a mix (issue 16).

Each case is a child process held at a known point by tests/interrupt_child.py (a few seconds
each on the torch backend)."""

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sampling.pipelines import get_pipeline
from sampling.stage_io import VIDEO, read_stage2, write_stage2

ROOT = Path(__file__).resolve().parents[1]
CHILD = str(ROOT / "tests" / "interrupt_child.py")


def start(stage, hold, folder, *argv):
    return subprocess.Popen([sys.executable, CHILD, stage, hold, str(folder), "--", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=folder)


def wait_for(proc, word, timeout=180.0):
    """Read the child's stdout until a line equal to `word`."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=0.5):
            line = proc.stdout.readline()
            if line.strip() == word:
                return
            if line == "":
                raise AssertionError(f"the child ended before {word!r}: {proc.wait()} "
                                     f"{proc.stderr.read()[-3000:]}")
    proc.kill()
    raise AssertionError(f"no {word!r} from the child in {timeout} s")


def snapshot(path):
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir())}


def previous_outputs(folder: Path) -> None:
    """A finished earlier run: latents of the tiny HunyuanVideo-1.5, its config, a video."""
    pipe = get_pipeline("hunyuanvideo-tiny")
    h, w, f = pipe.size
    latents = torch.randn(pipe.latent_shape(h, w, f), generator=torch.Generator().manual_seed(1))
    write_stage2(str(folder), latents, {"model": pipe.name, "seed": 1},
                 {"model": pipe.name, "height": h, "width": w, "video_length": f, "seed": 1})
    (folder / VIDEO).write_bytes(b"the previous video")


@pytest.mark.parametrize("stage, hold, sig", [
    ("stage2", "loop", signal.SIGINT),
    ("stage2", "loop", signal.SIGTERM),
    ("stage2", "payload", signal.SIGTERM),
    ("stage3", "encode", signal.SIGTERM),
])
def test_an_interruption_ends_in_one_line_and_leaves_the_previous_outputs(tmp_path, stage, hold, sig):
    out = tmp_path / "out"
    out.mkdir()
    previous_outputs(out)
    before = snapshot(out)
    argv = (["--backend", "torch", "--num_inference_steps", "8", "--output_dir", str(out)]
            if stage == "stage2" else ["--input_dir", str(out)])
    proc = start(stage, hold, tmp_path, *argv)
    try:
        wait_for(proc, "held")
        if hold != "loop":  # the temporary file is there now, beside the previous outputs
            assert len(os.listdir(out)) > len(before)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err[-3000:]
    script = "stage2_transformer_flax_deepcache.py" if stage == "stage2" else "stage3_vae_decode.py"
    assert err.strip().splitlines() == [
        f"{script}: interrupted by {sig.name}; no partial output was left (files of earlier runs "
        "are as they were)"], err[-3000:]
    assert snapshot(out) == before


def test_two_runs_writing_one_folder_at_once_leave_one_runs_pair(tmp_path):
    """Run A holds its output folder and pauses 2 s between renaming its latents in and its
    config. A second stage-2 run into the folder is refused up front, naming A; a writer that
    goes around the commands (write_stage2 itself) waits on the folder's commit lock and lands
    after A, as one pair. Without these B's pair landed inside A's, and A's config then paired
    with B's latents."""
    out = tmp_path / "out"
    (tmp_path / "a").mkdir()
    a = start("stage2", "half", tmp_path / "a", "--model", "hunyuanvideo-tiny", "--backend",
              "torch", "--num_inference_steps", "4", "--seed", "11", "--output_dir", str(out),
              "--no_progress")
    try:
        wait_for(a, "ready")
        b = subprocess.run([sys.executable, str(ROOT / "stage2_transformer_flax_deepcache.py"),
                            "--model", "hunyuanvideo-tiny", "--backend", "torch",
                            "--num_inference_steps", "4", "--seed", "22", "--output_dir", str(out),
                            "--no_progress"], capture_output=True, text=True, cwd=ROOT)
        assert b.returncode == 2 and b.stderr.count("\n") == 1, b.stderr
        assert f"--output_dir {out} is being written by another run (pid {a.pid}" in b.stderr
        (tmp_path / "a" / "go").touch()
        wait_for(a, "half")
        pipe = get_pipeline("hunyuanvideo-tiny")
        h, w, f = pipe.size
        write_stage2(str(out), torch.zeros(pipe.latent_shape(h, w, f)), {"seed": 33},
                     {"model": pipe.name, "seed": 33})  # blocks until A's commit is whole
        _, err = a.communicate(timeout=120)
        assert a.returncode == 0, err[-3000:]
    finally:
        a.kill()
    _, metadata, config = read_stage2(str(out))
    assert metadata["seed"] == str(config["seed"]) == "33"  # after A's pair, as one pair
    assert sorted(os.listdir(out)) == ["generation_config.json", "stage2_latents.safetensors"]

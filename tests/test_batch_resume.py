"""Long prompt batches that survive: each prompt's video is final as soon as it is decoded, a rerun
of the same command skips what is done and resumes what was in flight (killed with SIGKILL at
several points, as a preempted VM is), a changed request is redone, and one run writes into an
output folder at a time (a killed run's hold is taken over)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commands import generate, stage1, stage2
from commands.resume import DECODE, DONE, ENCODE, REQUEST, SAMPLE, folder_state
from sampling.errors import StageFileError
from sampling.one_writer import LOCK, one_writer
from sampling.stage_io import CONFIG, LATENTS, VIDEO, read_config
from tests.test_refusals import refused
from tests.test_stage3 import read_video

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["red circle moves right on blue", "green square moves up on black",
           "blue circle moves left on white", "white square moves down on red"]
FLAGS = ["--enable_cache", "--no_progress"]


def _prompts(tmp_path, lines=PROMPTS) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(prompts, out, *extra, summary=None):
    argv = ["--prompts", str(prompts), "--output_dir", str(out), *FLAGS, *extra]
    if summary is not None:
        argv += ["--summary_json", str(summary)]
    assert generate.main(argv) == 0
    return json.loads(Path(summary).read_text()) if summary is not None else None


def _videos(out, n) -> dict[str, bytes]:
    return {f"{i + 1:03d}": (out / f"{i + 1:03d}" / VIDEO).read_bytes() for i in range(n)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The four prompts in one uninterrupted run: what every resumed batch must end with."""
    work = tmp_path_factory.mktemp("reference")
    out = work / "out"
    report = _run(_prompts(work), out, summary=work / "s.json")
    assert report["states"] == [ENCODE] * 4
    return out, _videos(out, 4)


def test_a_rerun_skips_every_finished_prompt_and_redoes_a_changed_one(reference, tmp_path):
    out, videos = reference
    case = tmp_path / "out"
    os.system(f"cp -r {out} {case}")
    lines = list(PROMPTS)
    lines[2] = "yellow circle moves up on black"  # the third line changed; its seed did not
    report = _run(_prompts(tmp_path, lines), case, summary=tmp_path / "s.json")
    assert report["states"] == [DONE, DONE, ENCODE, DONE]
    assert [r is None for r in report["stage2"]] == [True, True, False, True]  # sampled once
    assert _videos(case, 4)["001"] == videos["001"] and _videos(case, 4)["003"] != videos["003"]
    assert read_config(str(case / "003"))["prompt"] == lines[2]
    # another seed is another request for every prompt; --overwrite redoes the same request
    assert _run(_prompts(tmp_path, lines), case, "--seed", "5",
                summary=tmp_path / "s.json")["states"] == [ENCODE] * 4
    assert _run(_prompts(tmp_path, lines), case, "--seed", "5", "--overwrite",
                summary=tmp_path / "s.json")["states"] == [ENCODE] * 4
    assert _run(_prompts(tmp_path, lines), case, "--seed", "5",
                summary=tmp_path / "s.json")["states"] == [DONE] * 4


def test_what_a_folder_still_needs_is_read_from_its_files(reference, tmp_path):
    out, videos = reference
    case = tmp_path / "out"
    os.system(f"cp -r {out} {case}")
    report = _run(_prompts(tmp_path), case, summary=tmp_path / "s.json")
    assert report["states"] == [DONE] * 4
    config = read_config(str(case / "001"))
    request = config[REQUEST]
    assert folder_state(str(case / "001"), request, compare=False) == DONE
    assert folder_state(str(case / "001"), request, compare=True) == ENCODE  # no uncached video
    assert folder_state(str(case / "001"), "another request", compare=False) == ENCODE
    assert folder_state(str(tmp_path / "missing"), request, compare=False) == ENCODE
    (case / "002" / VIDEO).unlink()
    # stage 3's config says the video is there; with the video gone the latents are decoded
    assert folder_state(str(case / "002"), read_config(str(case / "002"))[REQUEST],
                        compare=False) == DECODE
    report = _run(_prompts(tmp_path), case, summary=tmp_path / "s.json")
    assert report["states"] == [DONE, DECODE, DONE, DONE]
    assert _videos(case, 4) == videos


# --- SIGKILL mid-batch, then the same command again ----------------------------------------------

def _killed_after(prompts, out, line: str, delay: float) -> None:
    """Start the command, SIGKILL it `delay` s after stderr shows `line`."""
    child = subprocess.Popen(
        [sys.executable, str(ROOT / "generate.py"), "--prompts", str(prompts), "--output_dir",
         str(out), *FLAGS], cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        for text in child.stderr:
            if text.startswith(line):
                time.sleep(delay)
                break
        child.send_signal(signal.SIGKILL)
        child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL, "the run ended before it was killed"


@pytest.mark.parametrize("line, delay", [
    ("[2/4] stage 1", 0.0),  # while encoding
    ("[2/4] stage 3 decoding", 0.0),  # latents of the 2nd prompt written, its decode in flight
    ("[2/4] stage 3", 0.0),  # the 2nd video final
    ("[3/4] stage 2", 0.05),  # somewhere in the third prompt's decode or the fourth's sampling
])
def test_a_batch_killed_mid_run_resumes_where_it_stopped(reference, tmp_path, line, delay):
    out, videos = reference
    prompts, case = _prompts(tmp_path), tmp_path / "out"
    _killed_after(prompts, case, line, delay)
    finished = [i for i in range(4) if (case / f"{i + 1:03d}" / VIDEO).exists()]
    before = {i: (case / f"{i + 1:03d}" / VIDEO).read_bytes() for i in finished}
    report = _run(prompts, case, summary=tmp_path / "s.json")
    states = report["states"]
    assert all(states[i] == DONE for i in finished), states  # finished prompts are not redone
    # at most the prompt in flight is sampled again: the ones before it were done or decoded
    in_flight = len(finished)
    assert all(s in (DONE, DECODE) for s in states[:in_flight]), states
    assert sum(r is not None for r in report["stage2"]) <= 4 - in_flight
    assert _videos(case, 4) == videos  # the same videos an uninterrupted run makes
    for i, data in before.items():
        assert _videos(case, 4)[f"{i + 1:03d}"] == data
    for i in range(4):
        frames, _ = read_video(case / f"{i + 1:03d}" / VIDEO)
        assert frames.shape[0] > 0
    assert not (case / LOCK).exists()  # the killed run's hold was taken over, then let go
    if line == "[2/4] stage 3 decoding":
        assert SAMPLE not in states[:1] and states[1] in (DECODE, DONE), states


# --- one writer per folder ---------------------------------------------------------------------

HOLD = ("import sys, time\n"
        "from sampling.one_writer import one_writer\n"
        "with one_writer(sys.argv[1]):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(120)\n")


def _holder(folder):
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_second_writer_into_a_folder_is_refused_and_a_killed_ones_hold_taken_over(
        tmp_path, capsys):
    out = tmp_path / "out"
    holder = _holder(out)
    try:
        err = refused(generate.main, ["--prompt", PROMPTS[0], "--output_dir", str(out), *FLAGS],
                      capsys, f"--output_dir {out} is being written by another run",
                      f"pid {holder.pid}", "wait for that run to end")
        assert "Traceback" not in err
        # the stage commands alike
        refused(stage1.main, ["--prompt", PROMPTS[0], "--output_dir", str(out)], capsys,
                f"--output_dir {out} is being written by another run", f"pid {holder.pid}")
        refused(stage2.main, ["--output_dir", str(out), "--num_inference_steps", "2",
                              "--no_progress"], capsys,
                f"--output_dir {out} is being written by another run", f"pid {holder.pid}")
        assert os.listdir(out) == [LOCK]  # nothing of the refused runs
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (out / LOCK).exists()  # the killed run's file stays; its lock went with it
    assert generate.main(["--prompt", PROMPTS[0], "--output_dir", str(out), *FLAGS]) == 0
    assert sorted(os.listdir(out)) == sorted([CONFIG, VIDEO, "stage1_embeddings.safetensors",
                                              "stage2_latents.safetensors"])


def test_a_run_into_a_subfolder_of_a_running_batch_is_refused(tmp_path, capsys):
    """Issue 62: `generate.py --output_dir conc/010` beside a batch writing conc was let in, and
    the batch then published that run's video as its own prompt's. The batch's hold covers its
    folder's tree; a batch still writes its own subfolders."""
    out = tmp_path / "conc"
    holder = _holder(out)
    try:
        refused(generate.main, ["--prompt", PROMPTS[0], "--output_dir", str(out / "010"),
                                *FLAGS], capsys, f"--output_dir {out / '010'} is inside {out}, "
                "which another run is writing", f"pid {holder.pid}")
        assert os.listdir(out) == [LOCK]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with one_writer(str(out)):  # this process's own hold: its subfolders are its own to write
        with one_writer(str(out / "010")):
            pass


def test_a_prompt_whose_folder_another_request_wrote_is_not_published(tmp_path):
    """Checked on read-back, not only at start: the embeddings or latents a batch reads back
    must carry its own request id."""
    folder = tmp_path / "010"
    folder.mkdir()
    (folder / CONFIG).write_text(json.dumps({REQUEST: "someone-else"}))

    class Job:
        pass
    job = Job()
    job.folder, job.id = str(folder), "mine"
    with pytest.raises(StageFileError, match="its stage2_latents.safetensors are another "
                                             "request's .* nothing of that prompt is published"):
        generate.own_config(job, LATENTS)
    job.id = "someone-else"
    assert generate.own_config(job, LATENTS)[REQUEST] == "someone-else"


def test_a_hold_ends_with_its_run_and_leaves_no_folder_it_made_empty(tmp_path):
    folder = tmp_path / "a" / "b"
    with one_writer(str(folder)):
        assert os.listdir(folder) == [LOCK]
        with pytest.raises(Exception, match="is being written by another run"):
            with one_writer(str(folder)):
                pass
    assert not (tmp_path / "a").exists()
    folder.mkdir(parents=True)
    (folder / "kept").write_text("x")
    with one_writer(str(folder)):
        pass
    assert os.listdir(folder) == ["kept"]


# --- speech to video through the one-process command -------------------------------------------

def test_speech_to_video_writes_its_mp4_and_resumes_like_any_pipeline(tmp_path):
    import numpy as np
    import soundfile as sf
    from PIL import Image

    rng = np.random.default_rng(0)
    sf.write(tmp_path / "speech.wav", (0.3 * np.sin(np.arange(16000) / 16000 * 2 * np.pi * 220)
                                       ).astype(np.float32), 16000)
    Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(tmp_path / "face.png")
    out = tmp_path / "out"
    argv = ["--model", "wan-tiny-s2v", "--audio", str(tmp_path / "speech.wav"), "--image",
            str(tmp_path / "face.png"), "--prompt", "a person talks", "--output_dir", str(out),
            *FLAGS, "--summary_json", str(tmp_path / "s.json")]
    assert generate.main(argv) == 0
    frames, _ = read_video(out / VIDEO)
    config = read_config(str(out))
    assert config["model"] == "wan-tiny-s2v" and config["num_clips"] >= 1
    assert frames.shape[0] == config["video_frames"] > 0
    report = json.loads((tmp_path / "s.json").read_text())
    speed = report["stage2"][0]["speedup"]
    assert speed["estimated"] is not None and speed["schedule_ideal"] > 1
    assert generate.main(argv) == 0  # the same request again: nothing redone
    assert json.loads((tmp_path / "s.json").read_text())["states"] == [DONE]
    (tmp_path / "speech.wav").write_bytes((tmp_path / "speech.wav").read_bytes()[:-2000])
    assert generate.main(argv) == 0  # another recording at the same path is another request
    assert json.loads((tmp_path / "s.json").read_text())["states"] == [ENCODE]

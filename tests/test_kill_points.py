"""kill -9 at every write and rename point of stage 2, stage 3 and calibrate (issue 23).

A forked child runs the real command; from the moment the command starts writing its outputs,
every call that writes or renames a file (temporary files made, payloads and JSON written,
fsync, rename, remove) counts as a point, and the child kills itself with SIGKILL before point n,
for n = 0, 1, ... until a run passes every point. After each kill, the folder must read as the
old outputs or the new ones, whole (the reader recovers what the kill left), and the next run
must succeed and leave no temporary file.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import tempfile

from commands import calibrate, stage2, stage3
from sampling import calibration, stage_io
from sampling.stage_io import CONFIG, LATENTS, VIDEO, read_stage2

FORK = multiprocessing.get_context("fork")


def _arm_and_run(point: int, command, argv, writer_module, writer_name) -> None:
    """Child: count write/rename calls once `writer_name` starts; SIGKILL before call `point`."""
    import torch
    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork(): run inline
    calls = {"armed": False, "n": 0}

    def counted(fn):
        def call(*args, **kwargs):
            if calls["armed"]:
                if calls["n"] == point:
                    os.kill(os.getpid(), signal.SIGKILL)
                calls["n"] += 1
            return fn(*args, **kwargs)
        return call

    for module, name in ((os, "replace"), (os, "remove"), (os, "rmdir"), (os, "fsync"),
                         (os, "makedirs"), (tempfile, "mkstemp"), (tempfile, "mkdtemp"),
                         (json, "dump"), (stage_io, "write_tensors"), (shutil, "rmtree")):
        setattr(module, name, counted(getattr(module, name)))
    writer = getattr(writer_module, writer_name)

    def armed(*args, **kwargs):
        calls["armed"] = True
        return writer(*args, **kwargs)
    setattr(writer_module, writer_name, armed)
    os._exit(command(argv))


def killed_at(point, command, argv, writer_module, writer_name) -> bool:
    """Run the command in a child killed before write point `point`; False if it finished."""
    child = FORK.Process(target=_arm_and_run,
                         args=(point, command, argv, writer_module, writer_name))
    child.start()
    child.join(120)
    if child.exitcode == 0:
        return False
    assert child.exitcode == -signal.SIGKILL, f"the child ended with {child.exitcode}"
    return True


def leftovers(*folders) -> list[str]:
    """Temporary files (ours start with a dot) and journals anywhere under the folders."""
    found = []
    for folder in folders:
        for root, dirs, files in os.walk(folder):
            found += [os.path.join(root, n) for n in dirs + files if n.startswith(".")]
    return found


def each_point(tmp_path, old, command, new_argv, module, name, check):
    """Copy the old outputs, kill the new run at point n, check; n = 0, 1, ... to the end."""
    point = 0
    while True:
        case = tmp_path / f"kill{point}"
        shutil.copytree(old, case)
        argv = [a.replace(str(old), str(case)) for a in new_argv]
        was_killed = killed_at(point, command, argv, module, name)
        check(case, argv, was_killed)
        if not was_killed:
            return point
        point += 1


STAGE2 = ["--backend", "torch", "--num_inference_steps", "2", "--no_progress",
          "--compile_cache_dir", "none"]


def test_stage2_killed_at_every_write_point_leaves_old_or_new_outputs(tmp_path):
    old = tmp_path / "old"
    out, reports = old / "out", old / "reports"
    reports.mkdir(parents=True)
    argv = [*STAGE2, "--output_dir", str(out), "--telemetry_json", str(reports / "t.json"),
            "--telemetry_csv", str(reports / "t.csv")]
    assert stage2.main([*argv, "--seed", "1"]) == 0
    old_report = (reports / "t.json").read_bytes()

    def check(case, argv, was_killed):
        latents, _, config = read_stage2(str(case / "out"))  # one pair, recovered if need be
        assert config["seed"] in (1, 7) and (config["seed"] == 7 or was_killed)
        report_is_old = (case / "reports" / "t.json").read_bytes() == old_report
        assert report_is_old == (config["seed"] == 1), "the reports belong to the same run"
        assert stage2.main([*argv, "--seed", "9"]) == 0  # the next run
        assert read_stage2(str(case / "out"))[2]["seed"] == 9
        assert leftovers(case) == []

    points = each_point(tmp_path, old, stage2.main, [*argv, "--seed", "7"], stage2, "_write",
                        check)
    assert points >= 10  # temporaries, payloads, journal, renames: every one was a kill point


# the write points are the backend's alike; the children are forked, which JAX's threads forbid
STAGE3 = ["--backend", "torch"]


def test_stage3_killed_at_every_write_point_leaves_old_or_new_outputs(tmp_path):
    old = tmp_path / "old"
    assert stage2.main([*STAGE2, "--output_dir", str(old)]) == 0
    assert stage3.main([*STAGE3, "--input_dir", str(old), "--fps", "8"]) == 0
    old_video = (old / VIDEO).read_bytes()

    def check(case, argv, was_killed):
        _, _, config = read_stage2(str(case))
        assert config["fps"] in (8, 12) and (config["fps"] == 12 or was_killed)
        assert ((case / VIDEO).read_bytes() == old_video) == (config["fps"] == 8)
        assert stage3.main([*STAGE3, "--input_dir", str(case), "--fps", "10"]) == 0  # the next run
        assert json.loads((case / CONFIG).read_text())["fps"] == 10
        assert sorted(os.listdir(case)) == sorted([CONFIG, LATENTS, VIDEO])

    points = each_point(tmp_path, old, stage3.main, [*STAGE3, "--input_dir", str(old), "--fps", "12"],
                        stage3, "write_video", check)
    assert points >= 6


def test_calibrate_killed_at_every_write_point_leaves_the_old_or_new_profile(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    argv = ["--model", "hunyuanvideo-tiny", "--samples", "2", "--num_inference_steps", "3",
            "--degree", "1", "--out", str(old / "p.json")]
    assert calibrate.main([*argv, "--first_seed", "0"]) == 0
    old_text = (old / "p.json").read_text()

    def check(case, argv, was_killed):
        text = (case / "p.json").read_text()
        assert was_killed or text != old_text
        assert "coefficients" in json.loads(text)
        assert calibrate.main(argv) == 0  # the next run
        assert os.listdir(case) == ["p.json"]

    points = each_point(tmp_path, old, calibrate.main, [*argv, "--first_seed", "5"], calibration,
                        "write_profile", check)
    assert points >= 3


def test_an_interrupted_budget_calibration_leaves_the_old_profile(tmp_path, monkeypatch, capsys):
    """Issue 23 item 3: the TeaCache fit used to be written before the budget runs."""
    from sampling.interrupt import Interrupted

    profile = tmp_path / "p.json"
    profile.write_text('{"the": "previous profile"}')

    def interrupted(*args, **kwargs):
        raise Interrupted(signal.SIGINT)
    monkeypatch.setattr(calibration, "measure_space", interrupted)
    code = calibrate.main(["--model", "hunyuanvideo-tiny", "--samples", "2",
                           "--num_inference_steps", "3", "--degree", "1", "--budget",
                           "--out", str(profile)])
    assert code == 128 + signal.SIGINT and "no partial output" in capsys.readouterr().err
    assert profile.read_text() == '{"the": "previous profile"}'
    assert os.listdir(tmp_path) == ["p.json"]

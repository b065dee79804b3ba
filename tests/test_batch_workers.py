"""One prompt list over many workers: per-prompt claims (taken once, a dead worker's taken over,
another batch's refused), the batch's shared hold of its folder, and 4 workers on this machine
sharing 40 prompts, one of them killed mid-prompt, ending with the videos one worker makes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commands import batch, generate
from sampling.claims import RELEASED, Claims
from sampling.errors import StageFileError
from sampling.one_writer import LOCK, one_writer
from sampling.stage_io import VIDEO
from tests.test_refusals import refused

ROOT = Path(__file__).resolve().parents[1]


# --- claims ------------------------------------------------------------------------------------

def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _claim_file(folder: Path, name: str, **who) -> Path:
    path = folder / name
    path.write_text(json.dumps({"worker": "w", "batch": "b", **who}))
    return path


def test_a_claim_is_held_by_one_worker_until_it_lets_go(tmp_path):
    a = Claims(str(tmp_path), "b", worker="a")
    b = Claims(str(tmp_path), "b", worker="b")
    assert a.take("001") and a.ours("001")
    assert not b.take("001")  # a lives (this very process)
    assert b.holder("001")["worker"] == "a"
    assert b.take("002")
    a.release("001")
    assert not a.ours("001") and b.holder("001") is None
    assert b.take("001") and b.ours("001")
    assert sorted(os.listdir(tmp_path)) == ["001.1", "001.1" + RELEASED, "001.2", "002.1"]
    b.close()
    assert a.made_by("001") == "b" and a.made_by("002") == "b" and a.made_by("003") is None


def test_a_dead_workers_claim_is_taken_over_and_it_can_no_longer_publish(tmp_path):
    claims = Claims(str(tmp_path), "b", lease=60)
    # on this host: its process is gone, so at once
    _claim_file(tmp_path, "001.1", host=claims.host, pid=_dead_pid())
    assert claims.take("001") and (tmp_path / "001.2").exists()
    # on another host: when its heartbeat is older than the lease, not before
    fresh = _claim_file(tmp_path, "002.1", host="elsewhere", pid=1)
    assert not claims.take("002")
    os.utime(fresh, (time.time() - 61, time.time() - 61))
    assert claims.take("002")
    # the worker that lost 002 sees so before it writes
    stalled = Claims(str(tmp_path), "b")
    stalled._held["002"] = str(fresh)
    assert not stalled.ours("002") and claims.ours("002")


def test_a_live_claim_of_another_batch_is_refused_not_waited_on(tmp_path):
    claims = Claims(str(tmp_path), "mine")
    _claim_file(tmp_path, "001.1", host=claims.host, pid=os.getpid(), batch="theirs",
                command="generate.py --prompts other.txt")
    with pytest.raises(StageFileError, match="prompt 001 is being made by another batch .*other"
                       r"\.txt.*expected every worker sharing a folder to run the same command"):
        claims.take("001")


def test_the_heartbeat_keeps_a_claim_young(tmp_path):
    claims = Claims(str(tmp_path), "b", lease=0.2)
    claims.take("001")
    path = tmp_path / "001.1"
    os.utime(path, (0, 0))
    time.sleep(0.2)
    assert time.time() - path.stat().st_mtime < 0.2
    claims.close()
    assert (tmp_path / ("001.1" + RELEASED)).exists()


# --- the batch's hold of its folder ------------------------------------------------------------

SHARED = ("import sys, time\n"
          "from sampling.one_writer import one_writer\n"
          "with one_writer(sys.argv[1], shared=True):\n"
          "    print('held', flush=True)\n"
          "    time.sleep(120)\n")


def test_the_workers_of_a_batch_hold_its_folder_together_and_keep_single_runs_out(
        tmp_path, capsys):
    out = tmp_path / "batch"
    worker = subprocess.Popen([sys.executable, "-c", SHARED, str(out)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "held"
        with one_writer(str(out), shared=True):  # a second worker of the batch
            pass
        assert (out / LOCK).exists()  # the other worker still holds it
        flags = ["--enable_cache", "--no_progress"]
        refused(generate.main, ["--prompt", "red circle moves right on blue", "--output_dir",
                                str(out), *flags], capsys,
                f"--output_dir {out} is being written by the workers of a batch")
        refused(generate.main, ["--prompt", "red circle moves right on blue", "--output_dir",
                                str(out / "010"), *flags], capsys,
                f"--output_dir {out / '010'} is inside {out}, which another run is writing")
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    with one_writer(str(out)):  # its lock went with it
        pass


# --- 4 workers, 40 prompts ---------------------------------------------------------------------

COLOURS, SHAPES = ("red", "green", "blue", "white", "yellow"), ("circle", "square")
MOVES, GROUNDS = ("right", "left", "up", "down"), ("black", "white", "blue", "red")
FLAGS = ["--enable_cache", "--num_inference_steps", "30", "--compile_cache_dir", "none"]


def forty_prompts() -> list[str]:
    every = [f"{c} {s} moves {m} on {g}" for c in COLOURS for s in SHAPES for m in MOVES
             for g in GROUNDS if c != g]
    return every[::2][:40]


def _worker(prompts: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "generate.py"), "--prompts", str(prompts), "--output_dir",
         str(out), *FLAGS], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})


def _videos(out: Path) -> dict[str, bytes]:
    return {f"{i:03d}": (out / f"{i:03d}" / VIDEO).read_bytes() for i in range(1, 41)}


def test_four_workers_share_forty_prompts_and_finish_a_killed_ones(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(forty_prompts()) + "\n")
    alone = _worker(prompts, tmp_path / "alone")
    _, err = alone.communicate(timeout=600)
    assert alone.returncode == 0, err[-3000:]
    reference = _videos(tmp_path / "alone")

    out = tmp_path / "shared"
    workers = [_worker(prompts, out) for _ in range(4)]
    victim, killed_at = workers[0], None
    logs, summaries = {}, {}
    try:
        # SIGKILL the first worker once it is sampling a prompt (it holds the prompt's claim
        # from before that line until its video is written, tens of ms later)
        lines = []
        for text in victim.stderr:
            lines.append(text)
            found = re.match(r"\[(\d+)/40\] stage 2 sampling", text)
            if found:
                victim.send_signal(signal.SIGKILL)
                killed_at = f"{int(found.group(1)):03d}"
                break
        victim.wait(60)
        logs[victim.pid] = "".join(lines)
        for w in workers[1:]:
            summaries[w.pid], logs[w.pid] = w.communicate(timeout=600)
            assert w.returncode == 0, logs[w.pid][-3000:]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    assert killed_at is not None and victim.returncode == -signal.SIGKILL

    assert _videos(out) == reference  # byte for byte what one worker makes
    # each prompt made once: one finished decode a prompt over all workers, the killed one's
    # prompt by a survivor
    finished = [int(m.group(1)) for log in logs.values()
                for m in re.finditer(r"^\[(\d+)/40\] stage 3 [\d.]+ s", log, re.M)]
    assert sorted(finished) == list(range(1, 41)), sorted(finished)
    # the victim died holding the prompt's claim, and another worker's later claim made it
    claims = sorted(p.name for p in (out / ".claims").iterdir() if p.name.startswith(killed_at))
    held = [json.loads((out / ".claims" / n).read_text()) for n in claims
            if not n.endswith(RELEASED) and n + RELEASED not in claims]
    assert [who["pid"] for who in held] == [victim.pid], claims
    index = json.loads((out / batch.INDEX).read_text())
    assert index["done"] == index["of"] == 40
    assert [e["prompt"] for e in index["prompts"]] == forty_prompts()
    made = {e["folder"]: e["made_by"] for e in index["prompts"]}
    assert made[killed_at] not in (None, f"{os.uname().nodename}:{victim.pid}")
    assert {m.split(":")[1] for m in made.values()} <= {str(w.pid) for w in workers[1:]} | {
        str(victim.pid)}
    # each survivor's summary names what it made and where the whole list is
    for w in workers[1:]:
        assert re.search(r"this worker \(.*\) made \d+ prompt\(s\), other workers \d+; the whole "
                         rf"list: {re.escape(str(out / batch.INDEX))}", summaries[w.pid])
    assert not (out / LOCK).exists()  # the last worker let the folder go


def test_a_batch_leaves_a_folder_another_run_holds_to_its_rerun(tmp_path, capsys):
    """Issue 62, the other order: a single run writes into the batch's 002 first. The batch makes
    the other prompts, refuses 002 naming it, and its rerun makes 002 once that run has ended."""
    from tests.test_batch_resume import PROMPTS, _holder, _prompts
    out = tmp_path / "out"
    holder = _holder(out / "002")
    argv = ["--prompts", str(_prompts(tmp_path)), "--output_dir", str(out), "--enable_cache",
            "--no_progress", "--num_inference_steps", "4"]
    try:
        capsys.readouterr()
        assert generate.main(argv) == 2
        last = capsys.readouterr().err.splitlines()[-1]  # after the other prompts' progress
        for needle in (f"--output_dir {out / '002'} is being written by another run",
                       f"pid {holder.pid}", "this batch made every other prompt it could"):
            assert needle in last, last
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert [(out / f"00{i}" / VIDEO).exists() for i in range(1, 5)] == [True, False, True, True]
    before = (out / "001" / VIDEO).read_bytes()
    assert generate.main(argv) == 0
    assert all((out / f"00{i}" / VIDEO).exists() for i in range(1, 5))
    assert (out / "001" / VIDEO).read_bytes() == before
    assert len(PROMPTS) == 4 and not (out / "002" / LOCK).exists()

"""Long prompt batches on the built-in trained model: memory, compiles, time per prompt, and a
kill at a random point followed by a rerun.

    python -m bench.studies.batch [--prompts 200] [--seed 0] [--out bench/results/batch.md]

Runs `generate.py --prompts FILE --enable_cache` as a user does (a subprocess), N prompts drawn
from the model's words with a fixed seed. Phase 1, one uninterrupted run: the process's resident
memory (VmRSS from /proc) as each prompt's video is written and its peak (VmHWM), each prompt's
time (from one "stage 3" line to the next), and the compiles the summary counts (stage 2's
programs, stage 3's decoder). Phase 2, the same command into a fresh folder, SIGKILLed after a
random prompt's stage line plus a random delay; then the same command again: every video must
be there and byte-identical to phase 1's, the rerun must skip what was finished and sample at
most the prompt in flight. Writes the page (and a PNG of memory and time per prompt).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from bench.fixtures.videos import COLORS, DIRECTIONS, SHAPES  # noqa: E402
from cache.config import TECHNIQUES  # noqa: E402
from commands.resume import DECODE, DONE, ENCODE, SAMPLE  # noqa: E402
from sampling.journal import atomic_write  # noqa: E402
from sampling.stage_io import VIDEO  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = ["--enable_cache", "--no_progress"]


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        fg, bg = rng.sample(COLORS, 2)
        out.append(f"{fg} {rng.choice(SHAPES)} moves {rng.choice(DIRECTIONS)} on {bg}")
    return out


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a live process, in MiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return fields


def _command(prompt_file: str, out: str, summary: str) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "generate.py"), "--prompts", prompt_file,
            "--output_dir", out, *FLAGS, "--summary_json", summary]


def run_whole(prompt_file: str, out: str, summary: str) -> dict:
    """One uninterrupted run: per prompt (after its video) RSS, peak RSS, seconds."""
    child = subprocess.Popen(_command(prompt_file, out, summary), cwd=ROOT,
                             stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    rss, hwm, stamps = [], [], []
    began = time.perf_counter()
    for line in child.stderr:
        if " stage 3 " in line and line.startswith("["):
            status = _status(child.pid)
            rss.append(status["VmRSS"])
            hwm.append(status["VmHWM"])
            stamps.append(time.perf_counter())
    if child.wait() != 0:
        raise SystemExit(f"generate.py failed with exit {child.returncode}")
    seconds = np.diff([began, *stamps])
    return {"rss": rss, "hwm": hwm, "seconds": seconds.tolist(),
            "wall": time.perf_counter() - began,
            "report": json.load(open(summary))}


def run_killed(prompt_file: str, out: str, summary: str, n: int, rng: random.Random) -> dict:
    """The same command killed at a random point, then run again."""
    at = rng.randrange(1, n)
    stage = rng.choice(["stage 1", "stage 2", "stage 3"])
    delay = rng.uniform(0, 0.3)
    mark = f"[{at}/{n}] {stage}"
    child = subprocess.Popen(_command(prompt_file, out, summary), cwd=ROOT,
                             stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    for line in child.stderr:
        if line.startswith(mark):
            time.sleep(delay)
            break
    child.send_signal(signal.SIGKILL)
    child.wait()
    if child.returncode != -signal.SIGKILL:
        raise SystemExit(f"the run ended ({child.returncode}) before the kill at {mark}")
    finished = sum(os.path.exists(os.path.join(out, f"{i + 1:03d}", VIDEO)) for i in range(n))
    began = time.perf_counter()
    rerun = subprocess.run(_command(prompt_file, out, summary), cwd=ROOT, capture_output=True,
                           text=True)
    if rerun.returncode != 0:
        raise SystemExit(f"the rerun failed: {rerun.stderr[-2000:]}")
    report = json.load(open(summary))
    return {"mark": mark, "delay": delay, "finished": finished, "states": report["states"],
            "sampled": sum(r is not None for r in report["stage2"]),
            "rerun_seconds": time.perf_counter() - began,
            "resuming": next((s for s in rerun.stderr.splitlines() if s.startswith("resuming")),
                             "")}


def _videos(out: str, n: int) -> list[bytes | None]:
    paths = [os.path.join(out, f"{i + 1:03d}", VIDEO) for i in range(n)]
    return [open(p, "rb").read() if os.path.exists(p) else None for p in paths]


def plot(whole: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x = np.arange(1, len(whole["rss"]) + 1)
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    a.plot(x, whole["rss"], label="resident (VmRSS)")
    a.plot(x, whole["hwm"], label="peak so far (VmHWM)")
    a.set_ylabel("MiB")
    a.legend()
    b.plot(x, whole["seconds"], ".", ms=3)
    b.set_ylabel("s per prompt")
    b.set_xlabel("prompt")
    b.set_yscale("log")
    fig.suptitle(f"generate.py --prompts, {whole['report']['model']}, --enable_cache")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _sampling(stage2: dict) -> str:
    """How the first prompt was sampled, as its stage-2 report says: steps, solver, CFG, caching."""
    used = ["CFG"] * (len(stage2["branches"]) > 1)  # a cond and an uncond branch
    used += [TECHNIQUES[m][2].__name__.removesuffix("Config") for m in stage2["cache"]["modes"]]
    how = f"with {' and '.join(used)}" if used else "without CFG or caching"
    return f"{stage2['steps']} `{stage2['solver']}` steps {how}"


def page(n: int, seed: int, whole: dict, killed: dict, identical: bool, png: str) -> str:
    rss, hwm, secs = np.array(whole["rss"]), np.array(whole["hwm"]), np.array(whole["seconds"])
    report = whole["report"]
    stage2 = [r for r in report["stage2"] if r is not None]
    warm = [r["compiles"]["warmup"]["lowered"] for r in stage2 if r["compiles"]["warmup"]]
    loop = sum(r["compiles"]["loop"]["lowered"] for r in stage2 if r["compiles"]["loop"])
    decode = [d["compiles"] for d in report["stage3"] if d is not None]
    slope = np.polyfit(np.arange(1, n), rss[1:], 1)[0] * 1024  # KiB per prompt after the first
    later = secs[1:]
    counts = {s: killed["states"].count(s) for s in (DONE, DECODE, SAMPLE, ENCODE)}
    return "\n".join([
        "# Long prompt batches",
        "",
        f"`python -m bench.studies.batch --prompts {n} --seed {seed}` on this machine ({os.cpu_count()} CPU "
        f"cores, built-in `{report['model']}`, `generate.py --prompts FILE --enable_cache` as a "
        f"subprocess, {_sampling(stage2[0])}, one folder per prompt).",
        "",
        "## One uninterrupted run",
        "",
        "| figure | value |",
        "|---|---|",
        f"| prompts | {n}, {report['seconds']:.1f} s in the job ({whole['wall']:.1f} s with start-up) |",
        f"| resident memory after prompt 1 | {rss[0]:.0f} MiB |",
        f"| resident memory after prompt {n} | {rss[-1]:.0f} MiB |",
        f"| growth after the first prompt (least squares) | {slope:+.1f} KiB per prompt |",
        f"| peak resident memory (VmHWM) after prompt 1 / {n} | {hwm[0]:.0f} / {hwm[-1]:.0f} MiB |",
        f"| stage-2 compiles (first prompt / the other {n - 1} / in the loops) | {warm[0]} / "
        f"{sum(warm[1:])} / {loop} |",
        f"| stage-3 decoder compiles (first prompt / the other {n - 1}) | {decode[0]} / "
        f"{sum(decode[1:])} |",
        f"| first prompt (encoders, compiles, VAE) | {secs[0]:.2f} s |",
        f"| later prompts: median, 5th-95th percentile | {np.median(later):.3f} s, "
        f"{np.percentile(later, 5):.3f}-{np.percentile(later, 95):.3f} s |",
        f"| later prompts: first half / second half median | {np.median(later[:len(later) // 2]):.3f}"
        f" / {np.median(later[len(later) // 2:]):.3f} s |",
        "",
        f"![memory and time per prompt]({os.path.basename(png)})",
        "",
        "Stage 1 encodes every prompt first (the encoders are freed before the DiT loads); then "
        "each prompt is sampled and decoded at once, so its video is final before the next "
        "prompt starts. Each prompt's time above is from one video to the next; the first "
        "includes stage 1 of every prompt.",
        "",
        "## Killed, then the same command again",
        "",
        f"SIGKILL {killed['delay']:.2f} s after the line `{killed['mark']}` (drawn with seed "
        f"{seed}); {killed['finished']} videos were final at the kill. The rerun "
        f"({killed['rerun_seconds']:.1f} s) said: `{killed['resuming']}`",
        "",
        "| after the rerun | value |",
        "|---|---|",
        f"| prompts skipped (video there) | {counts[DONE]} |",
        f"| decoded from their latents | {counts[DECODE]} |",
        f"| sampled from their embeddings | {counts[SAMPLE]} |",
        f"| from the start | {counts[ENCODE]} |",
        f"| prompts sampled by the rerun | {killed['sampled']} (the {n - killed['finished']} "
        "without a video, less those decoded from their latents) |",
        f"| videos present and byte-identical to the uninterrupted run's | "
        f"{'all ' + str(n) if identical else 'NO'} |",
        "",
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "batch.md"))
    args = parser.parse_args(argv)
    n = args.prompts
    work = tempfile.mkdtemp(prefix="batch-bench-")
    try:
        prompt_file = os.path.join(work, "prompts.txt")
        with open(prompt_file, "w") as f:
            f.write("\n".join(prompts(n, args.seed)) + "\n")
        whole = run_whole(prompt_file, os.path.join(work, "whole"), os.path.join(work, "a.json"))
        print(f"whole: {whole['wall']:.1f} s, RSS {whole['rss'][0]:.0f} -> {whole['rss'][-1]:.0f} "
              "MiB", flush=True)
        killed = run_killed(prompt_file, os.path.join(work, "killed"),
                            os.path.join(work, "b.json"), n, random.Random(args.seed))
        identical = _videos(os.path.join(work, "whole"), n) == _videos(
            os.path.join(work, "killed"), n)
        print(f"killed at {killed['mark']}: {killed['resuming']}; identical {identical}")
        png = os.path.splitext(args.out)[0] + ".png"
        plot(whole, png)
        text = page(n, args.seed, whole, killed, identical, png)
        atomic_write(args.out, lambda f: f.write(text))
        print(text)
        return 0 if identical else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

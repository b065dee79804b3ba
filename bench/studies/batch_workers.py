"""One prompt list over 1, 2 and 4 workers on this machine: videos per minute, what each worker
made, and whether the videos are byte for byte one worker's.

    python -m bench.studies.batch_workers [--prompts 136] [--workers 1 2 4]
        [--out bench/results/batch_workers.md]

Each worker is `generate.py --prompts FILE --output_dir D --enable_cache` started as a user
starts it (a subprocess, the built-in trained model at its default steps), all at once into one
fresh folder; the time is from the first start to the last exit (start-up included: every
worker pays its imports, model load and compiles). A worker gets cores // workers threads.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from commands.batch import INDEX  # noqa: E402
from sampling.stage_io import VIDEO  # noqa: E402

COLOURS, SHAPES = ("red", "green", "blue", "white", "yellow"), ("circle", "square")
MOVES, GROUNDS = ("right", "left", "up", "down"), ("black", "white", "blue", "red")


def prompts_of(n: int) -> list[str]:
    """n prompts of the built-in model's words, each a different clip."""
    every = [f"{c} {s} moves {m} on {g}" for c in COLOURS for s in SHAPES for m in MOVES
             for g in GROUNDS if c != g]
    if n > len(every):
        raise SystemExit(f"--prompts {n}: expected at most {len(every)}")
    return every[::2][:n] if n <= len(every[::2]) else every[:n]


def run_workers(prompts_file: str, out: str, workers: int, extra: list[str]) -> dict:
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    began = time.perf_counter()
    procs = [subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "generate.py"), "--prompts", prompts_file,
         "--output_dir", out, "--enable_cache", "--no_progress", *extra], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(workers)]
    made = []
    for p in procs:
        stdout, stderr = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"a worker failed ({p.returncode}):\n{stderr[-3000:]}")
        found = re.search(r"this worker \(.*\) made (\d+) prompt", stdout)
        made.append(int(found.group(1)) if found else None)
    return {"seconds": time.perf_counter() - began, "made": made}


def videos(out: str, n: int) -> dict[str, bytes]:
    return {f"{i:03d}": open(os.path.join(out, f"{i:03d}", VIDEO), "rb").read()
            for i in range(1, n + 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=136)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, help="sampling steps (default: the model's)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "batch_workers.md"))
    args = ap.parse_args(argv)
    extra = [] if args.steps is None else ["--num_inference_steps", str(args.steps)]
    work = tempfile.mkdtemp(prefix="batch_workers_")
    rows, reference = [], None
    try:
        path = os.path.join(work, "prompts.txt")
        with open(path, "w") as f:
            f.write("\n".join(prompts_of(args.prompts)) + "\n")
        for workers in args.workers:
            out = os.path.join(work, f"w{workers}")
            r = run_workers(path, out, workers, extra)
            got = videos(out, args.prompts)
            reference = reference or got
            with open(os.path.join(out, INDEX)) as f:
                index = json.load(f)
            rows.append({**r, "workers": workers, "same": got == reference,
                         "done": index["done"], "of": index["of"]})
            print(f"{workers} worker(s): {r['seconds']:.1f} s, "
                  f"{60 * args.prompts / r['seconds']:.1f} videos/min, made {r['made']}",
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = rows[0]["seconds"]
    lines = [
        "# One prompt list, many workers",
        "",
        f"`python -m bench.studies.batch_workers --prompts {args.prompts} --workers "
        f"{' '.join(map(str, args.workers))}` on this machine ({os.cpu_count()} CPU cores; "
        "built-in `wan-tiny-trained`, `generate.py --prompts FILE --output_dir D --enable_cache`"
        f"{'' if args.steps is None else f' --num_inference_steps {args.steps}'} started N times "
        "at once into one fresh folder; time from the first start to the last exit, start-up "
        "included; each worker gets cores // N threads).",
        "",
        "| workers | seconds | videos per minute | vs 1 worker | prompts each worker made | "
        "index done | videos byte-identical to the first row's |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['workers']} | {r['seconds']:.1f} | "
                     f"{60 * args.prompts / r['seconds']:.1f} | {base / r['seconds']:.2f}x | "
                     f"{', '.join(map(str, r['made']))} | {r['done']} of {r['of']} | "
                     f"{'yes' if r['same'] else 'NO'} |")
    lines += ["", "Each prompt is made once: a worker takes it under an exclusive-create claim "
              "and reads its folder again once it holds it; workers walk the list in order and "
              "come back to the prompts others hold. On a machine with fewer cores than workers "
              "the workers share the cores, so the gain is what the cores allow; on accelerators "
              "a worker is one device group (one model copy), and N of them scale with N.", ""]
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {args.out}")
    return 0 if all(r["same"] and r["done"] == r["of"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The committed trained pages read again under today's rules, from their results.csv alone.

    python -m bench.pareto.restand [--out bench/results/pareto/restanding.md]

Issue 60 changed how a page reads, not what ran: a tie within `bench.pareto.report.LEVEL_DB` of a peer
is level, not behind; the speedup targets are one grid declared before any page runs, so the
speedup-2.75 target the trained pages ran with from issue 39 on (added because 2.8 just missed
SeaCache's 0.36 point) is dropped; and what one flag gives (budgeted mode and the presets) is
counted against the best peer. Every other row is what the page measured: a target's choice
does not depend on the other targets. The pages ran before the presets were a curve, so one
flag here is budgeted mode alone, and the promises on unseen draws (kept in the run, not in
results.csv) stay on each page.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.page import write_page  # noqa: E402
from bench.pareto import report  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = {  # folder under bench/results/pareto -> (family key, what the model is)
    "trained": ("wan", "Wan (procedural recipe, tuned on)"),
    "heldout_seed7": ("wan", "Wan held-out seed 7 (procedural, never tuned on)"),
    "heldout_seed11": ("wan", "Wan held-out seed 11 (procedural, never tuned on)"),
    "trained_hunyuan": ("hunyuan", "HunyuanVideo-1.5 twin (procedural, tuned on)"),
    "heldout_hunyuan_seed7": ("hunyuan", "HunyuanVideo-1.5 held-out seed 7 (procedural, never "
                                         "tuned on)"),
}
DROPPED = "speedup 2.75"  # not in bench.pareto's SPEEDUPS


def read_rows(path: str) -> list[dict]:
    """results.csv back into report rows (numbers as floats, empty cells None)."""
    numeric = set(report.COLUMNS) - {"family", "method", "impl", "setting", "status"}
    rows = []
    with open(path) as f:
        for r in csv.DictReader(f):
            row = {k: (None if v == "" else float(v) if k in numeric else v) for k, v in r.items()}
            row["status"] = row["status"] or "ok"
            rows.append(row)
    return rows


def counts(summary: str) -> tuple[int, ...]:
    """(goal, points, both, behind, level) from a standing summary."""
    import re
    m = re.search(r"goal met at (\d+) of (\d+) .* at (\d+), behind at (\d+), level \(within "
                  r"[0-9.]+ dB\) at (\d+)", summary)
    return tuple(int(x) for x in m.groups())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "pareto",
                                                  "restanding.md"))
    args = ap.parse_args(argv)
    lines = ["# The committed trained pages under today's rules", "",
             "`python -m bench.pareto.restand` (from each page's results.csv; nothing runs). "
             + " ".join(__doc__.split("\n\n")[2].split()), "",
             "| page | PSNR | best-peer points | goal | both | behind | level | one flag "
             "(budgeted mode): points, behind / goal / both of those with a peer point on "
             "each side, within 1 dB of our front |", "|---|---|---|---|---|---|---|---|"]
    for folder, (family, name) in PAGES.items():
        rows = read_rows(os.path.join(ROOT, "bench", "results", "pareto", folder, "results.csv"))
        dropped = sum(r["setting"].startswith(DROPPED + ":") for r in rows)
        rows = [r for r in rows if not r["setting"].startswith(DROPPED + ":")]
        for metric in report.METRICS:
            goal, n, both, behind, level = counts(report.standing(rows, family, metric)[1])
            flag = report.budget_standing(rows, family, [], metric=metric, promises=False)[1]
            lines.append(f"| [{name}]({folder}/README.md){' (2.75 dropped)' if dropped else ''} "
                         f"| {report.METRICS[metric]} | {n} | {goal} | {both} | {behind} | "
                         f"{level} | {flag.removeprefix('one flag ')} |")
    lines += ["", "A model meets the bar where the goal is met at three quarters of the points or "
              "more and both forms at half or more, behind at none."]
    write_page(args.out, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

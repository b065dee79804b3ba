"""Our forecasting variants on bench.pareto's workload, against the peer front it stored.

    python -m bench.studies.forecast_sweep [--families wan,hunyuan] [--variants fc2,fa2,...]
        [--thresholds 0.02,0.05,0.1,0.2] [--out bench/results/forecast_sweep.md]

A quicker loop than bench.pareto for trying gate settings (issue 17): only our runs (same
models, seed, scheduler, block counting and fidelity as the pareto bench's run_ours), compared with the
peers' points in bench/results/pareto/results.csv (deterministic: bench.pareto reproduces them to
0.001 dB). Per family it prints each run (computed fraction, PSNR, the cond branch's computes C
and reuses .) and, per best-peer point, ours' PSNR gain at its fraction and fraction ratio at its
PSNR, for the runs here alone. One seed: single points move by a few dB with luck (errors of
different reuse runs partly cancel), so read curves, not points.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.page import machine  # noqa: E402
from bench.pareto import report  # noqa: E402
from bench.pareto import workload as pw
from bench.studies.forecast_signals import write_report  # noqa: E402
from cache import CMConfig, FBCacheConfig  # noqa: E402
from sampling.fidelity import fidelity  # noqa: E402

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.path.join(BENCH, "results", "pareto", "results.csv")
OUT = os.path.join(BENCH, "results", "forecast_sweep.md")


def fb(th, accumulate=False):
    return FBCacheConfig(threshold=th, metric="residual_tensor_rel_l1", accumulate=accumulate)


# name -> (what it is, threshold -> CMConfig)
VARIANTS = {
    "fc2": ("quadratic forecast, reuse while block 0's raw change < threshold (before issue 17)",
            lambda th: CMConfig(fbcache=fb(th), forecast=2)),
    "fc2w2": ("fc2 computing steps 0 and 1, so the first reuse run forecasts linearly",
              lambda th: CMConfig(fbcache=fb(th), forecast=2, warmup=2)),
    "fg2": ("quadratic, reuse while block 0's forecast error of the step < threshold",
            lambda th: CMConfig(fbcache=fb(th), forecast=2, forecast_gate=True)),
    "fg2r05": ("fg2, order 2 only within half the last spacing (--forecast_reach 0.5)",
               lambda th: CMConfig(fbcache=fb(th), forecast=2, forecast_gate=True,
                                   forecast_reach=0.5)),
    "fa2": ("quadratic, reuse while the run's summed forecast error < threshold (pareto's gated)",
            lambda th: CMConfig(fbcache=fb(th, True), forecast=2, forecast_gate=True)),
    "fa2lin": ("fa2 with --noise_adapt linear (threshold x1.5 early to x0.5 late)",
               lambda th: CMConfig(fbcache=fb(th, True), forecast=2, forecast_gate=True,
                                   noise_adapt="linear")),
    "fa2l0": ("fa2 without the forced last compute (--cache_last_steps 0, as the peers)",
              lambda th: CMConfig(fbcache=fb(th, True), forecast=2, forecast_gate=True,
                                  last_steps=0)),
    "fa1l0": ("fa2l0 with a linear forecast",
              lambda th: CMConfig(fbcache=fb(th, True), forecast=1, forecast_gate=True,
                                  last_steps=0)),
    "fs1": ("fa2l0 with each step's forecast error weighted by its step size over the mean "
            "(--step_weight 1)",
            lambda th: CMConfig(fbcache=fb(th, True), forecast=2, forecast_gate=True,
                                last_steps=0, step_weight=1.0)),
    "fs05": ("fs1 with the square root of that weight (--step_weight 0.5)",
             lambda th: CMConfig(fbcache=fb(th, True), forecast=2, forecast_gate=True,
                                 last_steps=0, step_weight=0.5)),
    "fs1lin": ("fs1 with a linear forecast",
               lambda th: CMConfig(fbcache=fb(th, True), forecast=1, forecast_gate=True,
                                   last_steps=0, step_weight=1.0)),
    "fs1l1": ("fs1 with the forced last compute (--cache_last_steps 1)",
              lambda th: CMConfig(fbcache=fb(th, True), forecast=2, forecast_gate=True,
                                  step_weight=1.0)),
}


def peer_points(family: str) -> list[tuple]:
    with open(PEERS) as f:
        return [(float(r["computed_fraction"]), float(r["psnr_db"]), r["method"])
                for r in csv.DictReader(f) if r["family"] == family and r["status"] == "ok"
                and r["impl"] != "ours" and r["method"] != "uncached"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="wan,hunyuan")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated among: " + ", ".join(VARIANTS))
    ap.add_argument("--thresholds", default="0.02,0.05,0.1,0.2")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; expected some of {', '.join(VARIANTS)}")
    thresholds = [float(t) for t in args.thresholds.split(",")]
    torch.set_num_threads(1)
    command = "python -m bench.studies.forecast_sweep" + ("" if argv is None and len(sys.argv) == 1
                                                  else " " + " ".join(sys.argv[1:] if argv is None else argv))
    lines = ["# Forecasting variants against the stored peer front (issue 17)", "",
             f"Reproduce: `{command}` ({machine()}). Peers: bench/results/pareto/"
             "results.csv. One seed: points move by a few dB with luck; read curves.", "",
             "Variants:", ""] + [f"- {v}: {VARIANTS[v][0]}" for v in variants]
    for key in args.families.split(","):
        family = pw.families(30, 30)[key]
        wl = pw.build_workload(family)
        counter = pw.our_counter(wl)
        base = pw.run_ours(wl, CMConfig(), counter)
        lines += ["", f"## {family.title}", "", "| variant | threshold | computed | PSNR dB | cond "
                  "branch (C compute, . reuse) |", "|---|---|---|---|---|"]
        points = {v: [] for v in variants}
        for v in variants:
            for th in thresholds:
                run = pw.run_ours(wl, VARIANTS[v][1](th), counter)
                psnr = fidelity(run.latents, base.latents, wl.noise)["psnr_db"]
                acts = "".join("C" if a == "compute" else "." for a, b in
                               zip(run.trace["action"], run.trace["branch"], strict=True)
                               if b == "cond")
                points[v].append((run.fraction, psnr, v))
                lines.append(f"| {v} | {th:g} | {run.fraction:.3f} | {psnr:.1f} | `{acts}` |")
                print(lines[-1], flush=True)
        peers = peer_points(key)
        front = report.front(peers)
        lines += ["", "Per best-peer point (computed, PSNR): ours' PSNR gain at its fraction / "
                  "fraction ratio at its PSNR, each variant's runs alone:", "",
                  "| variant | " + " | ".join(f"{c:.3f}, {q:.1f}" for c, q, _ in front)
                  + " | both forms met |", "|---|" + "---|" * (len(front) + 1)]
        for v in variants:
            res = report.compare(points[v], peers, report.MATCH_TOLERANCE)
            cells = [f"{'-' if d is None else f'{d:+.1f}'} / {'-' if r is None else f'{r:.2f}x'}"
                     for _, d, r in res]
            lines.append(f"| {v} | " + " | ".join(cells)
                         + f" | {sum(report.both_met(d, r) for _, d, r in res)} |")
            print(lines[-1], flush=True)
    return write_report(args.out, lines)


if __name__ == "__main__":
    sys.exit(main())

"""Trained weights (issue 28): our fixed-interval reuse against diffusers' TaylorSeer, step for step.

    python -m bench.studies.taylorseer_gap [--prompts 12] [--intervals 2,3]
        [--out bench/results/taylorseer_gap.md]

On the trained tiny Wan (assets/tiny-wan-ti2v), held-out prompts pooled (bench.pareto's
trained regime): diffusers' TaylorSeer (order 1: every block's attention and FFN outputs
extrapolated, and the current step's modulation applied to them) against our DeepCache schedule
at the same interval, no tail block, with the whole middle residual reused (forecast 0) or
extrapolated linearly (1) or quadratically (2), each plain and remodulated (the residual kept
split by the time gates the blocks share and rebuilt with each step's own gates, each part
forecast as the order says: `--remodulate`, which is TaylorSeer's own form). Two phases of the
schedule: start 1 computes the steps TaylorSeer computes (0, then every interval-th from 1, the
last step included), start 3 others (the last step reused at interval 3). Prints the computed
fraction, the pooled PSNR against the same implementation's uncached run, and held-out
direction and shape accuracy, and how far the two uncached runs are apart; writes the page
(`--out`) with the rows and the readings computed from them.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.page import command_line, machine, trained_step, versions, write_page  # noqa: E402
from bench.pareto import (
    peers,  # noqa: E402
    report,  # noqa: E402
)
from bench.pareto import workload as pw  # noqa: E402
from cache import CMConfig, DeepCacheConfig  # noqa: E402
from sampling.fidelity import fidelity  # noqa: E402
from sampling.run import noise_for  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "bench", "results", "taylorseer_gap.md")
DEFAULTS = {"prompts": 12, "intervals": "2,3"}


def row(name, run, base, noise, *, interval, start=None, forecast=None, remodulate=False,
        steps=None) -> dict:
    """One setting's figures. `last_computed` (ours only): whether every prompt's run computed
    the last step, read from the gate's trace."""
    last = None
    if start is not None and steps is not None:
        last = all(any(s == steps - 1 and a == "compute" for s, a in zip(t["step"], t["action"],
                                                                          strict=True))
                   for t in run.trace)
    return {"name": name, "impl": "ours" if start is not None else "diffusers", "interval": interval,
            "start": start, "forecast": forecast, "remodulate": remodulate,
            "computed": run.fraction, "psnr_db": fidelity(run.latents, base.latents, noise)["psnr_db"],
            "direction": run.follow["direction"], "shape": run.follow["shape"], "last_computed": last}


def show(r: dict) -> str:
    return (f"{r['name']:42s} computed {r['computed']:.3f}  PSNR {r['psnr_db']:5.1f} dB  direction "
            f"{r['direction']:.0%}  shape {r['shape']:.0%}")


def _ours(rows, interval, start, forecast, remodulate=False):
    for r in rows:
        if (r["impl"], r["interval"], r["start"], r["forecast"], r["remodulate"]) == (
                "ours", interval, start, forecast, remodulate):
            return r
    return None


def _theirs(rows, interval):
    return next((r for r in rows if r["impl"] == "diffusers" and r["interval"] == interval), None)


def _intervals(rows) -> list[int]:
    return sorted({r["interval"] for r in rows})


def _pairs(rows, key_a: dict, key_b: dict) -> list[tuple[dict, dict]]:
    """Our rows that differ only in the fields of key_a/key_b: (row with key_a, row with key_b)."""
    out = []
    for a in rows:
        if a["impl"] != "ours" or any(a[k] != v for k, v in key_a.items()):
            continue
        b = _ours(rows, **{**{k: a[k] for k in ("interval", "start", "forecast", "remodulate")},
                           **key_b})
        if b is not None:
            out.append((a, b))
    return out


def _standing(d: float) -> str:
    # bench/pareto/report.py's floor for "behind" (and its mirror for "ahead"): within it, level
    return "behind" if d < report.BEHIND_DB else "ahead" if d > -report.BEHIND_DB else "level"


def _best_at_their_steps(rows, interval, remodulate=False):
    """The better of our start-1 reuse (forecast 0) and linear forecast (1): (row, PSNR minus
    TaylorSeer's), or None where a row is missing."""
    theirs = _theirs(rows, interval)
    mine = [r for f in (0, 1) if (r := _ours(rows, interval, 1, f, remodulate)) is not None]
    if theirs is None or not mine:
        return None
    best = max(mine, key=lambda r: r["psnr_db"])
    return best, best["psnr_db"] - theirs["psnr_db"]


def _span(values, fmt="+.1f") -> str:
    lo, hi = min(values), max(values)
    return f"{lo:{fmt}}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}} to {hi:{fmt}}"


def readings(rows) -> list[str]:
    """The page's bullets, each computed from the rows (one left out where its rows are missing)."""
    out = []
    ivs = _intervals(rows)
    parts, gaps = [], {}
    for iv in ivs:
        theirs, f0, f1 = _theirs(rows, iv), _ours(rows, iv, 1, 0), _ours(rows, iv, 1, 1)
        best = _best_at_their_steps(rows, iv)
        if theirs is None or f0 is None or f1 is None:
            continue
        gaps[iv] = best[1]
        parts.append(f"at interval {iv} ({f0['computed']:.2f} computed against its "
                     f"{theirs['computed']:.2f}) {f0['psnr_db']:.1f} dB reused as is, "
                     f"{f1['psnr_db']:.1f} extrapolated linearly, against TaylorSeer's "
                     f"{theirs['psnr_db']:.1f}: {_standing(best[1])} ({best[1]:+.1f} dB)")
    if parts:
        out.append("At TaylorSeer's own steps (start 1), the better of our reuse of the whole middle "
                   "residual and its linear forecast against TaylorSeer's per-module extrapolation "
                   f"(level: within {-report.BEHIND_DB} dB, bench/pareto/report.py's floor): "
                   + "; ".join(parts) + ".")
    remod = [b["psnr_db"] - a["psnr_db"] for a, b in _pairs(rows, {"remodulate": False},
                                                            {"remodulate": True})]
    if remod:
        text = (f"Remodulated (`--remodulate`: the residual kept split by the time gates the blocks "
                f"share and rebuilt with each step's own gates, which is TaylorSeer's form of reuse) "
                f"moves every row by {_span(remod)} dB against the plain one ({len(remod)} pairs)")
        changed = []
        for iv, gap in gaps.items():
            best = _best_at_their_steps(rows, iv, remodulate=True)
            if best is not None and _standing(best[1]) != _standing(gap):
                changed.append(f"interval {iv}: {_standing(gap)} -> {_standing(best[1])} "
                               f"({gap:+.1f} -> {best[1]:+.1f} dB)")
        if gaps and not changed:
            text += (": at TaylorSeer's own steps it changes our standing against TaylorSeer at no "
                     "interval, so on this model the modulation is not what separates the two.")
        elif changed:
            text += ": at TaylorSeer's own steps it changes our standing against TaylorSeer at " + (
                "; ".join(changed)) + "."
        else:
            text += "."
        out.append(text)
    phase = _pairs(rows, {"start": 1, "remodulate": False, "forecast": 1}, {"start": 3})
    if phase:
        moves = [b["psnr_db"] - a["psnr_db"] for a, b in phase]
        biggest = max(abs(m) for m in moves)
        others = {}  # what else moves the rows, and by how much at most
        if remod:
            others["remodulating"] = max(abs(d) for d in remod)
        if gaps:
            others["the gap to TaylorSeer at its steps"] = max(abs(g) for g in gaps.values())
        against = " or ".join(f"{k} (up to {v:.1f})" for k, v in others.items())
        if against:
            more = all(biggest > v for v in others.values())
            against = f", {'more' if more else 'not more'} than {against}"
        both = ", both ways" if min(moves) < 0 < max(moves) else ""
        out.append(f"The phase of the schedule moves the linear forecast by up to {biggest:.1f} dB{both}"
                   f"{against}: " + "; ".join(
                       f"at interval {a['interval']}, start 3 instead of 1 gives {b['psnr_db']:.1f} dB "
                       f"against {a['psnr_db']:.1f} for {b['computed'] - a['computed']:+.2f} computed"
                       for a, b in phase) + ".")
    quad = [b["psnr_db"] - a["psnr_db"] for a, b in _pairs(rows, {"forecast": 1}, {"forecast": 2})]
    if quad:
        losing = sum(d < 0 for d in quad)
        if losing == len(quad):
            gaps_steps = "-".join(str(v) for v in sorted({min(ivs), max(ivs)}))
            out.append(f"The quadratic forecast loses {-max(quad):.1f}-{-min(quad):.1f} dB to the linear "
                       f"one in every pair ({len(quad)}): over gaps of {gaps_steps} steps on a trained "
                       f"model it amplifies more than it corrects.")
        else:
            out.append(f"Quadratic minus linear forecast: {_span(quad)} dB over {len(quad)} pairs, "
                       f"below zero in {losing}.")
    return out


def command(args) -> str:
    return command_line("bench.studies.taylorseer_gap", args, DEFAULTS)


def page(rows, agreement_db: float, *, cmd: str, prompts: int, steps: int, weights: str,
         step: int | None) -> list[str]:
    """The results page: command, machine, what was run, the table, and the readings."""
    trained = f"trained weights: {weights}" + (f" at step {step}" if step is not None else "")
    agree = ("the two uncached runs are bit-identical" if math.isinf(agreement_db) else
             f"our uncached run against diffusers' uncached run: {agreement_db:.1f} dB")
    reused_last = sorted({r["interval"] for r in rows if r["start"] == 3 and r["last_computed"] is False})
    start3 = "start 3 other steps" + (
        f" (the last step reused at interval {', '.join(map(str, reused_last))})" if reused_last else "")
    return [
        "# Fixed-interval reuse against diffusers' TaylorSeer, step for step (trained tiny Wan)", "",
        f"Reproduce: `{cmd}` ({prompts} held-out prompts pooled; {trained}; "
        f"{datetime.date.today().isoformat()}; {machine()}; {versions()}).", "",
        f"PSNR of each implementation against its own uncached run ({agree}). DeepCache "
        f"a/{steps}/n computes the steps before a and every n-th from a; start 1 computes the steps "
        f"diffusers' TaylorSeer computes (step 0, then every n-th from step 1, the last step "
        f"included), {start3}; B0: no tail block, last_steps 0.", "",
        "```", *(show(r) for r in rows), "```", "",
        "Reading it:", "", *(f"- {b}" for b in readings(rows)),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=DEFAULTS["prompts"])
    ap.add_argument("--intervals", default=DEFAULTS["intervals"], help="comma-separated DeepCache intervals")
    ap.add_argument("--out", default=OUT, help="the results page to write")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from diffusers.hooks import TaylorSeerCacheConfig

    wl = pw.build_workload(pw.trained_families()["wan"], 50)
    seeds = pw.FOLLOW_SEEDS[:args.prompts]
    counter = pw.our_counter(wl)
    noise = torch.cat([noise_for(wl.shape, s) for s in seeds])
    ours_base = pw.over_prompts(wl, lambda w: pw.run_ours(w, CMConfig(), counter), seeds)
    their_base = pw.over_prompts(wl, peers.run_diffusers, seeds)
    # the two implementations' own references must be the same run for the rows to compare
    agreement = fidelity(ours_base.latents, their_base.latents, noise)["psnr_db"]
    print(f"uncached: ours against diffusers' PSNR {agreement:.1f} dB", flush=True)
    rows = []

    def add(r):
        rows.append(r)
        print(show(r), flush=True)

    for iv in (int(v) for v in args.intervals.split(",")):
        hook = peers.diffusers_hook(lambda iv=iv: TaylorSeerCacheConfig(
            cache_interval=iv, max_order=1, taylor_factors_dtype=torch.float32,
            cache_identifiers=peers.taylorseer_identifiers(wl)))
        add(row(f"diffusers TaylorSeer interval {iv}",
                pw.over_prompts(wl, lambda w, h=hook: peers.run_diffusers(w, h), seeds), their_base,
                noise, interval=iv))
        # TaylorSeer computes step 0 and every iv-th step from step 1 (the last one included):
        # DeepCache start 1 computes the same steps
        for start in (1, 3):
            for forecast in (0, 1, 2):
                for remodulate in (False, True):
                    config = CMConfig(deepcache=DeepCacheConfig(start=start, end=wl.steps, interval=iv),
                                      forecast=forecast, bn_blocks=0, last_steps=0,
                                      remodulate=remodulate)
                    add(row(f"ours DeepCache {start}/{wl.steps}/{iv} B0 forecast {forecast}"
                            + (" remodulated" if remodulate else ""), pw.over_prompts(
                                wl, lambda w, c=config: pw.run_ours(w, c, counter), seeds),
                            ours_base, noise, interval=iv, start=start, forecast=forecast,
                            remodulate=remodulate, steps=wl.steps))
    weights = wl.family.checkpoint or wl.pipe.builtin_path
    lines = page(rows, agreement, cmd=command(args), prompts=len(seeds), steps=wl.steps,
                 weights=os.path.relpath(weights, ROOT), step=trained_step(weights))
    write_page(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())

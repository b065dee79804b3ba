"""Is CFG-aware reuse worth building? Its oracle bound at the best-peer points (issue 60).

    python -m bench.studies.cfg_reuse_bound [--checkpoint DIR] [--draws 8] [--out FILE]

At a fixed count of model calls (the computed fraction, in calls: 0.36 and 0.26 of 2 x steps),
the baseline computes both CFG branches on the same evenly spaced steps and forecasts each
branch's velocity linearly from its last two computed ones in between (the every-3rd schedule
SeaCache's cap lands on, and TaylorSeer interval 4's count). CFG-aware reuse spends the same
calls unevenly: the conditional branch on more steps, the unconditional on a subset of them,
and in between the unconditional velocity is the conditional one minus the cond/uncond gap,
estimated from the steps where both ran:

- gap plain: the last measured gap (plain reuse of the gap; FasterCache's starting point),
- gap linear: the gap extrapolated linearly from its last two measurements,
- gap scaled: plain + s x (the linear step), s in 0..1.5 (a refreshed bias),
- gap split: FasterCache's frequency split, the gap's low spatial frequencies (FFT over height
  and width, radius r of the half-band) extrapolated linearly and its high ones reused plainly.

Oracle: for each draw, the best of every split of the calls and every gap estimate, chosen on
that draw's own error against its uncached run (an upper bound on what a rule chosen without
the answer can do). Beside it, one rule (a split and a gap estimate) for every draw, chosen on
half of the draws and measured on the other half: what a shipped setting could keep. The loop
is our own (the family's model called per branch, our scheduler), so baseline and CFG-aware
reuse forecast alike; latent PSNR against the uncached run, mean over the draws. Build it
behind the gate only if the bound clears +3 dB at both points.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.fixtures import families as F  # noqa: E402
from bench.fixtures.sampler import lincomb  # noqa: E402
from bench.page import machine, write_section  # noqa: E402
from bench.pareto.workload import FOLLOW_SEEDS, build_workload, trained_families  # noqa: E402
from sampling.fidelity import fidelity  # noqa: E402
from sampling.run import noise_for  # noqa: E402
from sampling.schedulers import make_scheduler  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "bench", "results", "cfg_reuse_bound.md")
POINTS = (0.36, 0.26)  # the best-peer points: SeaCache 2.0 (every 3rd), TaylorSeer interval 5
SCALES = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5)
RADII = (0.125, 0.25, 0.5)
GOAL_DB = 3.0


def evenly(steps: int, count: int) -> list[int]:
    """`count` steps from 0 to the last, evenly spaced."""
    if count >= steps:
        return list(range(steps))
    return sorted({round(k * (steps - 1) / (count - 1)) for k in range(count)})


def subset(chosen: list[int], count: int) -> list[int]:
    """`count` of `chosen`, evenly spaced among them (the first and last included)."""
    picks = evenly(len(chosen), count)
    return [chosen[i] for i in picks]


def extrapolate(history, t):
    """Linear in the step index from the last two (step, value); plain reuse with one."""
    if len(history) == 1:
        return history[-1][1]
    (a, va), (b, vb) = history[-1], history[-2]
    return va + (va - vb) * ((t - a) / (a - b))


def low_pass(x, radius):
    """The low spatial frequencies of x [B, C, F, H, W] (FFT over H and W)."""
    h, w = x.shape[-2:]
    spec = torch.fft.fft2(x)
    fy = torch.fft.fftfreq(h).abs()[:, None]
    fx = torch.fft.fftfreq(w).abs()[None, :]
    mask = ((fy / 0.5) ** 2 + (fx / 0.5) ** 2 <= radius ** 2).to(x.dtype)
    return torch.fft.ifft2(spec * mask).real


def gap_estimate(kind, history, t):
    if kind == "plain":
        return history[-1][1]
    if kind == "linear":
        return extrapolate(history, t)
    if kind[0] == "scaled":
        if len(history) == 1:
            return history[-1][1]
        return history[-1][1] + kind[1] * (extrapolate(history, t) - history[-1][1])
    if kind[0] == "split":
        lin, plain = extrapolate(history, t), history[-1][1]
        return low_pass(lin, kind[1]) + (plain - low_pass(plain, kind[1]))
    raise ValueError(kind)


GAPS = ["plain", "linear", *(("scaled", s) for s in SCALES), *(("split", r) for r in RADII)]


def gap_name(kind) -> str:
    return kind if isinstance(kind, str) else f"{kind[0]} {kind[1]:g}"


@torch.no_grad()
def sample(wl, seed, cond_steps, uncond_steps, gap=None):
    """Final latents with the conditional branch computed on `cond_steps`, the unconditional on
    `uncond_steps` (None: every step both), each forecast linearly from its own computed
    velocities elsewhere; with `gap`, the unconditional velocity between its computes is the
    conditional one minus the estimated gap instead."""
    pipe, steps = wl.pipe, wl.steps
    sched = make_scheduler(pipe.solver, steps, pipe.shift)
    x = noise_for(wl.shape, seed)
    draw = wl.reseeded(seed).tensors
    cond, uncond = draw["prompt_embeds"], draw["negative_prompt_embeds"]
    hist = {"c": [], "u": [], "g": []}
    every = set(range(steps))
    cs = every if cond_steps is None else set(cond_steps)
    us = every if uncond_steps is None else set(uncond_steps)

    for i, t in enumerate(sched.timesteps):
        tt = torch.full((1,), float(t))
        vc = F.call(wl.model, x, tt, cond) if i in cs else None
        vu = F.call(wl.model, x, tt, uncond) if i in us else None
        if vc is not None:
            hist["c"].append((i, vc))
        if vu is not None:
            hist["u"].append((i, vu))
        if vc is None:
            vc = extrapolate(hist["c"], i)
        if vu is None:
            vu = (vc - gap_estimate(gap, hist["g"], i)) if gap is not None and hist["g"] \
                else extrapolate(hist["u"], i)
        elif i in cs:
            hist["g"].append((i, vc - vu))
        v = vu + wl.guidance * (vc - vu)
        x = sched.step(i, v, x, lincomb)
    return x


def psnr(x, ref) -> float:
    return fidelity(x, ref)["psnr_db"]


def study(wl, seeds):
    """Per point: the baseline's PSNR per draw, every variant's per draw ({label: [PSNR]}) and
    the number of calls."""
    steps = wl.steps
    refs = {s: sample(wl, s, None, None) for s in seeds}
    out = {}
    for point in POINTS:
        calls = round(point * 2 * steps)
        both = evenly(steps, calls // 2)
        base = [psnr(sample(wl, s, both, both), refs[s]) for s in seeds]
        trials: dict[str, list[float]] = {}
        for n_u in range(4, calls // 2 + 1, 2):
            c_steps = evenly(steps, calls - n_u)
            u_steps = subset(c_steps, n_u)
            for kind in (None, *GAPS):
                label = (f"{calls - n_u} cond / {n_u} uncond, "
                         + ("own forecast" if kind is None else f"gap {gap_name(kind)}"))
                trials[label] = [psnr(sample(wl, s, c_steps, u_steps, kind), refs[s])
                                 for s in seeds]
        out[point] = (base, trials, calls)
    return out


def mean(values) -> float:
    return statistics.fmean(min(v, 200.0) for v in values)  # an exact match counts as 200 dB


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="a trained tiny model (default: the "
                    "built-in trained Wan)")
    ap.add_argument("--family", default=None, help="wan or hunyuan (default: the checkpoint's, "
                    "else wan)")
    ap.add_argument("--draws", type=int, default=8, help="held-out draws: the oracle on all, "
                    "one rule chosen on the first half and measured on the second")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    began = time.perf_counter()
    families = trained_families(args.checkpoint)
    family = families[args.family or ("wan" if "wan" in families else next(iter(families)))]
    wl = build_workload(family)
    seeds = FOLLOW_SEEDS[:args.draws]
    res = study(wl, seeds)
    name = args.checkpoint or family.pipeline
    lines = [f"### {family.title}", "",
             "`python -m bench.studies.cfg_reuse_bound"
             + (f" --checkpoint {args.checkpoint}" if args.checkpoint else "")
             + (f" --draws {args.draws}" if args.draws != 8 else "")
             + f"` ({(time.perf_counter() - began) / 60:.1f} min; {machine()}). TRAINED "
             f"weights; {wl.steps} steps {wl.pipe.solver}, CFG {wl.guidance}; held-out "
             f"draws {', '.join(map(str, seeds))}; latent PSNR, mean over the draws.", "",
             "| point (calls of 2 x steps) | baseline: both branches on the same steps | "
             "oracle CFG-aware reuse (best per draw) | gain | per draw: the oracle's choice | "
             "one rule for all draws, chosen on the first half, gain on the second half |",
             "|---|---|---|---|---|---|"]
    verdicts, held = [], []
    half = len(seeds) // 2
    for point, (base, trials, calls) in res.items():
        best = [max((v[k], label) for label, v in trials.items()) for k in range(len(seeds))]
        gain = mean(b[0] for b in best) - mean(base)
        verdicts.append(gain)
        # one rule for every draw, chosen on the first half and measured on the second
        rule = max(trials, key=lambda label: mean(trials[label][:half]))
        kept = mean(trials[rule][half:]) - mean(base[half:])
        held.append(kept)
        lines.append(f"| {point:.2f} ({calls} calls) | {mean(base):.1f} dB | {mean(b[0] for b in best):.1f} "
                     f"dB | {gain:+.1f} dB | "
                     + "; ".join(f"{b[1]} ({b[0] - a:+.1f})" for a, b in zip(base, best, strict=True))
                     + f" | {rule}: {kept:+.1f} dB |")
    clears = all(g >= GOAL_DB for g in verdicts)
    lines += ["", f"Oracle bound {'clears' if clears else 'does not clear'} +{GOAL_DB:g} dB at "
              f"both points ({', '.join(f'{g:+.1f}' for g in verdicts)} dB); one rule chosen on "
              f"draws {', '.join(map(str, seeds[:half]))} gains "
              f"{', '.join(f'{g:+.1f}' for g in held)} dB on draws "
              f"{', '.join(map(str, seeds[half:]))}."]
    head = ["# CFG-aware reuse with correction: its oracle bound", "",
            "One section per model, written by its run (`python -m bench.studies.cfg_reuse_bound "
            "--checkpoint DIR`).", "", __doc__.split("\n\n", 2)[2].strip(), ""]
    write_section(args.out, os.path.relpath(os.path.abspath(name), ROOT) if args.checkpoint
                  else name, lines, "\n".join(head))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

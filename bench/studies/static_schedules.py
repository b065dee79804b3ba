"""Trained weights (issue 39): static schedules chosen on calibration draws against every n-th step.

    python -m bench.studies.static_schedules [--families wan,hunyuan] [--checkpoint PATH] [--prompts 12]

Budgeted mode measures a family of static schedules of the run's own sigmas
(sampling/budget_space.static_schedules: every n-th step after the first 1-3 or at each phase mod n, the
last 1-3 computed, steps paced by |d sigma| ** 0.25 or 0.5, or all but every k-th in a middle
window; linear forecast of the reused residual, no probe or tail block) on three calibration draws,
and `--budget_speedup s` takes the schedule with the least typical error (geometric mean over the
draws) among those computing at most 1/s. This bench runs that choice, calibrated on draws 1-3 of
the trained regime, on held-out prompts it never saw, beside the fixed pattern "every n-th step
after 2, the last one" at the largest fraction within the same target (what SeaCache's cap of 2
reuses and our DeepCache B0 curve settle into). PSNR against the uncached run, pooled over the
prompts and as the mean over them. With --checkpoint, a trained tiny model from that path (the
further held-out model, or one trained elsewhere) in place of the family's committed one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.page import write_page  # noqa: E402
from bench.pareto.report import mean_psnr  # noqa: E402
from bench.pareto.workload import (  # noqa: E402
    BUDGET_SEEDS,
    FOLLOW_SEEDS,
    LAUNCH,
    build_workload,
    our_counter,
    over_prompts,
    run_ours,
    trained_families,
)
from cache import CMConfig  # noqa: E402
from cache.flags import config_from_fields  # noqa: E402
from commands.stage2_backend import make_backend  # noqa: E402
from sampling import (
    budget,  # noqa: E402
    budget_space,
)
from sampling.fidelity import fidelity  # noqa: E402
from sampling.run import noise_for  # noqa: E402

SPEEDUPS = (2.5, 3.0, 4.0)
OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results",
                   "static_schedules.md")


def baseline(steps: int, speedup: float):
    """(label, fields) of every n-th step after 2, the last computed, at the largest fraction
    within 1/speedup."""
    for n in range(2, steps):
        chosen = budget_space.every_nth(steps, n, 2, 1)
        if len(chosen) <= steps / speedup + 1e-9:
            return f"every {n} after 2, last 1", budget_space.static_fields(chosen)
    raise ValueError(f"no every-n-th schedule computes at most 1/{speedup} of {steps} steps")


def family_rows(family, prompts: int) -> tuple[list[str], dict]:
    from commands.calibrate import runner
    from sampling.calibration import measure_space

    wl = build_workload(family)
    steps = wl.steps
    schedules = budget_space.run_static_schedules(wl.pipe.solver, steps, wl.pipe.shift)
    began = time.perf_counter()
    draws = {seed: wl.reseeded(seed).tensors for seed in BUDGET_SEEDS}
    once = runner(lambda plan: make_backend(LAUNCH, {None: wl.model}, plan), wl.pipe, wl.shape,
                  steps=steps, solver=wl.pipe.solver, shift=wl.pipe.shift)
    candidates = measure_space(once, draws, space=schedules)
    block = {"candidates": candidates}
    calibration_s = time.perf_counter() - began
    counter = our_counter(wl)
    seeds = FOLLOW_SEEDS[:prompts]
    noise = torch.cat([noise_for(wl.shape, s) for s in seeds])
    base = over_prompts(wl, lambda w: run_ours(w, CMConfig(), counter), seeds)

    def measured(fields):
        config = config_from_fields(fields)
        run = over_prompts(wl, lambda w: run_ours(w, config, counter), seeds)
        pooled = fidelity(run.latents, base.latents, noise)["psnr_db"]
        return run.fraction, pooled, mean_psnr(run.latents, base.latents, noise), run.follow

    lines = [f"## {family.title}", "",
             f"{steps} steps {wl.pipe.solver} shift {wl.pipe.shift}, CFG {wl.guidance}; "
             f"{len(schedules)} static schedules calibrated on draws "
             f"{', '.join(map(str, BUDGET_SEEDS))} in {calibration_s:.0f} s; evaluated on "
             f"{len(seeds)} held-out prompts (draws {seeds[0]}-{seeds[-1]}).", "",
             "| target | schedule | computed | PSNR pooled | PSNR mean | direction | shape | "
             "typical (rel L2) | bound (rel L2) |", "|---|---|---|---|---|---|---|---|---|"]
    gains = {}
    for s in SPEEDUPS:
        choice = budget.choose(block, speedup=s)
        label, fields = baseline(steps, s)
        f0, p0, m0, follow0 = measured(fields)
        lines.append(f"| speedup {s:g} | {label} | {f0:.3f} | {p0:.1f} | {m0:.1f} | "
                     f"{follow0['direction']:.0%} | {follow0['shape']:.0%} | - | - |")
        if choice is None:
            lines.append(f"| speedup {s:g} | none calibrated computes at most 1/{s:g} | | | | | | | |")
            continue
        f1, p1, m1, follow1 = measured(choice.fields)
        lines.append(f"| speedup {s:g} | chosen: {choice.label} | {f1:.3f} | {p1:.1f} | {m1:.1f} "
                     f"| {follow1['direction']:.0%} | {follow1['shape']:.0%} | {choice.typical:.2e} "
                     f"| {choice.bound:.2e} |")
        gains[s] = (p1 - p0, m1 - m0)
        print("\n".join(lines[-2:]), flush=True)
    lines += ["", "Chosen minus every n-th (pooled / mean dB): " + "; ".join(
        f"speedup {s:g}: {a:+.1f} / {b:+.1f}" for s, (a, b) in gains.items()), ""]
    return lines, gains


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="wan,hunyuan", help="comma-separated: wan, hunyuan")
    ap.add_argument("--checkpoint", help="a trained tiny model of one family in place of its "
                    "committed one (bench/fixtures/train.py --export)")
    ap.add_argument("--prompts", type=int, default=12, help=f"held-out prompts, at most "
                    f"{len(FOLLOW_SEEDS)}")
    ap.add_argument("--out", default=OUT, help="the results page (default %(default)s)")
    args = ap.parse_args(argv)
    if not 1 <= args.prompts <= len(FOLLOW_SEEDS):
        ap.error(f"--prompts {args.prompts}: expected 1 to {len(FOLLOW_SEEDS)}")
    if args.checkpoint is not None and not os.path.exists(args.checkpoint):
        ap.error(f"--checkpoint {args.checkpoint}: no such file or folder")
    torch.set_num_threads(1)
    fams = trained_families(args.checkpoint)
    wanted = [k.strip() for k in args.families.split(",") if k.strip()]
    if args.checkpoint is not None:
        wanted = [k for k in wanted if k in fams]
    unknown = [k for k in wanted if k not in fams]
    if unknown or not wanted:
        ap.error(f"--families: {args.families}; expected a comma-separated subset of "
                 f"{', '.join(fams)}")
    command = "python -m bench.studies.static_schedules " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = ["# Static schedules chosen on calibration draws, trained weights", "",
             f"Reproduce: `{command.strip()}`. Regime: TRAINED weights. What it measures: "
             "bench/studies/static_schedules.py's docstring.", ""]
    for key in wanted:
        body, _ = family_rows(fams[key], args.prompts)
        lines += body
    print("\n".join(lines))
    write_page(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())

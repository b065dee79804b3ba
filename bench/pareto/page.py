"""bench.pareto's results page: the notes under its tables (computed from the run's rows),
the trained regime's caveats and the README that holds them; bench/pareto/report.py has the
standing, tables and plots it is made of."""

from __future__ import annotations

import math
import re
import textwrap

from bench.page import machine, versions
from bench.pareto.report import (
    BEHIND_DB,
    BEHIND_RATIO,
    BUDGETED,
    METRICS,
    budget_standing_of,
    cheapest_for,
    follow_standing,
    front,
    not_registered,
    points,
    standing,
    table,
)
from bench.pareto.workload import BUDGET_SEEDS, INIT, UNSEEN_SEEDS
from sampling.journal import atomic_write

GATED = "gated"  # in a curve's name: reuse decided by the forecast's own error (issue 17)
STEP_WEIGHTED = "ours FBCache +forecast1 gated step-weighted"
CHEAP_END = 2  # how many of diffusers FBC's cheapest front points the step-weighted curve meets


def _curves(rows, family) -> dict[str, list]:
    """Our curves' points (computed, PSNR, method, setting) by curve, budgeted mode left out: its
    points are other curves' settings."""
    out = {}
    for p in points(rows, family, True):
        if p[2] not in BUDGETED:
            out.setdefault(p[2], []).append(p)
    return out


def _bullet(text: str) -> str:
    return textwrap.fill(f"- {text}", 96, subsequent_indent="  ", break_on_hyphens=False)


def _harness_note(rows, fams, facts) -> str | None:
    """Ours FBCache against diffusers' FBC at the thresholds both ran."""
    parts = []
    for fam in fams:
        def ok(method, fam=fam):
            return {r["setting"]: r for r in rows if r["family"] == fam.label and r["method"] == method
                    and r["status"] == "ok"}
        ours, theirs = ok("ours FBCache"), ok("diffusers FBC")
        common = [s for s in theirs if s in ours]
        if not common:
            continue
        same = [s for s in common if abs(ours[s]["computed_fraction"] - theirs[s]["computed_fraction"])
                < 1e-9 and abs(ours[s]["psnr_db"] - theirs[s]["psnr_db"]) < 0.05]
        differ = [f"threshold {s.removeprefix('threshold ')} "
                  f"{ours[s]['computed_fraction'] - theirs[s]['computed_fraction']:+.3f} computed, "
                  f"{ours[s]['psnr_db'] - theirs[s]['psnr_db']:+.1f} dB" for s in common if s not in same]
        text = (f"on {fam.title} ({facts[fam.label]['steps']} steps), the same computed fraction and PSNR "
                f"at threshold {', '.join(s.removeprefix('threshold ') for s in same) or 'none'}")
        if differ:
            text += "; elsewhere ours against diffusers': " + "; ".join(differ)
        parts.append(text)
    if not parts:
        return None
    return _bullet("Check of the harness: ours FBCache without a forecast takes the same decisions as "
                   "diffusers' FBC (the same first-block residual test), but ours also computes the "
                   "last step (`last_steps=1`): " + "; ".join(parts) + ".")


def _front_note(rows, fams) -> str:
    """Which of our curves make our front (budgeted mode aside), the gated ones counted."""
    parts = []
    for fam in fams:
        ours = front([p for pts in _curves(rows, fam.label).values() for p in pts])
        if not ours:
            continue
        by = {}
        for p in ours:  # cheapest first
            by[p[2]] = by.get(p[2], 0) + 1
        gated = sum(n for name, n in by.items() if GATED in name)
        parts.append(f"{gated} of the {len(ours)} points of our front on {fam.title} ("
                     + ", ".join(f"{name.removeprefix('ours ')} {n}" for name, n in by.items()) + ")")
    made = f" The gated curves make {'; '.join(parts)}." if parts else ""
    return _bullet(
        "Where our lead comes from: forecasting the reused residual from the last two or three "
        "computed ones, and (issue 17) deciding reuse by the forecast's own error: the gated curves "
        "compare block 0's residual with its forecast (`--forecast_gate`) and sum that error over "
        "the reuse run (`--fb_accumulate`). Block 0's forecast error follows the middle's closely "
        "(`python -m bench.studies.forecast_signals` measures how closely), so reuse runs stop where the "
        f"extrapolation goes wrong, not where the raw change is large.{made} cache-dit's TaylorSeer "
        "calibrator forecasts like us but decides on the raw change.")


def _cheap_end_note(rows, fams) -> str | None:
    """The step-weighted curve at diffusers FBC's cheapest front points."""
    parts = []
    for fam in fams:
        mine = _curves(rows, fam.label).get(STEP_WEIGHTED)
        fbc = [p for p in points(rows, fam.label, False) if p[2] == "diffusers FBC"]
        if not mine or not fbc:
            continue
        at = []
        for cost, psnr, *_ in front(fbc)[:CHEAP_END]:
            reach = cheapest_for(mine, psnr)
            at.append(f"its {psnr:.1f} dB at {cost:.3f} computed " + (
                "not reached" if reach is None else
                f"reached at {reach[0]:.3f} ({reach[1]:.1f} dB, {reach[1] - psnr:+.1f})"))
        parts.append(f"on {fam.title}, " + "; ".join(at))
    if not parts:
        return None
    return _bullet(
        "The cheap end (issue 17): the step-weighted curve (linear forecast, each step's forecast "
        "error weighted by its size in sigma, no forced last compute) against diffusers FBC's "
        "cheapest front points, on this one draw: " + "; ".join(parts) + ". The first reuse run has "
        "one stored residual and is plain reuse; extrapolating it along block 0's change cannot "
        "help, since that change points almost orthogonally to the middle's "
        "(bench/results/forecast_signals.md).")


def _monotonic_note(rows, fams) -> str:
    """How many of our curves lose PSNR while computing more, and the widest such pair."""
    worst, bad, total = None, 0, 0
    for fam in fams:
        for name, pts in _curves(rows, fam.label).items():
            total += 1
            pairs = [(a, b) for a in pts for b in pts if a[0] < b[0] and a[1] > b[1]]
            bad += bool(pairs)
            for a, b in pairs:
                if worst is None or a[1] - b[1] > worst[0]:
                    worst = (a[1] - b[1], fam, name, a, b)
    if worst is None:
        return _bullet(f"Each of our {total} curves is monotonic in the threshold on this run; the "
                       "front takes each curve's best points.")
    _, fam, name, a, b = worst
    return _bullet(
        f"{bad} of our {total} curves {'is' if bad == 1 else 'are'} not monotonic in the threshold "
        f"(the widest: {fam.title}, "
        f"{name.removeprefix('ours ')} {b[3]}: {b[0]:.3f} computed, {b[1]:.1f} dB; {a[3]}: "
        f"{a[0]:.3f}, {a[1]:.1f} dB): the errors of different reuse runs partly cancel in the final "
        "latent, so a single point carries luck of that order either way; the front takes each "
        "curve's best points.")


def _budget_note(rows, facts) -> str:
    """Budgeted mode's design, and the worst achieved error over its budget in this run."""
    ratios = []
    for r in rows:
        if r["method"] == "ours budgeted" and r["status"] == "ok":
            target = float(re.search(BUDGETED[r["method"]][1], r["setting"]).group(1))
            ratios.append(r["rel_l2"] / target)
    ratios += [u["rel_l2"] / u["target"] for f in facts.values() for u in f["budget_unseen"]
               if u["kind"] == "rel_err"]
    worst = (f"; in this run the achieved error reached at most {max(ratios):.2f} of its budget (the "
             "table's max column)") if ratios else ""
    return _bullet(
        "Budgeted mode (issue 17): `--budget_rel_err` chooses among every configuration we ship "
        f"(sampling/budget_space.py SPACE), calibrated on {len(BUDGET_SEEDS)} draws it is never evaluated "
        "on, by a 95% prediction bound for an unseen draw (log errors, Student's t, the spread "
        "pooled over all configurations as a floor). The bound is conservative by design, so a "
        f"budget buys less speed than the curve could give on one lucky draw{worst}.")


def notes(rows, fams, facts) -> str:
    """The random-weight page's reading: every figure in it computed from this run's rows and
    facts; a note whose rows are missing is left out."""
    spread = max(facts[f.label]["spread"] for f in fams)
    models = "; ".join(f"{fam.title}: {facts[fam.label]['blocks']} blocks of width "
                       f"{getattr(fam.config, 'dim', None) or fam.config.hidden_size}, "
                       f"{facts[fam.label]['tokens']} tokens" for fam in fams)
    bullets = [
        _harness_note(rows, fams, facts), _front_note(rows, fams), _cheap_end_note(rows, fams),
        _monotonic_note(rows, fams),
        _bullet("Measured time: the standing in time compares the loops' CPU seconds directly (ours "
                "and diffusers' do the same maths on the same torch CPU; their uncached CPU seconds "
                "are given above). A single run's CPU time moves between identical runs (up to "
                f"{100 * spread:.0f}% here, the spread above) and by more when other jobs load the "
                "machine, so the standing in time changes between runs wherever the "
                "computed-fraction lead is small. The computed fraction does not move."),
        _budget_note(rows, facts),
        _bullet("Not measured yet: the step weighting on the quadratic forecast at every threshold, "
                "and on real checkpoints."),
        _bullet("Caveats: random weights keep much of the initial noise, so PSNR is inflated "
                "(rel/disp does not flatter); one prompt and one seed make each curve (MagCache "
                f"calibrates on another draw, budgeted mode on {len(BUDGET_SEEDS)} others, and is "
                f"checked on {len(UNSEEN_SEEDS)}); the models are tiny ({models}), so per-op "
                "overhead dominates their time on a CPU.")]
    return "\n".join(b for b in bullets if b) + "\n"


TRAINED_NOTES = """\
- The regime (issue 28): tiny models trained here (each page names its recipe), every setting pooled
  over held-out prompts. Trained weights move further between steps than random ones, so the
  same setting errs more, and a draw that goes another way (the object placed elsewhere)
  weighs most in the pooled PSNR; the mean over draws shows the typical draw. Neighbouring
  points differ by a few dB of luck in which steps a schedule happens to compute.
- What the trained regime asks of the gate (issue 39): a forecast holds for a step or two, and
  which steps a budget computes matters as much as how many. Budgeted mode therefore measures,
  besides the shipped adaptive configurations, a family of static schedules of the run's own
  sigmas (every n-th step after the first few or at each phase mod n, the last 1-3 steps
  computed; steps paced by the size of the steps in sigma; or, at the high end, all but every
  k-th step of a middle window; linear forecast between) on its three calibration draws, and
  `--budget_speedup s` takes the one with the least typical error (geometric mean over its
  calibration and screen draws) among those whose computed fraction stays within 1/s
  (bench/results/static_schedules.md). A static schedule reads nothing from the device.
- Every figure above is printed by this run; the standing tables name, for each best-peer
  point, which of our settings the comparison used.
"""


def trained_caveats(fams, facts, follow: int) -> str:
    """The trained regime's caveats bullet, from this run's prompt count and models."""
    prompts = (f"{follow} prompts (one prompt is {100 / follow:.0f} points of accuracy)" if follow
               else "one draw (prompt following not measured)")
    models = "; ".join(f"{fam.title}: {facts[fam.label]['blocks']} blocks of "
                       f"{facts[fam.label]['tokens']} tokens" for fam in fams)
    text = (f"- Caveats: {prompts}; tiny models ({models}); CPU seconds of a tiny model are "
            "mostly per-call overhead, so the computed fraction is the figure to compare.")
    return textwrap.fill(text, 96, subsequent_indent="  ", break_on_hyphens=False) + "\n"


def write_readme(path, rows, fams, facts, args, elapsed, loads, have_plot):
    names = {f.label: f.title for f in fams}
    not_run = [r for r in rows if r["status"] != "ok" and r["family"] in names]
    standings = {f.label: {m: standing(rows, f.label, m) for m in METRICS} for f in fams}
    budgets = {f.label: budget_standing_of(rows, f.label, facts[f.label]) for f in fams}
    # what one flag gives with PSNR as the mean over draws (the promises read the same)
    budgets_mean = {f.label: budget_standing_of(rows, f.label, facts[f.label], "psnr_db_mean", False)
                    for f in fams}
    regime = "trained weights" if args.weights == "trained" else "random weights"
    lines = ["# Fidelity against speed: our caching beside diffusers' cache hooks and cache-dit", "",
             *(["**QUICK MODE: NOT A RESULT.** Every other setting of each curve, and the run's "
                "own step count: a page for iterating on the bench, not a figure to cite or "
                "compare (issue 60).", ""] if args.quick else []),
             f"Reproduce: `{args.command}` ({'quick mode, ' if args.quick else ''}"
             f"{elapsed / 60:.1f} min for this run; 1-minute load average {loads[0]:.2f} at the "
             f"start, {loads[1]:.2f} at the end: other jobs shared the machine).", "",
             "Issue 9's goal: at equal fidelity 1.25 times the speedup of the best peer, or "
             f"+3 dB PSNR at equal speedup. Issue 39's floor: behind at no point (at least "
             f"{BEHIND_DB:+g} dB at matched computed fraction and {BEHIND_RATIO:g}x at matched "
             f"PSNR). This run, on {regime.upper()}:", ""]
    for k, by_metric in standings.items():
        lines += [f"- {names[k]} ({regime}): {summary}." for _, summary in by_metric.values()]
        lines.append(f"- {names[k]} ({regime}), PSNR pooled: {budgets[k][1]}.")
        lines.append(f"- {names[k]} ({regime}), PSNR mean over draws: {budgets_mean[k][1]}.")
    if args.weights == "trained" and args.follow:
        lines += [f"- {f.title}, prompt following: {follow_standing(rows, f.label, args.follow)[1]}."
                  for f in fams]
    lines += ["", "## Setup", "",
              f"- Machine: {machine()}.", f"- Peers as installed: {versions()}.",
              (f"- Models: random weights, {INIT}; the same weights in ours and, through "
               "modules/convert.py, in diffusers' transformer." if not args.weights == "trained"
               else "- Models: TRAINED weights, the tiny models trained here (issue 28, "
               "bench/fixtures; each one's MODEL_CARD.md beside its weights), loaded "
               "by modules/checkpoint.py as a real checkpoint; the same weights in diffusers' "
               f"transformer through modules/convert.py. Every setting runs on {args.follow} "
               "held-out prompts with one noise draw each: PSNR pooled over all of them (one "
               "figure from every draw's error together) and the mean of each draw's own PSNR, "
               "rel L2 pooled, CPU seconds summed."),
              "- Every run: the same noise and text embeddings (seed 0), our scheduler, the same "
              "step count and CFG, cond then uncond per step; the peers drive diffusers' model "
              "in a small loop (`denoise_diffusers`), ours run on the torch backend (eager).",
              "- computed: fraction of block evaluations that ran, counted for every method by "
              "forward pre-hooks on the first linear of each block's sub-layers (Wan: "
              "self-attention, cross-attention, FFN; HunyuanVideo-1.5: joint attention, image "
              "FFN, text FFN). CPU s: process CPU time of the denoising loop (one torch "
              "thread; steadier than wall time while other jobs share the machine; both are in "
              "the table); speedup: the same implementation's uncached CPU time over the run's. "
              "PSNR, rel L2 "
              "and rel/disp (error over the uncached run's displacement from the noise): final "
              "latents against the same implementation's uncached latents."]
    if args.weights == "trained":
        from bench.fixtures.recipes import provenance
        lines += [f"- {fam.title}: {provenance(fam.checkpoint)}." for fam in fams]
    for fam in fams:
        f, a = facts[fam.label], facts[fam.label]["agreement"]
        psnr = "inf (identical)" if a["psnr_db"] == math.inf else f"{a['psnr_db']:.1f} dB"
        lines.append(f"- {fam.title}: {f['blocks']} blocks, latent {f['shape']} ({f['tokens']} "
                     f"tokens), {f['steps']} steps {f['solver']} shift {f['shift']}, CFG "
                     f"{f['guidance']}. Uncached diffusers against uncached ours: rel L2 "
                     f"{a['rel_l2']:.1e}, PSNR {psnr}. Uncached loop: {f['uncached_cpu'][0]:.2f} "
                     f"CPU s ours, {f['uncached_cpu'][1]:.2f} diffusers'; two identical uncached "
                     f"runs differ by up to {100 * f['spread']:.0f}%.")
        checked = f.get("adapter") or []
        if checked:
            same = sum(c["same_blocks"] for c in checked)
            gap = max(0.0 if c["psnr_db"] == c["ours_psnr_db"] else abs(c["psnr_db"] - c["ours_psnr_db"])
                      for c in checked)
            lines.append(f"  The presets through the diffusers adapter (our gate inside diffusers' "
                         f"model, run by the peers' loop): the same per-call block schedule as "
                         f"ours at {same} of {len(checked)}, PSNR within {gap:.2f} dB of ours.")
    if not_run:
        lines += ["", "Not run (the library's own error; nothing is estimated in its place):", ""]
        lines += [f"- {names[r['family']]}: {r['method']}: {r['status'][len('not run: '):]}"
                  for r in not_run]
        if any("not registered" in r["status"] for r in not_run):
            lines += ["", not_registered()]
    if have_plot:
        lines += ["", "![PSNR against computed fraction (top) and the loop's CPU seconds (bottom)]"
                      "(pareto.png)"]
    for fam in fams:
        lines += ["", f"## Where we stand: {fam.title} ({regime})", ""]
        for metric, (body, _) in standings[fam.label].items():
            lines += [f"### PSNR {METRICS[metric]}", ""] + body + [""]
        lines += ["", "### One flag: budgeted mode and the presets", ""] + budgets[fam.label][0]
        lines += ["", "With PSNR as the mean over draws:", ""] + budgets_mean[fam.label][0]
        if fam.trained and args.follow:
            lines += ["", "### Prompt following against computed fraction", ""]
            lines += follow_standing(rows, fam.label, args.follow)[0]
            lines += ["", "![prompt following against computed fraction](follow.png)"]
    reading = (TRAINED_NOTES + trained_caveats(fams, facts, args.follow) if args.weights == "trained"
               else notes(rows, fams, facts))
    lines += ["", "## Reading it", "", reading]
    for fam in fams:
        lines += [f"## Table: {fam.title}", ""] + table(rows, fam.label) + [""]
    lines += ["Settings: " + "; ".join(f"{k}: {v}" for k, v in facts[fams[0].label]["about"].items()
                                       if v) + ".", "",
              "Files: results.csv (every row), table.md, pareto.png, traces_<family>.json.gz "
              "(per run: the block-equivalents computed in each "
              "model call as the hooks counted them, and the method's own decisions: our "
              "gate's trace, cache-dit's cached steps and residual diffs, MagCache's "
              "calibration ratios, the budget's chosen configuration and its bound), "
              "budget_profile_<family>.json (budgeted mode's calibration: every "
              "configuration's rel L2 and computed fraction on each held-out draw)."]
    atomic_write(path, lambda fh: fh.write("\n".join(lines) + "\n"))

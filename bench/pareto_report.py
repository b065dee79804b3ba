"""bench/pareto.py's report: rows, where we stand against the peers (point by point, both
goals, pooled over draws and as the mean over draws), budgeted mode's standing, prompt
following, the tables, plots and the results page."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import re
import textwrap

import torch

from bench.pareto_workload import BUDGET_SEEDS, INIT, SEED, UNSEEN_SEEDS
from sampling.fidelity import fidelity

FOLLOW = tuple(f"follow_{k}" for k in ("foreground", "background", "direction", "shape"))
COLUMNS = ("family", "method", "impl", "setting", "computed_fraction", "cpu_s", "wall_s",
           "speedup", "psnr_db", "psnr_db_mean", "rel_l2", "rel_to_displacement", *FOLLOW,
           "status")
# The two aggregations over a row's draws (trained regime: one held-out prompt per draw).
# pooled: one PSNR over every draw's error together, where one draw that went another way
# weighs most; mean: each draw's own PSNR, averaged (draws where a run equals its uncached run
# exactly, PSNR inf, are left out of the mean).
METRICS = {"psnr_db": "pooled over draws", "psnr_db_mean": "mean over draws"}


def mean_psnr(latents, base, noise) -> float:
    """The mean over draws (the batch axis) of each draw's own PSNR."""
    each = [fidelity(latents[k:k + 1], base[k:k + 1], noise[k:k + 1])["psnr_db"]
            for k in range(latents.shape[0])]
    finite = [v for v in each if v != math.inf]
    return sum(finite) / len(finite) if finite else math.inf


def row(family, method, impl, setting, run=None, base=None, noise=None, status="ok") -> dict:
    r = dict.fromkeys(COLUMNS)
    r.update(family=family, method=method, impl=impl, setting=setting, status=status)
    if run is not None:
        r.update(computed_fraction=run.fraction, cpu_s=run.cpu, wall_s=run.wall)
        if run.follow is not None:
            r.update({k: run.follow[k[len("follow_"):]] for k in FOLLOW})
        if base is not None:
            f = fidelity(run.latents, base.latents, noise)
            r.update(speedup=base.cpu / run.cpu, psnr_db=f["psnr_db"], rel_l2=f["rel_l2"],
                     rel_to_displacement=f["rel_to_displacement"],
                     psnr_db_mean=mean_psnr(run.latents, base.latents, noise))
    return r


def show(r: dict) -> str:
    def num(v, fmt):
        return "-" if v is None else ("inf" if v == math.inf else format(v, fmt))
    text = (f"{r['method']:30s} {r['setting']:26s} {num(r['computed_fraction'], '.3f'):>6s} "
            f"{num(r['cpu_s'], '.2f'):>6s} {num(r['wall_s'], '.2f'):>6s} "
            f"{num(r['speedup'], '.2f'):>5s}x "
            f"{num(r['psnr_db'], '.1f'):>6s} {num(r['psnr_db_mean'], '.1f'):>6s} "
            f"{num(r['rel_l2'], '.2e'):>9s} "
            f"{num(r['rel_to_displacement'], '.2e'):>9s}")
    if r.get("follow_foreground") is not None:
        text += "  prompt " + " ".join(f"{k[7:9]} {r[k]:.0%}" for k in FOLLOW)
    return text if r["status"] == "ok" else f"{text}  {r['status']}"


# --- where we stand ---------------------------------------------------------------------------

MATCH_TOLERANCE = 0.01  # computed fractions within this count as matched (they come in steps)
GOAL_SPEEDUP, GOAL_DB = 1.25, 3.0  # issue 9: at equal fidelity 1.25x, or +3 dB at equal speed
# issue 39: behind a peer point where ours loses more than this at matched computed fraction,
# or computes more than 1/BEHIND_RATIO of the peer's fraction at matched PSNR
BEHIND_DB, BEHIND_RATIO = -0.5, 0.95


def front(points):
    """Non-dominated (cost, PSNR, ...) points, cheapest first: nothing cheaper has as much PSNR."""
    out, best = [], -math.inf
    for p in sorted(points, key=lambda p: (p[0], -p[1])):
        if p[1] > best:
            out.append(p)
            best = p[1]
    return out


def compare(ours, peer, tolerance):
    """For each point (cost, PSNR, ...) of the peer's front: ours' best PSNR at no more cost
    (+ tolerance) as a gain in dB, and the peer's cost over the least cost at which ours reaches
    the peer's PSNR (a speedup ratio); None where ours has no such point."""
    out = []
    for point in front(peer):
        cost, psnr = point[:2]
        at_cost = [q for c, q, *_ in ours if c <= cost + tolerance]
        reach = [c for c, q, *_ in ours if q >= psnr]
        out.append((point, max(at_cost) - psnr if at_cost else None,
                    cost / min(reach) if reach else None))
    return out


def behind(d_psnr, ratio) -> bool:
    """Issue 39's floor: ours loses at a peer point when it has no point as cheap, no point as
    good, or either comparison falls below the floor."""
    return d_psnr is None or ratio is None or d_psnr < BEHIND_DB or ratio < BEHIND_RATIO


def goal_met(d_psnr, ratio) -> bool:
    return (d_psnr is not None and d_psnr >= GOAL_DB) or (ratio is not None and ratio >= GOAL_SPEEDUP)


def both_met(d_psnr, ratio) -> bool:
    """Issue 17's stricter goal: +3 dB at the peer's fraction and 1.25x at its PSNR, at once."""
    return (d_psnr is not None and d_psnr >= GOAL_DB) and (ratio is not None and ratio >= GOAL_SPEEDUP)


def points(rows, family, ours: bool, cost="computed", metric="psnr_db"):
    """(cost, PSNR, method, setting) of every finished run with finite PSNR (`metric`: pooled or
    mean over draws), ours' or the peers'; cost is the computed fraction, or the loop's CPU
    seconds: ours and diffusers' run the same maths on the same torch CPU, so their seconds
    compare directly (no baseline's noise in between). Ours only where it computed less than
    every block (issue 39: a run that skipped nothing is the uncached run, not a point of ours)."""
    return [(r["computed_fraction"] if cost == "computed" else r["cpu_s"], r[metric],
             r["method"], r["setting"])
            for r in rows
            if r["family"] == family and r["status"] == "ok" and r["method"] != "uncached"
            and r[metric] not in (None, math.inf) and (r["impl"] == "ours") == ours
            and not (ours and r["computed_fraction"] >= 1.0)]


def _fmt(v, fmt, none="not reached"):
    return none if v is None else format(v, fmt)


def _best_at(ours, cost, tolerance):
    """Ours' point with the best PSNR at no more than `cost` (+ tolerance), or None."""
    return max((p for p in ours if p[0] <= cost + tolerance), key=lambda p: p[1], default=None)


def _cheapest_for(ours, psnr):
    """Ours' cheapest point reaching `psnr`, or None."""
    return min((p for p in ours if p[1] >= psnr), key=lambda p: p[0], default=None)


def standing(rows, family, metric="psnr_db") -> tuple[list[str], str]:
    """Markdown lines (ours, every curve together, against each peer, then against the best
    peer point by point, naming ours' points each comparison used) and a one-line summary of
    the goal, with PSNR aggregated over the draws as `metric` says (pooled or mean)."""
    ours, peers = points(rows, family, True, metric=metric), points(rows, family, False, metric=metric)
    if not ours or not peers:
        return ["No comparison: ours or every peer is missing for this family."], "no comparison"
    names = list(dict.fromkeys(p[2] for p in peers))
    lines = [f"PSNR {METRICS[metric]}. At matched computed fraction (ours = the best of all our "
             "curves, runs that computed every block left out; a peer's points are its Pareto "
             f"front; matched means ours computes at most {MATCH_TOLERANCE} more of the blocks):",
             "", "| peer | front points | PSNR gain of ours at matched computed fraction (min / "
             "median / max, dB) | compute speedup of ours at matched PSNR (min / median / max) "
             "| goal met | behind |", "|---|---|---|---|---|---|"]
    for name in names:
        res = compare(ours, [p for p in peers if p[2] == name], MATCH_TOLERANCE)
        lines.append(f"| {name} | {len(res)} | {_summary([d for _, d, _ in res], '+.1f')} | "
                     f"{_summary([r for _, _, r in res], '.2f', 'x')} | "
                     f"{sum(goal_met(d, r) for _, d, r in res)}/{len(res)} | "
                     f"{sum(behind(d, r) for _, d, r in res)}/{len(res)} |")
    lines += ["", "Against the best peer (the front of all peers together), point by point; "
              "ours' points named by curve and setting:", "",
              "| best-peer point | computed, PSNR | ours' best PSNR at that computed fraction "
              "| ours' least computed fraction for that PSNR | goal (+3 dB or 1.25x) "
              "| both (+3 dB and 1.25x) | behind (under -0.5 dB or 0.95x) |",
              "|---|---|---|---|---|---|---|"]
    res = compare(ours, peers, MATCH_TOLERANCE)
    for (cost, psnr, name, setting), d, ratio in res:
        at, cheapest = _best_at(ours, cost, MATCH_TOLERANCE), _cheapest_for(ours, psnr)
        at_text = "none" if at is None else f"{at[1]:.1f} ({d:+.1f} dB; {at[2]}, {at[3]})"
        cheap_text = ("not reached" if cheapest is None
                      else f"{cheapest[0]:.3f} ({ratio:.2f}x; {cheapest[2]}, {cheapest[3]})")
        lines.append(f"| {name}, {setting} | {cost:.3f}, {psnr:.1f} dB | {at_text} | {cheap_text} "
                     f"| {'met' if goal_met(d, ratio) else 'not met'} "
                     f"| {'met' if both_met(d, ratio) else 'not met'} "
                     f"| {'BEHIND' if behind(d, ratio) else 'no'} |")
    met = sum(goal_met(d, r) for _, d, r in res)
    both = sum(both_met(d, r) for _, d, r in res)
    lost = sum(behind(d, r) for _, d, r in res)
    timed = compare(points(rows, family, True, "cpu", metric), points(rows, family, False, "cpu", metric),
                    0.0)
    timed_met = sum(goal_met(d, r) for _, d, r in timed)
    gains, ratios = [d for _, d, _ in timed], [r for _, _, r in timed]
    lines += ["", f"Goal met at {met} of {len(res)} points of the best peer's front in computed "
              f"fraction; both forms at once (issue 17) at {both}; behind at {lost}. In measured "
              "time (the loop's CPU seconds, ours against the peers' directly, one run each, no "
              f"tolerance): PSNR gain at no more CPU time {_summary(gains, '+.1f')} dB, speedup "
              f"ratio at matched PSNR {_summary(ratios, '.2f', 'x')}; goal met at {timed_met} of "
              f"{len(timed)} points of the best peer's front in CPU time."]
    summary = (f"PSNR {METRICS[metric]}: goal met at {met} of {len(res)} points of the best "
               f"peer's front in computed fraction, both forms at once (+3 dB and 1.25x) at {both}, "
               f"behind at {lost} (PSNR gain of ours at matched fraction "
               f"{_summary([d for _, d, _ in res], '+.1f')} dB, min / median / max; compute "
               f"ratio at matched PSNR {_summary([r for _, _, r in res], '.2f', 'x')}), and at "
               f"{timed_met} of {len(timed)} in measured CPU time")
    return lines, summary


def _summary(values, fmt, unit=""):
    """min / median / max of the values that exist."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return "none"
    mid = values[len(values) // 2]
    return " / ".join(format(v, fmt) + unit for v in (values[0], mid, values[-1]))


# --- writing it down --------------------------------------------------------------------------

def write_csv(rows, path):
    import csv
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def table(rows, family) -> list[str]:
    def num(v, fmt):
        return "-" if v is None else ("inf" if v == math.inf else format(v, fmt))
    lines = ["| method | setting | computed | CPU s | wall s | speedup | PSNR dB pooled | "
             "PSNR dB mean | rel L2 | rel/disp |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["family"] != family:
            continue
        name = f"{r['impl']} uncached" if r["method"] == "uncached" else r["method"]
        if r["status"] != "ok":
            lines.append(f"| {name} | {r['setting']} | {r['status']} | | | | | | | |")
            continue
        lines.append(f"| {name} | {r['setting']} | {num(r['computed_fraction'], '.3f')} | "
                     f"{num(r['cpu_s'], '.2f')} | {num(r['wall_s'], '.2f')} | "
                     f"{num(r['speedup'], '.2f')}x | "
                     f"{num(r['psnr_db'], '.1f')} | {num(r['psnr_db_mean'], '.1f')} | "
                     f"{num(r['rel_l2'], '.2e')} | "
                     f"{num(r['rel_to_displacement'], '.2e')} |")
    return lines


STYLE = {"ours": "-", "diffusers": "--", "cache-dit": ":"}


def plot(rows, fams, path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -r requirements-dev.txt)")
        return False
    fig, axes = plt.subplots(2, len(fams), figsize=(7.5 * len(fams), 10), squeeze=False)
    markers = "osD^v<>phX*"
    tab20 = plt.get_cmap("tab20")
    # one colour and marker per method in every panel; tab20's strong shades first
    order = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "uncached"))
    shades = [tab20(i) for i in (*range(0, 20, 2), *range(1, 20, 2))]
    for col, fam in enumerate(fams):
        names = list(dict.fromkeys(r["method"] for r in rows if r["family"] == fam.key
                                   and r["method"] != "uncached" and r["status"] == "ok"))
        for name in names:
            k = order.index(name)
            pts = sorted((r["computed_fraction"], r["cpu_s"], r["psnr_db"], r["impl"])
                         for r in rows if r["family"] == fam.key and r["method"] == name
                         and r["status"] == "ok" and r["psnr_db"] != math.inf)
            if not pts:
                continue
            impl = pts[0][3]
            style = dict(linestyle=STYLE[impl], marker=markers[k % len(markers)],
                         color=shades[k % 20],
                         linewidth=2.2 if impl == "ours" else 1.3, label=name, markersize=5)
            axes[0][col].plot([p[0] for p in pts], [p[2] for p in pts], **style)
            by_time = sorted(pts, key=lambda p: p[1])
            axes[1][col].plot([p[1] for p in by_time], [p[2] for p in by_time], **style)
        axes[0][col].set_title(f"{fam.title}, {fam.config.num_layers} blocks", fontsize=10)
        axes[0][col].set_xlabel("fraction of block evaluations computed (hooks on sub-layers)")
        axes[1][col].set_xlabel("CPU seconds of the denoising loop (one torch thread; lower is "
                                "faster)")
        for ax in axes[:, col]:
            ax.set_ylabel("PSNR of final latents vs uncached (dB)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            found = re.search(r"model name\s*:\s*(.*)", f.read())
            cpu = found.group(1) if found else cpu
    return (f"{cpu}, {os.cpu_count()} cores visible, torch {torch.__version__} on CPU with "
            f"{torch.get_num_threads()} thread(s), Python {platform.python_version()}, "
            f"{platform.system()} {platform.release()}")


def versions(names=("diffusers", "cache_dit")) -> str:
    out = []
    for name in names:
        try:
            module = __import__(name)
            out.append(f"{name.replace('_', '-')} {module.__version__}")
        except Exception as exc:  # noqa: BLE001
            out.append(f"{name.replace('_', '-')} not importable ({type(exc).__name__})")
    return ", ".join(out)


def not_registered() -> str:
    """Why diffusers' hooks refuse HunyuanVideo-1.5, naming the installed diffusers (the one that
    raised in this run)."""
    return ("diffusers' FirstBlockCache, MagCache and SeaCache hooks look each block's class up in "
            f"`TransformerBlockRegistry` (diffusers/hooks/_helpers.py); {versions(('diffusers',))} "
            "registers `WanTransformerBlock` and the HunyuanVideo 1.0 blocks but not "
            "`HunyuanVideo15TransformerBlock`, so `enable_cache` raises on HunyuanVideo-1.5. Its "
            "TaylorSeer hook selects modules by name and runs; cache-dit ships a HunyuanVideo-1.5 "
            "adapter and runs.")


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
            return {r["setting"]: r for r in rows if r["family"] == fam.key and r["method"] == method
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
        text = (f"on {fam.title} ({facts[fam.key]['steps']} steps), the same computed fraction and PSNR "
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
        ours = front([p for pts in _curves(rows, fam.key).values() for p in pts])
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
        "(`python bench/forecast_signals.py` measures how closely), so reuse runs stop where the "
        f"extrapolation goes wrong, not where the raw change is large.{made} cache-dit's TaylorSeer "
        "calibrator forecasts like us but decides on the raw change.")


def _cheap_end_note(rows, fams) -> str | None:
    """The step-weighted curve at diffusers FBC's cheapest front points."""
    parts = []
    for fam in fams:
        mine = _curves(rows, fam.key).get(STEP_WEIGHTED)
        fbc = [p for p in points(rows, fam.key, False) if p[2] == "diffusers FBC"]
        if not mine or not fbc:
            continue
        at = []
        for cost, psnr, *_ in front(fbc)[:CHEAP_END]:
            reach = _cheapest_for(mine, psnr)
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
        for name, pts in _curves(rows, fam.key).items():
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
        f"(sampling/budget.py SPACE), calibrated on {len(BUDGET_SEEDS)} draws it is never evaluated "
        "on, by a 95% prediction bound for an unseen draw (log errors, Student's t, the spread "
        "pooled over all configurations as a floor). The bound is conservative by design, so a "
        f"budget buys less speed than the curve could give on one lucky draw{worst}.")


def notes(rows, fams, facts) -> str:
    """The random-weight page's reading: every figure in it computed from this run's rows and
    facts; a note whose rows are missing is left out."""
    spread = max(facts[f.key]["spread"] for f in fams)
    models = "; ".join(f"{fam.title}: {facts[fam.key]['blocks']} blocks of width "
                       f"{getattr(fam.config, 'dim', None) or fam.config.hidden_size}, "
                       f"{facts[fam.key]['tokens']} tokens" for fam in fams)
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


def follow_mean(r) -> float:
    return sum(r[k] for k in FOLLOW) / len(FOLLOW)


def follow_standing(rows, family, n) -> tuple[list[str], str]:
    """Trained regime: prompt following of every setting against its computed fraction, and
    where caching starts to break the prompt, ours (every curve) against the peers (every
    peer). A setting keeps the prompt when no attribute loses more than one of the n prompts
    against its own implementation's uncached run."""
    done = [r for r in rows if r["family"] == family and r["status"] == "ok"
            and r.get("follow_foreground") is not None]
    if not done:
        return ["Prompt following was not measured."], "prompt following not measured"
    base = {r["impl"]: r for r in done if r["method"] == "uncached"}
    slack = 1.0 / n + 1e-9

    def keeps(r):
        ref = base["ours" if r["impl"] == "ours" else "diffusers"]
        return all(r[k] >= ref[k] - slack for k in FOLLOW)

    lines = [f"Each setting on the same {n} held-out prompts (attribute combinations never "
             "trained on; one noise draw each), decoded and read by bench/fixtures/analyser.py. "
             "mean: of the four attributes. keeps: no attribute loses more than one prompt "
             "against the same implementation's uncached run.", "",
             "| method | setting | computed | fg color | bg color | direction | shape | mean | "
             "keeps the prompt |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(done, key=lambda r: (r["impl"] != "ours", r["method"] != "uncached",
                                         r["computed_fraction"])):
        name = f"{r['impl']} uncached" if r["method"] == "uncached" else r["method"]
        lines.append(f"| {name} | {r['setting']} | {r['computed_fraction']:.3f} | "
                     + " | ".join(f"{r[k]:.0%}" for k in FOLLOW)
                     + f" | {follow_mean(r):.0%} | {'yes' if keeps(r) else 'NO'} |")
    cached = [r for r in done if r["method"] != "uncached"]
    parts = []
    for who, mine in (("ours", True), ("the peers", False)):
        side = [r for r in cached if (r["impl"] == "ours") == mine]
        kept = [r for r in side if keeps(r)]
        broke = [r for r in side if not keeps(r)]
        least = min(kept, key=lambda r: r["computed_fraction"], default=None)
        most_broken = max(broke, key=lambda r: r["computed_fraction"], default=None)
        text = (f"{who}: least computed fraction keeping the prompt "
                + (f"{least['computed_fraction']:.3f} ({least['method']}, {least['setting']}, "
                   f"mean {follow_mean(least):.0%})" if least else "none"))
        text += ("; the most computed setting that breaks it "
                 + (f"{most_broken['computed_fraction']:.3f} ({most_broken['method']}, "
                    f"{most_broken['setting']}, mean {follow_mean(most_broken):.0%})"
                    if most_broken else "none"))
        parts.append(text)
    summary = "; ".join(parts)
    lines += ["", f"Where caching starts to break the prompt: {summary}."]
    return lines, summary


def plot_follow(rows, fams, path) -> bool:
    """Prompt following (mean of the four attributes) against computed fraction, per family."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(fams), figsize=(7.5 * len(fams), 5), squeeze=False)
    for ax, fam in zip(axes[0], fams, strict=True):
        done = [r for r in rows if r["family"] == fam.key and r["status"] == "ok"
                and r.get("follow_foreground") is not None]
        for impl, style in (("ours", dict(marker="o", color="tab:blue")),
                            ("peers", dict(marker="s", color="tab:orange", fillstyle="none"))):
            pts = [(r["computed_fraction"], follow_mean(r)) for r in done
                   if r["method"] != "uncached" and (r["impl"] == "ours") == (impl == "ours")]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle="none", label=impl,
                    **style)
        for r in done:
            if r["method"] == "uncached" and r["impl"] == "ours":
                ax.axhline(follow_mean(r), color="gray", linestyle="--", label="uncached")
        ax.set_title(fam.title, fontsize=10)
        ax.set_xlabel("fraction of block evaluations computed")
        ax.set_ylabel("prompt following, mean of 4 attributes")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


TRAINED_NOTES = """\
- The regime (issue 28): tiny models trained here on procedural clips, every setting pooled
  over held-out prompts. Trained weights move further between steps than random ones, so the
  same setting errs more, and a draw that goes another way (the object placed elsewhere)
  weighs most in the pooled PSNR; the mean over draws shows the typical draw. Neighbouring
  points differ by a few dB of luck in which steps a schedule happens to compute.
- What the trained regime asks of the gate (issue 39): a forecast holds for a step or two, and
  which steps a budget computes matters as much as how many. Budgeted mode therefore measures,
  besides the shipped adaptive configurations, a family of static schedules of the run's own
  sigmas (every n-th step after the first few, the last 1-3 steps computed, or steps paced by
  the size of the steps in sigma; linear forecast between) on its three calibration draws, and
  `--budget_speedup s` takes the one with the least error bound among those computing at most
  1/s (bench/results/static_schedules.md). A static schedule reads nothing from the device.
- Every figure above is printed by this run; the standing tables name, for each best-peer
  point, which of our settings the comparison used.
"""


def trained_caveats(fams, facts, follow: int) -> str:
    """The trained regime's caveats bullet, from this run's prompt count and models."""
    prompts = (f"{follow} prompts (one prompt is {100 / follow:.0f} points of accuracy)" if follow
               else "one draw (prompt following not measured)")
    models = "; ".join(f"{fam.title}: {facts[fam.key]['blocks']} blocks of "
                       f"{facts[fam.key]['tokens']} tokens" for fam in fams)
    text = (f"- Caveats: {prompts}; tiny models ({models}); CPU seconds of a tiny model are "
            "mostly per-call overhead, so the computed fraction is the figure to compare.")
    return textwrap.fill(text, 96, subsequent_indent="  ", break_on_hyphens=False) + "\n"


FRONT_DB = 1.0  # issue 17: budgeted mode's points lie within this of our front


BUDGETED = {"ours budgeted": ("rel_err", r"budget ([0-9.e+-]+)", "rel L2 budget"),
            "ours budgeted speedup": ("speedup", r"speedup ([0-9.e+-]+)", "speedup")}


def kept(kind: str, target: float, rel_l2: float, computed: float) -> bool:
    """Whether one run kept its target: the error budget, or at most 1/s of the blocks."""
    return rel_l2 <= target if kind == "rel_err" else computed <= 1.0 / target + 1e-9


def budget_standing(rows, family, unseen) -> tuple[list[str], str]:
    """Budgeted mode: each target (an error budget or a speedup) on the draws it was not
    calibrated on (the row's own draws and UNSEEN_SEEDS but SEED), and each of its points
    against our front (the other curves) and the best peer, both forms of the goal. A point
    counts as met only where the chosen run computed less than every block and a peer point
    exists on each side (issue 39). Markdown lines and a one-line summary."""
    runs = [r for r in rows if r["family"] == family and r["method"] in BUDGETED
            and r["status"] == "ok"]
    if not runs:
        return ["Budgeted mode did not run."], "budgeted mode did not run"
    ours = [p for p in points(rows, family, True) if p[2] not in BUDGETED]
    peers = points(rows, family, False)
    unseen_seeds = [s for s in UNSEEN_SEEDS if s != SEED]
    lines = [f"Budgeted mode (`--budget_profile` with `--budget_rel_err` or `--budget_speedup`), "
             f"calibrated on draws {', '.join(map(str, BUDGET_SEEDS))}; each target's point is "
             "its run on the draws every curve here is measured on, and it is also run on draws "
             f"{', '.join(map(str, unseen_seeds))}. PSNR pooled over draws:", "",
             "| target | chosen | computed | PSNR dB | achieved rel L2 (max over the point and the "
             "unseen draws) | kept | our front's best PSNR at that fraction | best peer's PSNR at "
             "no more computed (ours' gain) | best peer's least computed for that PSNR (ratio) "
             "| both (+3 dB and 1.25x) |", "|---|---|---|---|---|---|---|---|---|---|"]
    kept_all = near_all = both_all = draws = 0
    uncached = []
    for r in runs:
        kind, pattern, name = BUDGETED[r["method"]]
        target = float(re.search(pattern, r["setting"]).group(1))
        choice = r["setting"].split(": ", 1)[1] if ": " in r["setting"] else "-"
        others = [u for u in unseen if u["kind"] == kind and u["target"] == target]
        achieved = [(r["rel_l2"], r["computed_fraction"])] + [(u["rel_l2"], u["computed"])
                                                              for u in others]
        draws += len(achieved)
        n_kept = sum(kept(kind, target, e, c) for e, c in achieved)
        f, q = r["computed_fraction"], r["psnr_db"]
        if f >= 1.0:  # nothing calibrated promises it: one line, no technique named
            uncached.append(f"{name} {target:g}")
            kept_all += n_kept
            lines.append(f"| {name} {target:g} | uncached: no calibrated configuration promises "
                         f"it | {f:.3f} | - | - | {n_kept}/{len(achieved)} | - | - | - | not met |")
            continue
        front_at = max((p for c, p, *_ in ours if c <= f + MATCH_TOLERANCE), default=None)
        near = front_at is None or q >= front_at - FRONT_DB
        peer_at = max((p for c, p, *_ in peers if c <= f + MATCH_TOLERANCE), default=None)
        gain = None if peer_at is None else q - peer_at
        reach = [c for c, p, *_ in peers if p >= q]
        ratio = min(reach) / f if reach else None
        both = both_met(gain, ratio)
        kept_all += n_kept
        near_all += near
        both_all += both
        lines.append(
            f"| {name} {target:g} | {choice} | {f:.3f} | {q:.1f} | "
            f"{max(e for e, _ in achieved):.2e} | {n_kept}/{len(achieved)} | "
            f"{_fmt(front_at, '.1f', 'none')} ({'within' if near else 'NOT within'} {FRONT_DB:g} "
            f"dB) | {_fmt(peer_at, '.1f', 'none (no peer is as cheap)')} "
            f"({_fmt(gain, '+.1f', '-')} dB) | "
            f"{_fmt(None if ratio is None else f * ratio, '.3f', 'none (no peer reaches it)')} "
            f"({_fmt(ratio, '.2f', '-')}x) | {'met' if both else 'not met'} |")
    summary = (f"budgeted mode kept {kept_all} of {draws} target x draw runs; of its "
               f"{len(runs)} targets, {len(runs) - len(uncached)} chose caching "
               f"({len(uncached)} ran uncached: no calibrated configuration promises "
               f"{', '.join(uncached) or 'none'}), within {FRONT_DB:g} dB of our front at "
               f"{near_all}, both forms against the best peer at {both_all}")
    lines += ["", f"Summary: {summary}. A point counts as met only where the chosen run computed "
              "less than every block and a peer point exists on each side."]
    return lines, summary


def write_readme(path, rows, fams, facts, args, elapsed, loads, have_plot):
    names = {f.key: f.title for f in fams}
    not_run = [r for r in rows if r["status"] != "ok" and r["family"] in names]
    standings = {f.key: {m: standing(rows, f.key, m) for m in METRICS} for f in fams}
    budgets = {f.key: budget_standing(rows, f.key, facts[f.key]["budget_unseen"]) for f in fams}
    regime = "trained weights" if args.weights == "trained" else "random weights"
    lines = ["# Fidelity against speed: our caching beside diffusers' cache hooks and cache-dit", "",
             f"Reproduce: `{args.command}` ({'quick mode, ' if args.quick else ''}"
             f"{elapsed / 60:.1f} min for this run; 1-minute load average {loads[0]:.2f} at the "
             f"start, {loads[1]:.2f} at the end: other jobs shared the machine).", "",
             "Issue 9's goal: at equal fidelity 1.25 times the speedup of the best peer, or "
             f"+3 dB PSNR at equal speedup. Issue 39's floor: behind at no point (at least "
             f"{BEHIND_DB:+g} dB at matched computed fraction and {BEHIND_RATIO:g}x at matched "
             f"PSNR). This run, on {regime.upper()}:", ""]
    for k, by_metric in standings.items():
        lines += [f"- {names[k]} ({regime}): {summary}." for _, summary in by_metric.values()]
        lines.append(f"- {names[k]} ({regime}), {budgets[k][1]}.")
    if args.weights == "trained" and args.follow:
        lines += [f"- {f.title}, prompt following: {follow_standing(rows, f.key, args.follow)[1]}."
                  for f in fams]
    lines += ["", "## Setup", "",
              f"- Machine: {machine()}.", f"- Peers as installed: {versions()}.",
              (f"- Models: random weights, {INIT}; the same weights in ours and, through "
               "modules/convert.py, in diffusers' transformer." if not args.weights == "trained"
               else "- Models: TRAINED weights, the tiny models trained here on procedural clips "
               "(issue 28, bench/fixtures; each one's MODEL_CARD.md beside its weights), loaded "
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
    for fam in fams:
        f, a = facts[fam.key], facts[fam.key]["agreement"]
        psnr = "inf (identical)" if a["psnr_db"] == math.inf else f"{a['psnr_db']:.1f} dB"
        lines.append(f"- {fam.title}: {f['blocks']} blocks, latent {f['shape']} ({f['tokens']} "
                     f"tokens), {f['steps']} steps {f['solver']} shift {f['shift']}, CFG "
                     f"{f['guidance']}. Uncached diffusers against uncached ours: rel L2 "
                     f"{a['rel_l2']:.1e}, PSNR {psnr}. Uncached loop: {f['uncached_cpu'][0]:.2f} "
                     f"CPU s ours, {f['uncached_cpu'][1]:.2f} diffusers'; two identical uncached "
                     f"runs differ by up to {100 * f['spread']:.0f}%.")
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
        for metric, (body, _) in standings[fam.key].items():
            lines += [f"### PSNR {METRICS[metric]}", ""] + body + [""]
        lines += ["", "### Budgeted mode", ""] + budgets[fam.key][0]
        if fam.trained and args.follow:
            lines += ["", "### Prompt following against computed fraction", ""]
            lines += follow_standing(rows, fam.key, args.follow)[0]
            lines += ["", "![prompt following against computed fraction](follow.png)"]
    reading = (TRAINED_NOTES + trained_caveats(fams, facts, args.follow) if args.weights == "trained"
               else notes(rows, fams, facts))
    lines += ["", "## Reading it", "", reading]
    for fam in fams:
        lines += [f"## Table: {fam.title}", ""] + table(rows, fam.key) + [""]
    lines += ["Settings: " + "; ".join(f"{k}: {v}" for k, v in facts[fams[0].key]["about"].items()
                                       if v) + ".", "",
              "Files: results.csv (every row), table.md, pareto.png, traces_<family>.json "
              "(.json.gz on trained weights; per run: the block-equivalents computed in each "
              "model call as the hooks counted them, and the method's own decisions: our "
              "gate's trace, cache-dit's cached steps and residual diffs, MagCache's "
              "calibration ratios, the budget's chosen configuration and its bound), "
              "budget_profile_<family>.json (budgeted mode's calibration: every "
              "configuration's rel L2 and computed fraction on each held-out draw)."]
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")

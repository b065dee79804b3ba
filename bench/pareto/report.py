"""bench.pareto's report: rows, where we stand against the peers (point by point, both
goals, pooled over draws and as the mean over draws), budgeted mode's standing, prompt
following, the tables, plots and the results page."""

from __future__ import annotations

import gzip
import json
import math
import re

from bench.page import versions
from bench.pareto.workload import BUDGET_SEEDS, SEED, UNSEEN_SEEDS
from sampling.fidelity import fidelity
from sampling.journal import atomic_write

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
            # a recipe scores the attributes it can read (scenes: no shape); None: not read
            r.update({k: run.follow.get(k[len("follow_"):]) for k in FOLLOW})
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
        text += "  prompt " + " ".join(f"{k[7:9]} {r[k]:.0%}" for k in FOLLOW
                                       if r.get(k) is not None)
    return text if r["status"] == "ok" else f"{text}  {r['status']}"


# --- where we stand ---------------------------------------------------------------------------

MATCH_TOLERANCE = 0.01  # computed fractions within this count as matched (they come in steps)
# issue 60: within this PSNR a point of ours and a peer's are level, neither ahead nor behind:
# where ours runs the very computation a peer runs, float noise leaves it about 1e-5 dB apart
LEVEL_DB = 0.05
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
    the peer's PSNR within LEVEL_DB (a speedup ratio; a tie is level, not a loss); None where
    ours has no such point."""
    out = []
    for point in front(peer):
        cost, psnr = point[:2]
        at_cost = [q for c, q, *_ in ours if c <= cost + tolerance]
        reach = [c for c, q, *_ in ours if q >= psnr - LEVEL_DB]
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


def cheapest_for(ours, psnr):
    """Ours' cheapest point reaching `psnr` within LEVEL_DB, or None."""
    return min((p for p in ours if p[1] >= psnr - LEVEL_DB), key=lambda p: p[0], default=None)


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
        at, cheapest = _best_at(ours, cost, MATCH_TOLERANCE), cheapest_for(ours, psnr)
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
    level = sum(not behind(d, r) and not goal_met(d, r) and abs(d) <= LEVEL_DB for _, d, r in res)
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
               f"behind at {lost}, level (within {LEVEL_DB:g} dB) at {level} (PSNR gain of ours "
               "at matched fraction "
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

def write_json(path, data):
    """JSON, written whole or not at all, without indentation (the pages' budget profiles are
    read by programs, and indentation made a third of their bytes: the tracked tree has to
    travel to a device call); gzip-compressed where the name ends in .gz (the traces)."""
    if not path.endswith(".gz"):
        atomic_write(path, lambda f: json.dump(data, f, separators=(",", ":")))
        return

    def packed(f):
        with gzip.GzipFile(fileobj=f, mode="wb") as z:
            z.write(json.dumps(data).encode())
    atomic_write(path, packed, mode="wb")


def write_csv(rows, path):
    import csv

    def write(f):
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})

    atomic_write(path, write)


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
        names = list(dict.fromkeys(r["method"] for r in rows if r["family"] == fam.label
                                   and r["method"] != "uncached" and r["status"] == "ok"))
        for name in names:
            k = order.index(name)
            pts = sorted((r["computed_fraction"], r["cpu_s"], r["psnr_db"], r["impl"])
                         for r in rows if r["family"] == fam.label and r["method"] == name
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


def not_registered() -> str:
    """Why diffusers' hooks refuse HunyuanVideo-1.5, naming the installed diffusers (the one that
    raised in this run)."""
    return ("diffusers' FirstBlockCache, MagCache and SeaCache hooks look each block's class up in "
            f"`TransformerBlockRegistry` (diffusers/hooks/_helpers.py); {versions(('diffusers',))} "
            "registers `WanTransformerBlock` and the HunyuanVideo 1.0 blocks but not "
            "`HunyuanVideo15TransformerBlock`, so `enable_cache` raises on HunyuanVideo-1.5. Its "
            "TaylorSeer hook selects modules by name and runs; cache-dit ships a HunyuanVideo-1.5 "
            "adapter and runs.")


def read(r) -> list[str]:
    """The prompt-following columns the row's recipe scored."""
    return [k for k in FOLLOW if r.get(k) is not None]


def follow_mean(r) -> float:
    return sum(r[k] for k in read(r)) / len(read(r))


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
        return all(r[k] >= ref[k] - slack for k in read(r))

    lines = [f"Each setting on the same {n} held-out prompts (attribute combinations never "
             "trained on; one noise draw each), decoded and read by the recipe's analyser "
             "(bench/fixtures/recipes.py; '-' where it reads no such attribute). mean: of the "
             "attributes read. keeps: no attribute loses more than one prompt "
             "against the same implementation's uncached run.", "",
             "| method | setting | computed | fg color | bg color | direction | shape | mean | "
             "keeps the prompt |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(done, key=lambda r: (r["impl"] != "ours", r["method"] != "uncached",
                                         r["computed_fraction"])):
        name = f"{r['impl']} uncached" if r["method"] == "uncached" else r["method"]
        lines.append(f"| {name} | {r['setting']} | {r['computed_fraction']:.3f} | "
                     + " | ".join("-" if r.get(k) is None else f"{r[k]:.0%}" for k in FOLLOW)
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
    """Prompt following (mean of the attributes read) against computed fraction, per family."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(fams), figsize=(7.5 * len(fams), 5), squeeze=False)
    for ax, fam in zip(axes[0], fams, strict=True):
        done = [r for r in rows if r["family"] == fam.label and r["status"] == "ok"
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
        ax.set_ylabel("prompt following, mean of the attributes read")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


FRONT_DB = 1.0  # issue 17: budgeted mode's points lie within this of our front


BUDGETED = {"ours budgeted": ("rel_err", r"budget ([0-9.e+-]+)", "rel L2 budget"),
            "ours budgeted speedup": ("speedup", r"speedup ([0-9.e+-]+)", "speedup")}
PRESETS = "ours presets"  # `--preset NAME`: the other single flag a user runs
ONE_FLAG = (*BUDGETED, PRESETS)


def kept(kind: str, target: float, rel_l2: float, computed: float) -> bool:
    """Whether one run kept its target: the error budget, or at most 1/s of the blocks."""
    return rel_l2 <= target if kind == "rel_err" else computed <= 1.0 / target + 1e-9


def against_peers(f: float, q: float, peers):
    """A point (computed f, PSNR q) of ours against the peers' points: the best peer PSNR at no
    more computed (+ tolerance), ours' gain over it, and the ratio of the peer's least computed
    fraction reaching q (within LEVEL_DB: a tie is level) to f; None where no peer is on that
    side."""
    peer_at = max((p for c, p, *_ in peers if c <= f + MATCH_TOLERANCE), default=None)
    gain = None if peer_at is None else q - peer_at
    reach = [c for c, p, *_ in peers if p >= q - LEVEL_DB]
    return peer_at, gain, (min(reach) / f if reach else None)


def verdict(gain, ratio) -> str:
    """One point against the best peer: BEHIND where an existing comparison falls under issue
    39's floor; goal and both (issue 9 and 17) only where a peer point exists on each side;
    level where ours is within LEVEL_DB of the peer at its computed fraction."""
    if (gain is not None and gain < BEHIND_DB) or (ratio is not None and ratio < BEHIND_RATIO):
        return "BEHIND"
    if gain is None or ratio is None:
        return "no peer on one side"
    if both_met(gain, ratio):
        return "both"
    if goal_met(gain, ratio):
        return "goal"
    return "level" if abs(gain) <= LEVEL_DB else "ahead" if gain > 0 else "short"


def budget_standing_of(rows, family, facts, metric="psnr_db",
                       promises=True) -> tuple[list[str], str]:
    """budget_standing from a family's facts (bench/pareto/run.py run_family)."""
    return budget_standing(rows, family, facts["budget_unseen"], facts.get("budget_screen", ()),
                           facts.get("budget_confirm", ()), facts.get("budget_chaotic", ()),
                           metric, promises)


def _target(r) -> tuple[str, float, str]:
    kind, pattern, name = BUDGETED[r["method"]]
    return kind, float(re.search(pattern, r["setting"]).group(1)), name


def budget_standing(rows, family, unseen, screen=(), confirm=(), chaotic=(),
                    metric="psnr_db", promises=True) -> tuple[list[str], str]:
    """What one flag gives (issue 60): budgeted mode's targets and the presets, each chosen on
    calibration draws alone, against the best peer at matched computed fraction and matched
    PSNR and against our front; then the promises: each error budget that chose caching on the
    draws it was not calibrated or screened on (the row's own draws and UNSEEN_SEEDS but SEED),
    against the budget and against the bound it promised, uncached choices apart, and each
    speedup target by the speedup it achieved (with `promises`: they do not depend on how PSNR
    is aggregated). Markdown lines and a one-line summary."""
    runs = [r for r in rows if r["family"] == family and r["method"] in ONE_FLAG
            and r["status"] == "ok"]
    if not runs:
        return ["Budgeted mode did not run."], "budgeted mode did not run"
    ours = [p for p in points(rows, family, True, metric=metric) if p[2] not in ONE_FLAG]
    peers = points(rows, family, False, metric=metric)
    unseen_seeds = [s for s in UNSEEN_SEEDS if s != SEED]
    lines = [f"One flag: `--budget_rel_err`, `--budget_speedup` (with `--budget_profile`, "
             f"calibrated on draws {', '.join(map(str, BUDGET_SEEDS))}"
             + (f", each configuration a target chooses screened on draws {screen[0]}-{screen[-1]}"
                f" ({len(screen)} draws; sampling/budget.py)" if screen else "")
             + (f", each one an error budget chooses confirmed on draws {confirm[0]}-{confirm[-1]}"
                f" ({len(confirm)} draws)" if confirm else "")
             + (f"; set aside as chaotic, their uncached run flipping with bf16-rounded weights: "
                f"draw{'s' if len(chaotic) > 1 else ''} {', '.join(map(str, chaotic))}"
                if chaotic else "")
             + ") and `--preset`, each point its run on the draws every curve here is measured "
             f"on; PSNR {METRICS[metric]}. A tie within {LEVEL_DB:g} dB is level. Goal and both "
             "count only where a peer point exists on each side.", "",
             "| flag | chosen | computed | PSNR dB | our front's best PSNR at that fraction | best "
             "peer's PSNR at no more computed (ours' gain) | best peer's least computed for that "
             "PSNR (ratio) | against the best peer |", "|---|---|---|---|---|---|---|---|"]
    tally = {"points": 0, "near": 0, "compared": 0}
    verdicts: list[str] = []
    uncached: list[str] = []
    for r in sorted(runs, key=lambda r: r["computed_fraction"]):
        name = (f"{_target(r)[2]} {_target(r)[1]:g}" if r["method"] in BUDGETED
                else f"preset {r['setting'].split(':')[0]}")
        choice = r["setting"].split(": ", 1)[1] if ": " in r["setting"] else "-"
        f, q = r["computed_fraction"], r[metric]
        if f >= 1.0:  # nothing calibrated promises it, or a preset skipped nothing: no point
            uncached.append(name)
            why = ("uncached: no calibrated configuration promises it" if r["method"] in BUDGETED
                   else "computed every block on these draws")
            lines.append(f"| {name} | {why} | {f:.3f} | - | - | - | - | no point |")
            continue
        front_at = max((p for c, p, *_ in ours if c <= f + MATCH_TOLERANCE), default=None)
        near = front_at is None or q >= front_at - FRONT_DB
        peer_at, gain, ratio = against_peers(f, q, peers)
        v = verdict(gain, ratio)
        verdicts.append(v)
        tally["points"] += 1
        tally["near"] += near
        tally["compared"] += gain is not None and ratio is not None
        lines.append(
            f"| {name} | {choice} | {f:.3f} | {q:.1f} | "
            f"{_fmt(front_at, '.1f', 'none')} ({'within' if near else 'NOT within'} {FRONT_DB:g} "
            f"dB) | {_fmt(peer_at, '.1f', 'none (no peer is as cheap)')} "
            f"({_fmt(gain, '+.1f', '-')} dB) | "
            f"{_fmt(None if ratio is None else f * ratio, '.3f', 'none (no peer reaches it)')} "
            f"({_fmt(ratio, '.2f', '-')}x) | {v} |")
    count = {k: verdicts.count(k) for k in ("BEHIND", "both", "goal", "level")}
    flag = (f"one flag ({tally['points']} points of budgeted mode and the presets): behind the "
            f"best peer at {count['BEHIND']}, goal at {count['goal'] + count['both']} and both "
            f"forms at {count['both']} of the {tally['compared']} with a peer point on each side, "
            f"level at {count['level']}, within {FRONT_DB:g} dB of our front at {tally['near']}")
    lines += ["", f"{flag[0].upper()}{flag[1:]}."]
    if not promises:
        return lines, flag
    promises, promised = _promises(runs, unseen, unseen_seeds, uncached)
    lines += ["", "Promises on draws the calibration never saw: the point's draws and draws "
              f"{', '.join(map(str, unseen_seeds))}. An error budget that chose caching promised "
              "the budget and a bound (its 95% prediction bound on calibration, screen and "
              "confirm draws); a speedup target is reported by the block speedup it achieved "
              "(1 / computed), which a static schedule meets by construction.", ""] + promises
    summary = f"{flag}; {promised}"
    lines += ["", f"Summary: {summary}."]
    return lines, summary


def _promises(runs, unseen, unseen_seeds, uncached) -> tuple[list[str], str]:
    lines = ["| target | chosen | promised bound | achieved rel L2 (max over draws) | within the "
             "budget | within its bound |", "|---|---|---|---|---|---|"]
    budget_draws = within_budget = within_bound = 0
    chose = 0
    speed = ["", "| speedup target | chosen | block speedup achieved (min over draws) | CPU "
             "speedup of the point |", "|---|---|---|---|"]
    achieved_ratio = []
    for r in runs:
        if r["method"] not in BUDGETED:
            continue
        kind, target, name = _target(r)
        others = [u for u in unseen if u["kind"] == kind and u["target"] == target]
        achieved = [(r["rel_l2"], r["computed_fraction"])] + [(u["rel_l2"], u["computed"])
                                                              for u in others]
        choice = r["setting"].split(": ", 1)[1] if ": " in r["setting"] else "-"
        if r["computed_fraction"] >= 1.0:
            continue
        if kind == "speedup":
            block = min(1.0 / c for _, c in achieved)
            achieved_ratio.append(block / target)
            speed.append(f"| {target:g} | {choice} | {block:.2f}x | {_fmt(r.get('speedup'), '.2f')}x |")
            continue
        chose += 1
        bound = next((u["bound"] for u in others if u.get("bound") is not None), None)
        n_budget = sum(e <= target for e, _ in achieved)
        n_bound = None if bound is None else sum(e <= bound for e, _ in achieved)
        budget_draws += len(achieved)
        within_budget += n_budget
        within_bound += n_bound or 0
        lines.append(f"| {name} {target:g} | {choice} | {_fmt(bound, '.2e', 'not recorded')} | "
                     f"{max(e for e, _ in achieved):.2e} | {n_budget}/{len(achieved)} | "
                     + ("-" if n_bound is None else f"{n_bound}/{len(achieved)}") + " |")
    budgets = [r for r in runs if r["method"] == "ours budgeted"]
    speedups = [r for r in runs if r["method"] == "ours budgeted speedup"]

    def apart(prefix):
        names = [n for n in uncached if n.startswith(prefix)]
        return f"{len(names)} ran uncached" + (f" ({', '.join(names)})" if names else "")
    text = (f"error budgets: {chose} of {len(budgets)} chose caching and kept the budget on "
            f"{within_budget} of {budget_draws} unseen draws, their promised bound on "
            f"{within_bound}; {apart('rel L2')}; speedup targets: {len(achieved_ratio)} of "
            f"{len(speedups)} chose caching, block speedup achieved over asked "
            + (f"{min(achieved_ratio):.2f} to {max(achieved_ratio):.2f}" if achieved_ratio
               else "none")
            + f"; {apart('speedup')}")
    return lines + speed, text

"""Fidelity against speed: our caching beside diffusers' cache hooks and cache-dit, same weights.

    python -m bench.pareto [--quick] [--families wan,hunyuan] [--out bench/results/pareto]
    python -m bench.pareto --weights trained [--checkpoint PATH]   # the regime users meet

The workload lives in bench/pareto/workload.py, the peers' adapters in bench/pareto/peers.py,
the standing, tables and plots in bench/pareto/report.py, the page in bench/pareto/page.py;
budgeted mode's targets and calibration in bench/pareto/budget.py; this file holds the menu
of methods and the command.

Tiny-but-deep random-weight DiTs (Wan2.2 TI2V-shaped, then HunyuanVideo-1.5), made smooth in t
(bench/workload.py), are loaded into our model and, through modules/convert.py, into diffusers'
`WanTransformer3DModel` / `HunyuanVideo15Transformer3DModel`. Every run shares the noise, the
text embeddings, our scheduler (sampling/schedulers.py) and the step count; ours run on the torch
backend (eager, CPU), the peers' in a small loop that drives the diffusers model with the same
scheduler, so wall times compare like with like. Per run:

  computed   fraction of block evaluations that really ran, counted by forward pre-hooks on the
             first linear of each block's sub-layers (hooks on a block fire even when a cache
             hook replaced its forward, benchmark_workload.md), for every method, ours included
  CPU, wall  the denoising loop's process CPU time (steady when other jobs share the machine;
             one torch thread) and wall time; speedup = the same implementation's uncached CPU
             time over the run's (ours over ours, peers over diffusers')
  PSNR, rel L2, rel/disp   final latents against the same implementation's uncached latents;
             rel/disp divides the error by how far the uncached run moved from the noise; on
             trained weights (several held-out prompts a setting) PSNR both pooled over the
             draws and as the mean of each draw's own
  trace      computed blocks per model call, plus each method's own decisions (traces_*.json.gz)

Writes results.csv, table.md, pareto.png, traces_<family>.json.gz
and README.md (machine, command, table, plot, and the standing against each peer at matched
computed fraction) under --out. A peer that cannot be installed or cannot drive a model is
reported as such; nothing is estimated in its place.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field

os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "warning")  # read when cache_dit is imported

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.page import machine, versions  # noqa: E402
from bench.pareto.budget import (  # noqa: E402
    budgeted_config,
    budgets_on_unseen_draws,
    runs_path,
    targets,
)
from bench.pareto.page import write_readme  # noqa: E402
from bench.pareto.peers import (  # noqa: E402
    adapter_setup,
    cachedit_setup,
    diffusers_hook,
    mag_ratios,
    run_diffusers,
    taylorseer_identifiers,
)
from bench.pareto.report import (  # noqa: E402
    METRICS,
    budget_standing_of,
    follow_standing,
    kept,
    plot,
    plot_follow,
    row,
    show,
    standing,
    table,
    write_csv,
    write_json,
)
from bench.pareto.workload import (  # noqa: E402
    CALIBRATION_SEED,
    CONFIRM_FIRST,
    CONFIRM_SEEDS,
    FOLLOW_SEEDS,
    INIT,
    LAUNCH,
    SEED,
    Family,
    Workload,
    build_workload,
    confirm_seeds,
    families,
    held_out_clip,
    our_counter,
    over_prompts,
    run_ours,
    trained_families,
)
from cache import (  # noqa: E402
    CMConfig,
    DeepCacheConfig,
    FBCacheConfig,
    LimitsConfig,
    MagCacheConfig,
    TeaCacheConfig,
)
from commands.stage2_backend import make_backend  # noqa: E402
from sampling.fidelity import fidelity  # noqa: E402
from sampling.journal import atomic_write  # noqa: E402
from sampling.pipelines import PIPELINES  # noqa: E402
from sampling.run import noise_for  # noqa: E402
from sampling.stages import SignalPlan  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "pareto")

def our_mag_ratios(wl: Workload) -> dict:
    """Our calibrate command's MagCache ratios (commands/calibrate.collect), measured on the
    same held-out draw as diffusers' calibration: branch -> one ratio per step."""
    from commands.calibrate import collect

    draw = wl.reseeded(CALIBRATION_SEED)
    plan = SignalPlan.from_config(CMConfig(teacache=TeaCacheConfig()))
    _, ratios = collect(make_backend(LAUNCH, {None: wl.model}, plan), wl.pipe, {draw.seed: draw.tensors},
                        wl.shape, signal=None, steps=wl.steps, solver=wl.pipe.solver,
                        shift=wl.pipe.shift)
    return ratios



# --- the menu ---------------------------------------------------------------------------------

@dataclass
class Method:
    """One curve: a method and the settings swept along it. Each setting is (label, run(wl))."""

    name: str
    impl: str  # "ours", "diffusers" or "cache-dit"
    settings: list = field(default_factory=list)
    about: str = ""


def scaled(schedule, steps):
    """A DeepCache schedule written for 50 steps, for `steps` steps."""
    start, end, interval = schedule
    return max(1, round(start * steps / 50)), round(end * steps / 50), interval


def methods(wl: Workload, quick: bool, cache: dict) -> list[Method]:
    """Every curve, in plot order: peers first, then ours. `cache` keeps per-family results
    that several settings share (MagCache ratios, the budget profile)."""
    pick = (lambda xs: xs[::2] if len(xs) > 2 else xs) if quick else (lambda xs: xs)
    trained = wl.family.trained

    def grid(random, on_trained):
        """The settings swept: trained models move further between steps (issue 28: the same
        threshold computes 19% of blocks on random weights and 44% on trained), so their
        thresholds reach higher."""
        return pick(on_trained if trained else random)

    out = []

    # diffusers hooks (as installed: diffusers 0.42.1)
    from diffusers.hooks import FirstBlockCacheConfig, SeaCacheConfig, TaylorSeerCacheConfig
    from diffusers.hooks import MagCacheConfig as TheirMagCacheConfig

    def hook(factory):
        return lambda w: run_diffusers(w, diffusers_hook(factory))

    out.append(Method("diffusers FBC", "diffusers", [
        (f"threshold {th}", hook(lambda th=th: FirstBlockCacheConfig(threshold=th)))
        for th in grid([0.02, 0.05, 0.1, 0.2], [0.05, 0.1, 0.2, 0.4, 0.8])],
        "FirstBlockCacheConfig"))

    def mag(th, k):
        def go(w):
            if "mag" not in cache:
                cache["mag"] = mag_ratios(w)
            return run_diffusers(w, diffusers_hook(lambda: TheirMagCacheConfig(
                threshold=th, max_skip_steps=k, num_inference_steps=w.steps,
                mag_ratios=cache["mag"][0])))
        return go

    out.append(Method("diffusers MagCache", "diffusers", [
        (f"threshold {th}, K {k}", mag(th, k))
        for th, k in grid([(0.001, 3), (0.003, 3), (0.01, 3), (0.06, 5)],
                          [(0.01, 3), (0.03, 3), (0.06, 3), (0.12, 4), (0.24, 6)])],
        "MagCacheConfig, ratios from its calibration run on a held-out draw, retention 0.2"))
    out.append(Method("diffusers TaylorSeer", "diffusers", [
        (f"interval {iv}", hook(lambda iv=iv: TaylorSeerCacheConfig(
            cache_interval=iv, max_order=1, taylor_factors_dtype=torch.float32,
            cache_identifiers=taylorseer_identifiers(wl))))
        for iv in pick([2, 3, 5])],
        "TaylorSeerCacheConfig, order 1, fp32 factors, attention and FFN modules of every block"))
    out.append(Method("diffusers SeaCache", "diffusers", [
        (f"threshold {th}", hook(lambda th=th: SeaCacheConfig(threshold=th)))
        for th in grid([0.1, 0.25, 1.0], [0.25, 0.5, 1.0, 2.0])],
        f"SeaCacheConfig (also in {versions(('diffusers',))})"))

    # cache-dit (as installed), DBCache on the transformer
    try:
        import cache_dit
        version = cache_dit.__version__
    except Exception as exc:  # noqa: BLE001 - any import failure means: not available
        version = None
        missing = f"cache-dit cannot be imported ({type(exc).__name__}: {exc})"
    wide = 8 if not trained else max(2, wl.family.config.num_layers // 2)  # Fn < the blocks
    for fn, ts in ((1, False), (1, True), (wide, False), (wide, True)):
        name = f"cache-dit F{fn}B0" + (" +TaylorSeer" if ts else "")
        if version is None:
            out.append(Method(name, "cache-dit", [("-", _unavailable(missing))]))
            continue
        out.append(Method(name, "cache-dit", [
            (f"rdt {rdt}", lambda w, fn=fn, rdt=rdt, ts=ts: run_diffusers(
                w, cachedit_setup(w, fn, 0, rdt, ts)))
            for rdt in grid([0.04, 0.1, 0.25], [0.1, 0.25, 0.5, 1.0])],
            f"cache-dit {version} DBCache, max_warmup_steps 8 (library default)"
            + (", TaylorSeer calibrator order 1" if ts else "")))

    # ours, on the torch backend
    def ours(config):
        return lambda w: run_ours(w, config, cache["counter"])

    fb = lambda th: FBCacheConfig(threshold=th, metric="residual_tensor_rel_l1")  # noqa: E731
    out.append(Method("ours TeaCache", "ours", [
        (f"threshold {th}", ours(CMConfig(teacache=TeaCacheConfig(threshold=th))))
        for th in grid([0.001, 0.002, 0.005, 0.01], [0.005, 0.01, 0.02, 0.05])],
        "linear policy on block 0's modulated input"))
    out.append(Method("ours FBCache", "ours", [
        (f"threshold {th}", ours(CMConfig(fbcache=fb(th))))
        for th in grid([0.02, 0.05, 0.1, 0.2], [0.1, 0.2, 0.4, 0.8])],
        "residual_tensor_rel_l1, F1B0"))
    deep = [scaled(s, wl.steps) for s in pick([(15, 40, 3), (11, 45, 4), (5, 48, 5)])]
    out.append(Method("ours DeepCache", "ours", [
        (f"start {a}, end {b}, every {n}", ours(CMConfig(
            deepcache=DeepCacheConfig(start=a, end=b, interval=n)))) for a, b, n in deep],
        "schedule, B1"))
    out.append(Method("ours FBCache +forecast2", "ours", [
        (f"threshold {th}", ours(CMConfig(fbcache=fb(th), forecast=2)))
        for th in grid([0.03, 0.05, 0.1, 0.2], [0.1, 0.2, 0.4, 0.8])],
        "F1B0, quadratic forecast of the reused residual"))
    out.append(Method("ours FBCache F1B2 +forecast1", "ours", [
        (f"threshold {th}", ours(CMConfig(fbcache=fb(th), bn_blocks=2, forecast=1)))
        for th in grid([0.05, 0.1, 0.2], [0.2, 0.4, 0.8])],
        "two tail blocks always run, linear forecast"))
    # issue 17: reuse while the forecast's own error stays small. The probe compares block 0's
    # residual with its forecast (--forecast_gate), and the errors are summed over the reuse
    # run (--fb_accumulate), so the threshold bounds a run's forecast error, not the raw drift.
    fbsum = lambda th: FBCacheConfig(threshold=th, metric="residual_tensor_rel_l1",  # noqa: E731
                                     accumulate=True)
    out.append(Method("ours FBCache +forecast2 gated", "ours", [
        (f"threshold {th}", ours(CMConfig(fbcache=fbsum(th), forecast=2, forecast_gate=True)))
        for th in grid([0.005, 0.01, 0.02, 0.03, 0.07, 0.15, 0.3, 0.6],
                       [0.07, 0.15, 0.3, 0.6, 1.2, 2.4])],
        "F1B0, quadratic forecast; reuse while the summed forecast error of block 0 stays under "
        "the threshold"))
    out.append(Method("ours FBCache +forecast1 gated", "ours", [
        (f"threshold {th}", ours(CMConfig(fbcache=fbsum(th), forecast=1, forecast_gate=True)))
        for th in grid([0.2, 0.4, 0.8], [0.4, 0.8, 1.6])],
        "the same with a linear forecast (cheap end)"))
    # the cheap end: each step's forecast error weighted by the step's size in sigma (an error
    # on a large late step moves the final latent more), no forced last compute
    out.append(Method("ours FBCache +forecast1 gated step-weighted", "ours", [
        (f"threshold {th}", ours(CMConfig(fbcache=fbsum(th), forecast=1, forecast_gate=True,
                                          step_weight=1.0, last_steps=0)))
        for th in grid([0.01, 0.02, 0.05, 0.1, 0.3, 0.7, 1.2, 2.1], [0.3, 0.7, 1.2, 2.1, 4.0])],
        "linear forecast, summed forecast error weighted by |dsigma| over its mean "
        "(--step_weight 1), --cache_last_steps 0"))
    # The trained regime (issue 28): a forecast is good for a step or two, so cap the reuse run
    # (what SeaCache does, max_consecutive_cached 2); TeaCache's signal places the computes.
    out.append(Method("ours TeaCache +forecast1 (2 in a row)", "ours", [
        (f"threshold {th}", ours(CMConfig(teacache=TeaCacheConfig(threshold=th), forecast=1,
                                          limits=LimitsConfig(max_continuous=2))))
        for th in grid([0.002, 0.005, 0.01, 0.02], [0.005, 0.01, 0.02, 0.05, 0.2])],
        "linear forecast, at most 2 reuses in a row"))
    out.append(Method("ours TeaCache +forecast1 (1 in a row)", "ours", [
        (f"threshold {th}", ours(CMConfig(teacache=TeaCacheConfig(threshold=th), forecast=1,
                                          limits=LimitsConfig(max_continuous=1))))
        for th in grid([0.002, 0.005, 0.01], [0.01, 0.02, 0.05])],
        "linear forecast, never two reuses in a row (the high-fidelity end)"))
    schedules = [(2, n) for n in pick([2, 3, 4, 5])]
    out.append(Method("ours DeepCache B0 +forecast1", "ours", [
        (f"start {a}, every {n}", ours(CMConfig(
            deepcache=DeepCacheConfig(start=a, end=wl.steps, interval=n), forecast=1,
            bn_blocks=0))) for a, n in schedules],
        "no tail block, linear forecast, the last step computed"))
    if wl.family.remodulates:  # remodulated reuse needs gates the blocks share (Wan2.2)
        out.append(Method("ours DeepCache B0 +forecast1 remodulated", "ours", [
            (f"start {a}, every {n}", ours(CMConfig(
                deepcache=DeepCacheConfig(start=a, end=wl.steps, interval=n), forecast=1,
                bn_blocks=0, remodulate=True))) for a, n in schedules],
            "the same, the reused residual kept split by the time gates and rebuilt with each "
            "step's own (--remodulate), each part forecast linearly"))
    def ours_mag(th, k, forecast=0):
        def go(w):
            if "our_mag" not in cache:
                cache["our_mag"] = our_mag_ratios(w)
            ratios = cache["our_mag"]
            return run_ours(w, CMConfig(magcache=MagCacheConfig(
                ratios=ratios["cond"], uncond_ratios=ratios.get("uncond", ()), threshold=th,
                max_skip=k), forecast=forecast), cache["counter"])
        return go

    out.append(Method("ours MagCache", "ours", [
        (f"threshold {th}, K {k}", ours_mag(th, k))
        for th, k in grid([(0.001, 3), (0.003, 3), (0.01, 3), (0.06, 5)],
                          [(0.001, 3), (0.003, 3), (0.01, 3), (0.03, 3), (0.06, 3), (0.12, 4),
                           (0.24, 6)])],
        "our gate's MagCache: ratios from our calibrate command on the held-out draw diffusers "
        "calibrates on, retention 0.2, per branch"))
    out.append(Method("ours MagCache +forecast1 (K 2)", "ours", [
        (f"threshold {th}, K 2", ours_mag(th, 2, forecast=1))
        for th in grid([0.001, 0.003, 0.01], [0.003, 0.005, 0.01, 0.03])],
        "our MagCache, at most 2 reuses in a row, the reused residual extrapolated linearly"))
    out.append(Method("ours TeaCache +forecast2", "ours", [
        (f"threshold {th}", ours(CMConfig(teacache=TeaCacheConfig(threshold=th), forecast=2,
                                          limits=LimitsConfig(max_continuous=3))))
        for th in grid([0.002, 0.005, 0.01], [0.005, 0.01, 0.02])], "at most 3 reuses in a row"))

    def budgeted(target):
        def go(w):
            config, chosen = budgeted_config(cache, w, target)
            run = run_ours(w, config, cache["counter"])
            run.trace = {**chosen, "gate": run.trace}
            run.note = chosen["choice"] or "uncached: no calibrated configuration promises it"
            return run
        return go

    out.append(Method("ours budgeted", "ours", [
        (f"rel L2 budget {b:g}", budgeted(("rel_err", b)))
        for b in pick([x for kind, x in targets(trained) if kind == "rel_err"])],
        "--budget_rel_err: the cheapest configuration of sampling/budget_space.py's space (the shipped "
        "techniques and the static schedules of the run's sigmas) whose error bound (95%, learned "
        "from the spread over 3 held-out draws) is within the budget"))
    out.append(Method("ours budgeted speedup", "ours", [
        (f"speedup {s:g}", budgeted(("speedup", s)))
        for s in pick([x for kind, x in targets(trained) if kind == "speedup"])],
        "--budget_speedup: the configuration of the same space with the least typical error "
        "(geometric mean over every draw it ran: calibration, screen and confirm) among those "
        "whose computed fraction is bounded by 1/s"))
    from bench.studies.presets import preset_config
    from cache.preset import PRESETS
    out.append(Method("ours presets", "ours", [
        (name, ours(preset_config(name))) for name in PRESETS],
        "--preset NAME (cache/presets/*.json), as shipped: no calibration"))
    return out


def _unavailable(message):
    def go(_):
        raise RuntimeError(message)
    return go


def run_family(family: Family, args) -> tuple[list[dict], dict, dict]:
    """Every run of one family: rows, traces and the baselines' facts."""
    wl = build_workload(family, args.steps)
    cache = {"counter": our_counter(wl),
             "profile_path": os.path.join(args.out, f"budget_profile_{family.label}.json"),
             "confirm_seeds": confirm_seeds(args.confirm_draws),
             "runs_path": runs_path(args.out, family.label)}
    print(f"\n{family.title}: {family.config.num_layers} blocks, width "
          f"{getattr(family.config, 'dim', None) or family.config.hidden_size}, latent "
          f"{list(wl.shape)} ({wl.pipe.tokens(wl.shape)} tokens), {wl.steps} steps "
          f"{wl.pipe.solver} shift {wl.pipe.shift}, CFG {wl.guidance}", flush=True)
    header = (f"{'method':30s} {'setting':26s} {'blocks':>6s} {'CPU s':>6s} {'wall s':>6s} "
              f"{'speed':>6s} "
              f"{'PSNR':>6s} {'mean':>6s} {'rel L2':>9s} {'rel/disp':>9s}")
    print(header)
    # Trained regime: every setting runs on the same held-out prompts and is pooled over them.
    seeds = FOLLOW_SEEDS[:args.follow] if family.trained else ()
    pooled = (lambda go: lambda w: over_prompts(w, go, seeds)) if seeds else (lambda go: go)
    noise = torch.cat([noise_for(wl.shape, s) for s in seeds]) if seeds else wl.noise
    # Baselines: the faster of two runs each (timing only; the latents are identical).
    ours_twice = [pooled(lambda w: run_ours(w, CMConfig(), cache["counter"]))(wl)
                  for _ in range(2)]
    theirs_twice = [pooled(run_diffusers)(wl) for _ in range(2)]
    ours_base = min(ours_twice, key=lambda r: r.cpu)
    their_base = min(theirs_twice, key=lambda r: r.cpu)
    # how much one timing moves between identical runs: the noise floor of every speedup
    spread = max(abs(a.cpu - b.cpu) / min(a.cpu, b.cpu) for a, b in (ours_twice, theirs_twice))
    agreement = fidelity(their_base.latents, ours_base.latents, noise)
    rows = [row(family.label, "uncached", "ours", "-", ours_base, ours_base, noise),
            # diffusers' uncached latents against ours: the harness agreement
            row(family.label, "uncached", "diffusers", "- (PSNR etc. against ours)", their_base,
                ours_base, noise)]
    rows[1]["speedup"] = 1.0  # peers' speedups are over this run
    for r in rows:
        print(show(r), flush=True)
    traces = {}
    if seeds:
        traces["prompts"] = [held_out_clip(s, family.prompts).prompt for s in seeds]
        traces["uncached | hits"] = ours_base.follow["hits"]
    menu = methods(wl, args.quick, cache)
    for m in menu:
        for label, go in m.settings:
            try:
                run = pooled(go)(wl)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported
                reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                rows.append(row(family.label, m.name, m.impl, "all", status=f"not run: {reason}"))
                print(show(rows[-1]), flush=True)
                break  # the same failure for every setting of this method
            base = ours_base if m.impl == "ours" else their_base
            label = f"{label}: {run.note}" if run.note else label
            rows.append(row(family.label, m.name, m.impl, label, run, base, noise))
            print(show(rows[-1]), flush=True)
            traces[f"{m.name} | {label}"] = {"per_call_blocks": run.per_call, "trace": run.trace}
            if run.follow is not None:
                traces[f"{m.name} | {label}"]["hits"] = run.follow["hits"]
    adapter = adapter_check(wl, pooled, traces, rows, their_base, noise)
    if "mag" in cache:
        traces["diffusers MagCache calibration ratios"] = cache["mag"][1]
    if "our_mag" in cache:
        traces["ours MagCache calibration ratios"] = cache["our_mag"]
    unseen = budgets_on_unseen_draws(wl, cache) if "budget" in cache else []
    for u in unseen:
        print(f"{u['kind']} {u['target']:g} on unseen draw {u['seed']}: {u['choice']}, computed "
              f"{u['computed']:.3f}, rel L2 {u['rel_l2']:.2e} "
              f"({'kept' if kept(u['kind'], u['target'], u['rel_l2'], u['computed']) else 'MISSED'})",
              flush=True)
    calibrated = cache.get("budget", {})
    facts = {"shape": list(wl.shape), "tokens": wl.pipe.tokens(wl.shape), "steps": wl.steps,
             "solver": wl.pipe.solver, "shift": wl.pipe.shift, "guidance": wl.guidance,
             "blocks": family.config.num_layers, "agreement": agreement, "spread": spread,
             "uncached_cpu": (ours_base.cpu, their_base.cpu),
             "budget_unseen": unseen,
             "budget_screen": calibrated.get("screen_seeds", []),
             "budget_confirm": calibrated.get("confirm_seeds", []),
             "budget_chaotic": calibrated.get("chaotic", {}).get("seeds", []),
             "about": {m.name: m.about for m in menu}, "adapter": adapter}
    return rows, traces, facts


def adapter_check(wl: Workload, pooled, traces: dict, rows: list[dict], their_base, noise):
    """The presets through the diffusers adapter (our gate in diffusers' own model, run by the
    peers' loop) against the "ours presets" curve: the per-call block schedule must be the same,
    and the PSNR (each against its implementation's uncached run) within float noise."""
    from cache.preset import PRESETS
    out = []
    for name in PRESETS:
        key = f"ours presets | {name}"
        ours_row = next((r for r in rows if r["method"] == "ours presets"
                         and r["setting"] == name and r["status"] == "ok"), None)
        if ours_row is None or key not in traces:
            continue
        run = pooled(lambda w, name=name: run_diffusers(w, adapter_setup(w, {"preset": name})))(wl)
        r = row(wl.family.label, "adapter presets", "ours", name, run, their_base, noise)
        out.append({"preset": name, "computed": run.fraction,
                    "same_blocks": run.per_call == traces[key]["per_call_blocks"],
                    "psnr_db": r["psnr_db"], "ours_psnr_db": ours_row["psnr_db"]})
        print(f"adapter preset {name}: computed {run.fraction:.3f}, same block schedule as ours: "
              f"{out[-1]['same_blocks']}, PSNR {r['psnr_db']:.2f} dB (ours "
              f"{ours_row['psnr_db']:.2f})", flush=True)
    return out


def _run_family_job(family: Family, args):
    torch.set_num_threads(args.threads)  # a fresh process starts with torch's default
    return run_family(family, args)


def run_families(fams: list[Family], args) -> list[tuple[list[dict], dict, dict]]:
    """run_family for each family, in order; with --jobs > 1 in that many fresh processes (spawn:
    nothing of this process's torch state is forked), their output lines interleaved."""
    if args.jobs == 1 or len(fams) == 1:
        return [run_family(fam, args) for fam in fams]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(min(args.jobs, len(fams)),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_run_family_job, fams, [args] * len(fams)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="20 steps and every other setting (a few minutes); writes to "
                         "bench/results/tmp/pareto_quick unless --out is given")
    ap.add_argument("--families", default="wan,hunyuan", help="comma-separated: wan, hunyuan")
    ap.add_argument("--out", help=f"results folder (default {os.path.relpath(OUT)})")
    ap.add_argument("--steps", type=int, help="denoising steps (default: the pipeline's, 50)")
    ap.add_argument("--blocks", type=int, default=30, help="Wan blocks (TI2V-5B has 30)")
    ap.add_argument("--hy_blocks", type=int, default=30,
                    help="HunyuanVideo-1.5 blocks (the real model has 54; 30 keeps the run short)")
    ap.add_argument("--weights", choices=("random", "trained"), default="random",
                    help="random: tiny-but-deep random-weight DiTs made smooth in t; trained: the "
                         "tiny models trained here (issue 28), prompt following measured too; "
                         "writes to bench/results/pareto/trained unless --out is given")
    ap.add_argument("--follow", type=int, default=len(FOLLOW_SEEDS),
                    help=f"trained weights: the held-out prompts every setting runs on, pooled "
                         f"(PSNR over all of them, prompt following per attribute); at most "
                         f"{len(FOLLOW_SEEDS)}; 0: the one draw of seed {SEED}, as on random weights")
    ap.add_argument("--checkpoint", help="trained weights: a trained tiny model of one family "
                    "(official layout, config.json beside it; bench/fixtures/train.py --export) "
                    "in place of that family's committed one, its pipeline's sampling kept: the "
                    "further held-out model, or one trained elsewhere")
    ap.add_argument("--confirm_draws", type=int, default=len(CONFIRM_SEEDS),
                    help=f"trained weights: budgeted mode's error-budget choices confirmed on this "
                         f"many further draws (from draw {CONFIRM_FIRST}; calibrate "
                         f"--confirm_draws)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: steadier timings on a shared machine)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="families run side by side in this many processes, each with --threads "
                         "torch threads (CPU seconds are per process, so timings stay comparable "
                         "while jobs x threads <= cores); 1: one after the other")
    args = ap.parse_args(argv)
    args.command = "python -m bench.pareto" + ("" if argv is None and len(sys.argv) == 1
                                               else " " + " ".join(sys.argv[1:] if argv is None else argv))
    if args.quick and args.steps is None:
        args.steps = 20
    if args.jobs < 1 or args.threads < 1:
        ap.error(f"--jobs {args.jobs} --threads {args.threads}: expected both 1 or more")
    if args.confirm_draws < 0:
        ap.error(f"--confirm_draws {args.confirm_draws}: expected a count of draws >= 0")
    if not 0 <= args.follow <= len(FOLLOW_SEEDS):
        ap.error(f"--follow: {args.follow}; expected 0 to {len(FOLLOW_SEEDS)}")
    if args.out is None:
        args.out = (os.path.join(os.path.dirname(OUT), "tmp", "pareto_quick") if args.quick
                    else OUT)
        if args.weights == "trained":
            args.out = os.path.join(args.out, "trained")
    if args.checkpoint is not None and args.weights != "trained":
        ap.error("--checkpoint holds trained weights; add --weights trained")
    if args.checkpoint is not None and not os.path.exists(args.checkpoint):
        ap.error(f"--checkpoint {args.checkpoint}: no such file or folder; expected a trained "
                 "tiny model's folder (config.json and its safetensors)")
    all_families = (trained_families(args.checkpoint) if args.weights == "trained"
                    else families(args.blocks, args.hy_blocks))
    wanted = [k.strip() for k in args.families.split(",") if k.strip()]
    unknown = [k for k in wanted if k not in all_families]
    if unknown or not wanted:
        ap.error(f"--families: unknown {unknown}; expected a comma-separated subset of "
                 f"{', '.join(all_families)}"
                 + (" (the trained pipelines that exist)" if args.weights == "trained" else ""))
    fams = [all_families[k] for k in wanted]
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    began, load = time.perf_counter(), os.getloadavg()[0]
    init = (INIT if args.weights == "random" else
            f"trained here ({', '.join(PIPELINES[f.trained_pipeline].builtin for f in fams)}), every "
            + (f"setting on {args.follow} held-out prompts" if args.follow
               else f"setting on the held-out prompt of draw {SEED}"))
    print(f"machine: {machine()}\npeers: {versions()}\nweights: {init}\n"
          "blocks = fraction of block evaluations computed (sub-layer hooks); speed = CPU time "
          "of the same implementation's uncached loop over the run's; PSNR, rel L2, rel/disp "
          "against its uncached latents")
    rows, facts = [], {}
    for fam, (fam_rows, traces, facts[fam.label]) in zip(fams, run_families(fams, args), strict=True):
        rows += fam_rows
        write_json(os.path.join(args.out, f"traces_{fam.label}.json.gz"), traces)
    write_csv(rows, os.path.join(args.out, "results.csv"))
    atomic_write(os.path.join(args.out, "table.md"), lambda f: f.write("".join(
        f"## {fam.title}\n\n" + "\n".join(table(rows, fam.label)) + "\n\n" for fam in fams)))
    have_plot = plot(rows, fams, os.path.join(args.out, "pareto.png"))
    if args.weights == "trained" and args.follow:
        plot_follow(rows, fams, os.path.join(args.out, "follow.png"))
    elapsed = time.perf_counter() - began
    write_readme(os.path.join(args.out, "README.md"), rows, fams, facts, args, elapsed,
                 (load, os.getloadavg()[0]), have_plot)
    for fam in fams:  # the page is whole: its profile holds every calibration run it needs
        with contextlib.suppress(FileNotFoundError):
            os.remove(runs_path(args.out, fam.label))
    for fam in fams:
        print(f"\n{fam.title}: where we stand")
        for metric in METRICS:
            print("\n".join(standing(rows, fam.label, metric)[0]))
        print("\n".join(budget_standing_of(rows, fam.label, facts[fam.label])[0]))
        if fam.trained and args.follow:
            print("\n".join(follow_standing(rows, fam.label, args.follow)[0]))
    print(f"\nwrote {os.path.relpath(args.out)}/ (README.md, results.csv, table.md"
          f"{', pareto.png' if have_plot else ''}, traces_*.json.gz) in {elapsed / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Presets side by side: computed fraction, wall-time speedup and fidelity against uncached, on
models whose TeaCache signals move on scales 100x apart (issue 16: the names must hold on all).

    python -m bench.studies.presets [--steps 50] [--blocks 16] [--scales quiet,benchmark,loud]
                            [--backend jax|torch] [--plot bench/results/presets_trace.png]
                            [--weights random|trained [--checkpoint PATH]] [--out PAGE]

Tiny-but-deep random-weight models of both families, made smooth in t (bench/workload.py) at
three settings of `SIGNAL_SCALES`, run with CFG. The reference is TeaCache at threshold 0 (it
computes every call, bit-identical to caching off, and measures the signal: `signal` is the
median per-step rel of the cond branch). For each preset (and DeepCache 11/45/4) it prints:
  calls    fraction of model calls that ran the block stack
  blocks   fraction of block evaluations the run performed (reused calls run Fn + Bn blocks)
  wall     reference loop time / the preset's loop time (a CPU figure: small programs, 2 cores)
  PSNR, rel L2, rel/disp   the final latents against the reference's; rel/disp divides the
           error by how far the reference moved from the initial noise (benchmark_workload.md)
and whether safe >= balanced >= turbo in PSNR on each model. It draws each run's per-step
change, accumulator, threshold and reused steps for the cond branch of the benchmark-scale
models into --plot (matplotlib, in requirements-dev.txt). `--out` (bench/results/presets.md by
default) gets the run's section of the page: random weights, `--weights trained`, or the
`--checkpoint`'s, with its output and the readings computed from its rows; the other sections
stay as their runs wrote them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.page import command_line, machine, trained_step, versions, write_section  # noqa: E402
from bench.workload import SIGNAL_SCALES, signal_scale, smooth_in_t  # noqa: E402
from cache import CMConfig, DeepCacheConfig, TeaCacheConfig  # noqa: E402
from cache.flags import config_of  # noqa: E402
from cache.preset import PRESETS, load_preset  # noqa: E402
from commands.stage2_backend import make_backend  # noqa: E402
from modules import hunyuan_video15, wan  # noqa: E402
from modules.registry import build_model  # noqa: E402
from sampling.cache_cli import add_cache_arguments, cache_flags  # noqa: E402
from sampling.fidelity import fidelity  # noqa: E402
from sampling.pipelines import PIPELINES  # noqa: E402
from sampling.run import make_sample, sample_once  # noqa: E402
from sampling.run_spec import Launch  # noqa: E402
from sampling.stages import SignalPlan  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "bench", "results", "presets.md")
ORDERED = ("safe", "balanced", "turbo")  # most faithful first, as the names promise
REFERENCE = CMConfig(teacache=TeaCacheConfig(threshold=0.0))  # computes every call


def preset_config(name: str) -> CMConfig:
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    return config_of(cache_flags(parser.parse_args(["--preset", name])))


def deeper_pipeline(name: str, config):
    """The named tiny pipeline pointed at a deeper config of the same family."""
    base = PIPELINES[name]

    class Deep(type(base)):
        @property
        def config(self):
            return config

    return Deep(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})


def cases(blocks: int):
    hy = dataclasses.replace(hunyuan_video15.CONFIGS["hunyuanvideo-tiny"], num_layers=blocks,
                             hidden_size=64, num_heads=4, rope_axes=(4, 6, 6))
    wn = dataclasses.replace(wan.CONFIGS["wan-tiny-ti2v"], num_layers=blocks, dim=48, ffn_dim=96,
                             num_heads=4)
    yield "HunyuanVideo-1.5 (euler)", deeper_pipeline("hunyuanvideo-tiny", hy), hy
    yield "Wan2.2 TI2V (unipc)", deeper_pipeline("wan-tiny-ti2v", wn), wn


def blocks_fraction(traj, num_blocks, plan) -> float:
    rows = traj.gate.telemetry.trace
    run = sum(num_blocks if r["action"] == "compute" else plan.fn_blocks + plan.reuse_tail_blocks
              for r in rows)
    return run / (len(rows) * num_blocks)


def calls_fraction(traj) -> float:
    rows = traj.gate.telemetry.trace
    return sum(r["action"] == "compute" for r in rows) / len(rows)


def backend_of(kind, model, plan):
    """Stage 2's backend for --backend `kind` (commands.stage2_backend.make_backend): on this
    CPU, without the persistent compile cache, as this bench always ran."""
    return make_backend(Launch(backend=kind, device="cpu", compile_cache_dir="none"), {None: model},
                        plan)


def measure(pipe, cfg, scale, runs, *, steps, backend="jax", repeats=2):
    """{run: {"traj", "calls", "blocks", "wall", fidelity...}} for one model; the reference
    under "reference" (with "signal", the median per-step rel)."""
    torch.manual_seed(0)
    model = smooth_in_t(build_model(cfg), **SIGNAL_SCALES[scale])
    shape = pipe.latent_shape(*pipe.size)
    tensors = pipe.synthesize(shape, True, False, 0)
    out, base = {}, None
    for name, config in {"reference": REFERENCE, **runs}.items():
        plan = SignalPlan.from_config(config)
        be = backend_of(backend, model, plan)
        sample = make_sample(be, pipe, tensors, shape, image=False, seed=0)
        best = None
        for _ in range(repeats):  # best of `repeats`, after warm-up
            traj = sample_once(be, config, sample, solver=pipe.solver, steps=steps,
                               shift=pipe.shift, step_sync=False, warmup_rounds=0 if best else 1)
            best = traj if best is None or traj.stats.wall_seconds < best.stats.wall_seconds else best
        latents = be.get(best.latents)
        row = {"traj": best, "calls": calls_fraction(best),
               "blocks": blocks_fraction(best, cfg.num_layers, plan)}
        if base is None:
            base = (latents, best.stats.wall_seconds, be.get(sample.noise))
            row.update(wall=1.0, signal=signal_scale(best.gate.telemetry.trace))
        else:
            row.update(wall=base[1] / best.stats.wall_seconds, **fidelity(latents, base[0], base[2]))
        out[name] = row
    return out


def measure_trained(pipe, runs, *, steps, backend="jax", prompts=12, checkpoint=None,
                    recipe=None):
    """The same runs on a model trained here (issue 28, the pipeline's committed checkpoint, or
    the trained tiny model at `checkpoint` with the pipeline's sampling),
    each on `prompts` held-out prompts (bench.pareto's draws), pooled: PSNR and rel L2 over
    all of them against the reference's, and prompt following per attribute (`recipe`:
    bench/fixtures/recipes.py, None the procedural one)."""
    from bench.fixtures.recipes import PROCEDURAL
    from bench.pareto.workload import FOLLOW_SEEDS, held_out_clip, prompt_tensors, shown_clip
    recipe = recipe or PROCEDURAL
    from modules.checkpoint import load_model
    from sampling.run import noise_for

    model = load_model(checkpoint or pipe.builtin_path)[0].eval()
    shape = pipe.latent_shape(*pipe.size)
    seeds = FOLLOW_SEEDS[:prompts]
    draws = {seed: prompt_tensors(pipe, seed, recipe, checkpoint) for seed in seeds}
    noise = torch.cat([noise_for(shape, seed) for seed in seeds])
    out, base = {}, None
    for name, config in {"reference": REFERENCE, **runs}.items():
        plan = SignalPlan.from_config(config)
        be = backend_of(backend, model, plan)
        latents, hits, calls, blocks, wall = [], [], [], [], 0.0
        for k, seed in enumerate(seeds):
            sample = make_sample(be, pipe, draws[seed], shape, image=False, seed=seed)
            traj = sample_once(be, config, sample, solver=pipe.solver, steps=steps,
                               shift=pipe.shift, step_sync=False, warmup_rounds=1 if k == 0 else 0)
            z = be.get(traj.latents).float()
            latents.append(z)
            hits.append(recipe.score(shown_clip(pipe, z), held_out_clip(seed, recipe)))
            calls.append(calls_fraction(traj))
            blocks.append(blocks_fraction(traj, pipe.config.num_layers, plan))
            wall += traj.stats.wall_seconds
        latents = torch.cat(latents)
        row = {"traj": traj, "calls": sum(calls) / len(calls), "blocks": sum(blocks) / len(blocks),
               **{a: sum(h[a] for h in hits) / len(hits) for a in recipe.attributes}}
        if base is None:
            base = (latents, wall)
            row.update(wall=1.0, signal=signal_scale(traj.gate.telemetry.trace))
        else:
            row.update(wall=base[1] / wall, **fidelity(latents, base[0], noise))
        out[name] = row
    return out


def in_order(results) -> bool:
    """safe >= balanced >= turbo in PSNR (the names' promise)."""
    psnr = [results[p]["psnr_db"] for p in ORDERED]
    return all(a >= b for a, b in zip(psnr, psnr[1:], strict=False))


# --- what a run prints and its page shows -------------------------------------------------------

FIGURES = ("calls", "blocks", "wall", "psnr_db", "rel_l2", "rel_to_displacement", "signal")


def record(title, header, results, *, attributes=(), family=None) -> dict:
    """One model's figures without the trajectories: what the tables and the page are made of.
    `title` names the model in the verdicts; `header` is the line above its table."""
    keep = (*FIGURES, *attributes)
    return {"title": title, "header": header, "family": family, "attributes": tuple(attributes),
            "signal": results["reference"]["signal"],
            "runs": {k: {f: v for f, v in r.items() if f in keep} for k, r in results.items()}}


def model_lines(m) -> list[str]:
    """The model's table as the bench prints it (random weights: rel/disp; trained: prompt
    following per attribute)."""
    runs, attrs = m["runs"], m["attributes"]
    if not attrs:
        out = [m["header"],
               f"{'run':20s} {'calls':>6s} {'blocks':>7s} {'wall':>6s} {'PSNR dB':>8s} "
               f"{'rel L2':>9s} {'rel/disp':>9s}",
               f"{'reference':20s} {1.0:6.3f} {1.0:7.3f} {1.0:5.2f}x {'-':>8s} {'-':>9s} {'-':>9s}"]
        for name, r in runs.items():
            if name != "reference":
                out.append(f"{name:20s} {r['calls']:6.3f} {r['blocks']:7.3f} {r['wall']:5.2f}x "
                           f"{r['psnr_db']:8.1f} {r['rel_l2']:9.2e} {r['rel_to_displacement']:9.2e}")
        return out
    out = [m["header"], f"{'run':20s} {'calls':>6s} {'blocks':>7s} {'wall':>6s} {'PSNR dB':>8s} "
                        f"{'rel L2':>9s}  prompt following ({', '.join(attrs)})"]
    for name, r in runs.items():
        fid = ("       -         -" if name == "reference"
               else f"{r['psnr_db']:8.1f} {r['rel_l2']:9.2e}")
        out.append(f"{name:20s} {r['calls']:6.3f} {r['blocks']:7.3f} {r['wall']:5.2f}x {fid}  "
                   + " ".join(f"{r[a]:4.0%}" for a in attrs))
    return out


def verdict_lines(models) -> list[str]:
    return ["safe >= balanced >= turbo in PSNR:"] + [
        f"  {m['title']:38s} signal {m['signal']:.1e}  {'yes' if in_order(m['runs']) else 'NO '}  "
        + " >= ".join(f"{m['runs'][p]['psnr_db']:.1f}" for p in ORDERED) for m in models]


def _span(values, fmt=".2f") -> str:
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}-{hi}"


def order_reading(models) -> str:
    broken = [m["title"] for m in models if not in_order(m["runs"])]
    if not broken:
        return f"safe >= balanced >= turbo in PSNR holds on all {len(models)} models"
    return (f"safe >= balanced >= turbo in PSNR holds on {len(models) - len(broken)} of "
            f"{len(models)} models (not on {', '.join(broken)})")


def calls_reading(models) -> str:
    """Each preset's computed fraction of calls over the models, and the one model furthest
    from its preset's median."""
    parts, far = [], None
    for p in ORDERED:
        values = [m["runs"][p]["calls"] for m in models]
        median = statistics.median(values)
        parts.append(f"{p} {_span(values)}")
        for m in models:
            gap = abs(m["runs"][p]["calls"] - median)
            if far is None or gap > far[0]:
                far = (gap, p, m, median)
    text = f"The fraction of calls each preset computes over the {len(models)} models: " + ", ".join(parts)
    if len(models) > 2 and far[0] > 0:
        _, p, m, median = far
        text += (f"; furthest from its preset's median: {p} on {m['title']}, "
                 f"{m['runs'][p]['calls']:.2f} against {median:.2f}")
    return text + "."


def signal_reading(models) -> str:
    """How far apart the quietest and loudest models of each family are, in median rel."""
    parts = []
    for family in dict.fromkeys(m["family"] for m in models):
        signals = [m["signal"] for m in models if m["family"] == family]
        if len(signals) > 1:
            parts.append(f"{max(signals) / min(signals):.0f}x ({family})")
    return (": the quietest and loudest models are " + " and ".join(parts) + " apart") if parts else ""


def prompt_reading(m, prompts: int) -> str:
    """Whether any run loses more than one prompt of an attribute against the reference."""
    ref, slack = m["runs"]["reference"], 1.0 / prompts + 1e-9
    lost = [f"{name} {a} {r[a]:.0%} against {ref[a]:.0%}" for name, r in m["runs"].items()
            if name != "reference" for a in m["attributes"] if r[a] < ref[a] - slack]
    if not lost:
        return (f"no run breaks the prompt (no attribute loses more than one of the {prompts} "
                "prompts against the reference)")
    return f"more than one of the {prompts} prompts lost against the reference: " + "; ".join(lost)


def hybrid_reading(m) -> str | None:
    """`hybrid` (not in the order) beside `balanced`, in PSNR and blocks computed."""
    h, b = m["runs"].get("hybrid"), m["runs"].get("balanced")
    if h is None or b is None:
        return None
    return (f"`hybrid` (not part of the order) keeps {'more' if h['psnr_db'] > b['psnr_db'] else 'less'} "
            f"than `balanced` ({h['psnr_db']:.1f} against {b['psnr_db']:.1f} dB) at "
            f"{'less' if h['blocks'] < b['blocks'] else 'more'} compute ({h['blocks']:.3f} against "
            f"{b['blocks']:.3f} of the blocks)")


def preset_lines() -> list[str]:
    """Each preset's settings, read from its file (cache/presets/*.json)."""
    out = []
    for name in PRESETS:
        f = load_preset(name)
        parts = []
        tea = f.get("teacache") or {}
        if "threshold" in tea:
            parts.append(f"TeaCache threshold {tea['threshold']:g}"
                         + (" times the mean change so far (relative)" if tea.get("relative") else ""))
        adapt = f.get("noise_adapt")
        last = re.fullmatch(r"table:last(\d+)", adapt or "")
        if last:
            parts.append(f"every call computes over the last {last.group(1)} percent of the schedule")
        elif adapt:
            parts.append(f"noise_adapt {adapt}")
        parts.append(f"tail blocks always run: {f.get('bn_blocks', 0)}")
        if f.get("forecast"):
            parts.append(f"forecast order {f['forecast']} of the reused residual")
        if (f.get("limits") or {}).get("max_continuous"):
            n = f['limits']['max_continuous']
            parts.append("never two reuses in a row" if n == 1 else f"at most {n} reuses in a row")
        if f.get("cfg_sep_diff") is False:
            parts.append("uncond borrows cond's change")
        if f.get("scene_guard"):
            parts.append(f"scene guard {f['scene_guard']:g}")
        out.append(f"- `{name}`{' (not part of the order)' if name not in ORDERED else ''}: "
                   + "; ".join(parts) + ".")
    return out


HEAD = """\
# bench/studies/presets.py

Presets side by side: computed fraction, wall-time speedup and fidelity against uncached. Each
section below is written by the run its command names (`--out`, this page by default): random
weights, `--weights trained`, and each `--checkpoint`; a run replaces its own section and keeps
the others.

Issue 16: the presets were absolute TeaCache thresholds with unrelated structure (alternating
skips in balanced and turbo, not in safe); on models whose signal moves slowly per step the
thresholds were never reached and the alternation alone decided. The presets are now written in
units that transfer between models (`cache/presets/*.json`, `cache/teacache.py`,
`cache/noise_adapt.py`): the TeaCache threshold is a multiple of the mean rescaled change the
signal showed so far in the run (or expert phase), its own scale, so a model whose signal moves
much slower per step takes the same decisions at the same setting; each protects the end of the
schedule, where a reuse costs the most (`noise_adapt table:lastN`). As the files set them:
"""


def head() -> str:
    """The page's top: what the sections measure, and each preset's settings from its file."""
    return HEAD + "\n" + "\n".join(preset_lines()) + "\n"


def _reproduce(cmd, elapsed, loads, extra="") -> str:
    return (f"Reproduce: `{cmd}` ({elapsed:.0f} s{extra}; {datetime.date.today().isoformat()}; "
            f"{machine()}; {versions(('jax',))}; 1-minute load average "
            f"{loads[0]:.2f} at the start, {loads[1]:.2f} at the end: the wall column moves with "
            "other jobs on the machine, the other columns do not).")


def random_section(models, *, cmd, elapsed, loads, init, plot=None) -> list[str]:
    """The random-weight section: the run's output and the readings computed from its rows.
    `plot`: the trace plot's path relative to the page, if one was drawn."""
    lines = ["## Random weights", "", _reproduce(cmd, elapsed, loads), "",
             "The models: `bench/workload.py`'s smooth-in-t init at the `SIGNAL_SCALES` named; "
             f"`signal` is the median per-step TeaCache rel of the reference run{signal_reading(models)}. "
             "`calls` is the computed fraction of model calls, `blocks` of block evaluations. "
             "Reference: every call computed (TeaCache at threshold 0, bit-identical to caching off).",
             "", "```", init]
    for m in models:
        lines += ["", *model_lines(m)]
    lines += ["", *verdict_lines(models), "```", "",
              f"{order_reading(models)}. {calls_reading(models)} `tests/test_presets_order.py` "
              "checks the order, and the computed fractions, on smaller models of both families."]
    if plot:
        lines += ["", f"![per-step trace]({plot})", "",
                  "The plot: per-step rel, accumulator, threshold (per call: relative, and 0 over the "
                  "protected end) and reused steps of the cond branch, benchmark-scale models."]
    return lines


def trained_section(models, *, cmd, elapsed, loads, init, prompts, weights, checkpoint=None) -> list[str]:
    """A trained-weight section (`--weights trained`, or one `--checkpoint`): the run's output and
    the readings computed from its rows. `weights`: (path, training step or None) per model."""
    title = f"## Trained weights: `{checkpoint}`" if checkpoint else "## Trained weights (issue 28)"
    held = "; ".join(f"`{path}`" + (f" at step {step}" if step is not None else "")
                     for path, step in weights)
    lines = [title, "", _reproduce(cmd, elapsed, loads, f"; {prompts} held-out prompts per run, pooled"),
             "", f"Weights: {held}. The reference computes every call; PSNR and rel L2 pool the "
             f"{prompts} final latents; prompt following is the fixtures' analyser on each decoded "
             "video.", "", "```", init]
    for m in models:
        lines += ["", *model_lines(m)]
    lines += ["", *verdict_lines(models), "```", "", "Reading it:", ""]
    for m in models:
        text = (f"{m['title']}: safe >= balanced >= turbo in PSNR "
                f"{'holds' if in_order(m['runs']) else 'does NOT hold'}; {prompt_reading(m, prompts)}")
        hybrid = hybrid_reading(m)
        lines.append(f"- {text}" + (f"; {hybrid}." if hybrid else "."))
    return lines


# --- the page: one section per mode (bench/page.py writes it) --------------------------------

SECTIONS = ("random", "trained")  # first on the page; then each --checkpoint's


def _rank(key: str) -> int:
    return SECTIONS.index(key) if key in SECTIONS else len(SECTIONS)


def command(args) -> str:
    """The command that reproduces the run (its flags that differ from the defaults; --out aside)."""
    return command_line("bench.studies.presets", args, DEFAULTS)


DEFAULTS = {"steps": 50, "blocks": 16, "scales": ",".join(SIGNAL_SCALES), "backend": "jax",
            "weights": "random", "prompts": 12, "checkpoint": None,
            "plot": "bench/results/presets_trace.png"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    ap.add_argument("--blocks", type=int, default=DEFAULTS["blocks"])
    ap.add_argument("--scales", default=DEFAULTS["scales"],
                    help=f"comma-separated among {', '.join(SIGNAL_SCALES)}")
    ap.add_argument("--backend", choices=("jax", "torch"), default=DEFAULTS["backend"])
    ap.add_argument("--weights", choices=("random", "trained"), default=DEFAULTS["weights"],
                    help="trained: the tiny models trained here (issue 28), each run pooled over "
                         "--prompts held-out prompts, with prompt following")
    ap.add_argument("--prompts", type=int, default=DEFAULTS["prompts"],
                    help="held-out prompts (trained weights)")
    ap.add_argument("--checkpoint", help="trained weights: a trained tiny model of one family in "
                    "place of its committed one (the further held-out model, or one trained "
                    "elsewhere)")
    ap.add_argument("--plot", default=DEFAULTS["plot"],
                    help="PNG path for the per-step trace plot ('' for none)")
    ap.add_argument("--out", default=OUT, help="the results page whose section this run writes "
                    "('' for none): random weights, --weights trained, or the --checkpoint's")
    args = ap.parse_args()
    if args.backend == "torch":
        torch.set_num_threads(1)  # 2 shared cores: more threads spin-wait under contention
    runs = {**{p: preset_config(p) for p in PRESETS},
            "deepcache 11/45/4": CMConfig(deepcache=DeepCacheConfig())}
    if args.checkpoint is not None and (args.weights != "trained"
                                        or not os.path.exists(args.checkpoint)):
        ap.error(f"--checkpoint {args.checkpoint}: expected an existing trained model's folder, "
                 "with --weights trained")
    began, load = time.perf_counter(), os.getloadavg()[0]
    if args.weights == "trained":
        return main_trained(args, runs, began, load)
    traces, models = {}, []
    init = (f"init: smooth in t (bench/workload.py), signal scales {args.scales}, seed 0; CFG on; "
            f"fp32; {args.backend} backend on CPU")
    print(init)
    for title, pipe, cfg in cases(args.blocks):
        for scale in args.scales.split(","):
            results = measure(pipe, cfg, scale, runs, steps=args.steps, backend=args.backend)
            ref = results["reference"]
            shape = pipe.latent_shape(*pipe.size)
            header = (f"{title}, {scale} ({SIGNAL_SCALES[scale]}): {args.blocks} blocks, latent "
                      f"{list(shape)} ({pipe.tokens(shape)} tokens), {args.steps} steps; signal: "
                      f"median TeaCache rel {ref['signal']:.2e} per step")
            models.append(record(f"{title}, {scale}", header, results, family=title))
            print("\n" + "\n".join(model_lines(models[-1])))
            if scale == "benchmark":
                for name in runs:
                    traces[(title, name)] = results[name]["traj"].gate.telemetry.trace
    print("\n" + "\n".join(verdict_lines(models)))
    plot = None
    if args.plot and traces:
        from sampling.sinks import plot_traces
        plot = plot_traces({f'{t}: {n}': rows for (t, n), rows in traces.items()}, args.plot)
        print(f"plot: {plot}")
    if args.out:
        rel = (os.path.relpath(os.path.abspath(args.plot), os.path.dirname(os.path.abspath(args.out)))
               if plot else None)
        write_section(args.out, "random", random_section(
            models, cmd=command(args), elapsed=time.perf_counter() - began,
            loads=(load, os.getloadavg()[0]), init=init, plot=rel), head(), _rank)


def main_trained(args, runs, began, load):
    from bench.pareto.workload import deep_pipeline, trained_families
    init = (f"weights: trained here (issue 28), {args.prompts} held-out prompts per run, pooled; "
            f"CFG on; fp32; {args.backend} backend on CPU")
    print(init)
    models, weights = [], []
    for family in trained_families(args.checkpoint).values():  # --checkpoint: its family only
        # the family's tiny pipeline, with what a checkpoint of another recipe fixes (its
        # clip size and sampling) and the checkpoint's own config
        name, pipe = family.pipeline, deep_pipeline(family)
        results = measure_trained(pipe, runs, steps=args.steps, backend=args.backend,
                                  prompts=args.prompts, checkpoint=family.checkpoint,
                                  recipe=family.prompts)
        ref = results["reference"]
        header = (f"{name} ({args.checkpoint or pipe.builtin}): {pipe.config.num_layers} blocks, "
                  f"{args.steps} steps "
                  f"{pipe.solver}; signal: median TeaCache rel {ref['signal']:.2e} per step")
        models.append(record(name, header, results, attributes=family.prompts.attributes))
        print("\n" + "\n".join(model_lines(models[-1])))
        path = family.checkpoint or pipe.builtin_path
        weights.append((os.path.relpath(path, ROOT), trained_step(path)))
    print("\n" + "\n".join(verdict_lines(models)))
    if args.out:
        # one section per checkpoint, however its path was spelt
        ckpt = args.checkpoint and os.path.relpath(os.path.abspath(args.checkpoint), ROOT)
        write_section(args.out, f"checkpoint {ckpt}" if ckpt else "trained", trained_section(
            models, cmd=command(args), elapsed=time.perf_counter() - began,
            loads=(load, os.getloadavg()[0]), init=init, prompts=args.prompts, weights=weights,
            checkpoint=ckpt), head(), _rank)


if __name__ == "__main__":
    main()

"""Our gate inside diffusers pipelines (adapters/diffusers) against our torch backend on the same
trained weights, held-out prompts and schedule: are the decisions the same at every step, how
far apart are the final latents, and what does the gate cost inside a diffusers pipeline.

    python -m bench.studies.diffusers_adapter [--draws 4] [--out bench/results/diffusers_adapter.md]

Per family (the built-in trained Wan2.2-style and HunyuanVideo-1.5-style models) and setting,
each held-out draw (bench.pareto.workload's split) runs through our torch backend and through
the diffusers pipeline with `enable_cache`; a row counts the draws whose per-call trace (step,
branch, compute or reuse, reason) is identical, the largest final-latent difference (max |a - b|
/ max |b|), and the computed fraction. Timing (same process, interleaved, median of --rounds):
the diffusers pipeline as it comes, with the gate and caching off (the price of the hook and
the staged call), and with each setting.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from adapters.diffusers import cache_report, disable_cache, enable_cache  # noqa: E402
from adapters.diffusers.tiny import (  # noqa: E402
    call_inputs,
    diffusers_transformer,
    make_pipeline,
    our_trajectory,
)
from bench.pareto.workload import prompt_tensors  # noqa: E402
from cache import CMConfig  # noqa: E402
from modules.checkpoint import load_model  # noqa: E402
from sampling.pipelines import get_pipeline  # noqa: E402

MODELS = ("wan-tiny-trained", "hunyuanvideo-tiny-trained")
SETTINGS = {  # label -> enable_cache keywords (our flags without dashes)
    "preset safe": {"preset": "safe"},
    "preset balanced": {"preset": "balanced"},
    "preset turbo": {"preset": "turbo"},
    "teacache 0.05": {"teacache": True, "teacache_thresh": 0.05},
    "fbcache 0.05 + forecast 1": {"fbcache": True, "fb_thresh": 0.05, "forecast": 1},
}
FIRST_DRAW = 100  # held-out draws 100, 101, ...


def _config(keywords: dict) -> CMConfig:
    from adapters.diffusers.settings import resolve
    return resolve(keywords, ()).config


def _trace(rows):
    return [(r["step"], r["expert"], r["branch"], r["action"], r["reason"]) for r in rows]


def _timed(pipe, inputs) -> float:
    began = time.perf_counter()
    pipe(**inputs)
    return time.perf_counter() - began


def measure(name: str, draws: int, rounds: int) -> dict:
    ours = get_pipeline(name)
    model = load_model(ours.builtin_path)[0].eval()
    shape = ours.latent_shape(*ours.size)
    text_len = getattr(model.config, "text_len", None)
    rows, flips = [], []
    for label, keywords in SETTINGS.items():
        config = _config(keywords)
        same, worst, fractions = 0, 0.0, []
        for draw in range(FIRST_DRAW, FIRST_DRAW + draws):
            tensors = prompt_tensors(ours, draw)
            traj = our_trajectory(ours, {None: model}, tensors, shape, config, seed=draw)
            pipe = make_pipeline(ours, {None: diffusers_transformer(model)})
            enable_cache(pipe, **keywords)
            theirs = pipe(**call_inputs(ours, tensors, shape, draw, text_len)).frames
            report = cache_report(pipe)
            if _trace(report["trace"]) == _trace(traj.gate.telemetry.trace):
                same += 1
            else:
                flips.append(_first_flip(label, draw, report["trace"], traj.gate.telemetry.trace))
            worst = max(worst, float((theirs - traj.latents).abs().max()
                                     / traj.latents.abs().max()))
            fractions.append(report["computed_fraction"])
        rows.append({"setting": label, "same": same, "draws": draws, "worst": worst,
                     "computed": statistics.mean(fractions)})
    # timing: one pipeline, the gate put on and taken off between interleaved rounds
    tensors = prompt_tensors(ours, FIRST_DRAW)
    inputs = call_inputs(ours, tensors, shape, FIRST_DRAW, text_len)
    pipe = make_pipeline(ours, {None: diffusers_transformer(model)})
    variants = {"diffusers, no gate": None, "gate on, caching off": {"config": CMConfig()},
                **{label: kw for label, kw in SETTINGS.items()}}
    seconds = {label: [] for label in variants}
    for _ in range(rounds + 1):  # the first round warms up
        for label, keywords in variants.items():
            if keywords is not None:
                enable_cache(pipe, **keywords)
            seconds[label].append(_timed(pipe, inputs))
            if keywords is not None:
                disable_cache(pipe)
    timing = {label: statistics.median(s[1:]) for label, s in seconds.items()}
    return {"model": name, "rows": rows, "timing": timing, "steps": ours.steps, "flips": flips}


def _first_flip(label, draw, theirs, ours) -> dict:
    """The first call where the two traces part: the gate's accumulated change and threshold
    on both sides (a decision taken on a tie float rounding breaks either way)."""
    for a, b in zip(theirs, ours, strict=False):
        if (a["action"], a["reason"]) != (b["action"], b["reason"]):
            return {"setting": label, "draw": draw, "step": a["step"], "branch": a["branch"],
                    "adapter": (a["action"], a["accum"], a["threshold"]),
                    "ours": (b["action"], b["accum"], b["threshold"])}
    return {"setting": label, "draw": draw, "step": None}


def page(results: list[dict], args) -> str:
    lines = ["# Our gate inside diffusers pipelines", "",
             f"`python -m bench.studies.diffusers_adapter --draws {args.draws} --rounds {args.rounds}` "
             f"on this machine ({os.cpu_count()} CPU cores; trained weights, the procedural "
             "recipe; held-out prompts, draws "
             f"{FIRST_DRAW}-{FIRST_DRAW + args.draws - 1}; fp32). Each draw runs through our torch "
             "backend and through the diffusers pipeline (`WanPipeline`, "
             "`HunyuanVideo15Pipeline`) with `adapters.diffusers.enable_cache` on the same weights "
             "(converted to diffusers' layout), inputs and schedule.", ""]
    for r in results:
        lines += [f"## {r['model']} ({r['steps']} steps)", "",
                  "| setting | draws with the same per-call trace | largest final-latent "
                  "difference (max abs / max) | computed fraction (mean) |",
                  "|---|---|---|---|"]
        for row in r["rows"]:
            lines.append(f"| {row['setting']} | {row['same']} of {row['draws']} | "
                         f"{row['worst']:.1e} | {row['computed']:.2f} |")
        for f in r["flips"]:
            lines.append("")
            if f["step"] is None:
                lines.append(f"- {f['setting']}, draw {f['draw']}: the traces differ in length")
                continue
            (ta, aa, ha), (to, ao, ho) = f["adapter"], f["ours"]
            if None in (aa, ha, ao, ho):
                lines.append(f"- {f['setting']}, draw {f['draw']}: the traces part at step "
                             f"{f['step']} ({f['branch']}): the adapter {ta}s, ours {to}s")
                continue
            lines.append(f"- {f['setting']}, draw {f['draw']}: the traces part at step "
                         f"{f['step']} ({f['branch']}): the adapter {ta}s with accumulated change "
                         f"{aa!r} against threshold {ha!r}, ours {to}s with {ao!r} against "
                         f"{ho!r} (difference {abs(aa - ha):.1e} and {abs(ao - ho):.1e}: a tie "
                         "that float rounding breaks either way); from there the two "
                         "trajectories are two schedules")
        base = r["timing"]["diffusers, no gate"]
        lines += ["", "| pipeline call (median, seconds) | seconds | against diffusers with "
                  "no gate |", "|---|---|---|"]
        for label, s in r["timing"].items():
            lines.append(f"| {label} | {s:.3f} | {base / s:.2f}x |")
        lines.append("")
    lines += ["\"gate on, caching off\" is the price of the hook and the staged call alone "
              "(every call computed); the other rows are wall-clock speedups of the whole "
              "pipeline call on these tiny models on the CPU, where the gate's Python per call "
              "weighs more than at real size ([gpu.md](gpu.md) times our torch backend beside "
              "diffusers on one card).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draws", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                  "diffusers_adapter.md"))
    args = ap.parse_args(argv)
    results = []
    for name in MODELS:
        results.append(measure(name, args.draws, args.rounds))
        for row in results[-1]["rows"]:
            print(f"{name} {row['setting']}: same trace {row['same']}/{row['draws']}, worst "
                  f"{row['worst']:.1e}, computed {row['computed']:.2f}", flush=True)
    with open(args.out, "w") as f:
        f.write(page(results, args))
    print(f"wrote {args.out}")
    everywhere = all(row["same"] == row["draws"] for r in results for row in r["rows"])
    return 0 if everywhere else 1


if __name__ == "__main__":
    sys.exit(main())

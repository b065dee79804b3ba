"""bench/results/gpu.md and gpu.json from `python -m bench.gpu`'s phases (or its plan alone, with
"not run yet"): the card, driver and versions, the CPU check, the per-step table beside
diffusers, compile seconds, peak memory, each cached run against its schedule ideal, and the
plan's arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

from bench.page import write_page
from sampling.journal import atomic_write
from sampling.units import GiB


def write(folder: Path, results: dict | None, plan: dict) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if results is not None:
        text = json.dumps(results, indent=1, default=str) + "\n"
        atomic_write(str(folder / "gpu.json"), lambda f: f.write(text))  # a kill keeps the last
        print(f"wrote {folder / 'gpu.json'}")
    write_page(str(folder / "gpu.md"), lines(results, plan))


def lines(results: dict | None, plan: dict) -> list[str]:
    from bench.gpu.verdicts import verdicts
    out = ["# On a GPU: the JAX and torch backends at real size, beside diffusers", ""]
    if results is None:
        out += ["**Not run yet**: no GPU has been lent to this project's sessions. Nothing on this "
                "page is a GPU figure; the plan below is arithmetic.", "",
                "On a GPU machine: `pip install -r requirements-gpu.txt && python -m bench.gpu`. "
                "On the lent machine, which reaches no index: `python -m tools.gpu_wheels` here "
                "(the wheels it lacks, with their sizes, and whether they fit beside the tree), "
                "carry `gpu-wheels`, and there `pip install --no-index --find-links gpu-wheels "
                "torchax==0.0.13 diffusers==0.42.1 && python -m bench.gpu`; then, as a second "
                "command (about 2 minutes), our gate inside diffusers' WanPipeline beside "
                "diffusers' FirstBlockCache: `python -m bench.gpu --phases smoke,adapter --out "
                "bench/results/gpu_adapter`."]
    else:
        out += _measured(results)
        out += ["", "## Targets", "", "| target | met |", "|---|---|"]
        out += [f"| {k} | {'-' if v is None else 'yes' if v else 'no'}{_under(results, k, v)} |"
                for k, v in verdicts(results).items()]
    return out + [""] + _plan(plan)


def _under(results: dict, key: str, met) -> str:
    """A failed 90%-of-ideal verdict names its runs."""
    from bench.gpu.verdicts import under_ideal
    if met is not False or "schedule ideal" not in key:
        return ""
    runs = under_ideal(results, key.split(":", 1)[0])
    return " (" + ", ".join(f"{k} {share:.0%}" for k, share in runs) + ")"


def _measured(results: dict) -> list[str]:
    from bench.gpu.verdicts import speedup as gpu_speedup
    from bench.gpu.verdicts import timed
    phases = results["phases"]
    smoke = phases.get("smoke", {})
    asked = results.get("asked")
    from bench.gpu.plan import DEFAULT_PHASES
    phases_flag = "" if asked in (None, list(DEFAULT_PHASES)) else f" --phases {','.join(asked)}"
    out = [f"- date: {results['date']}; command: `python -m bench.gpu"
           f"{' --tiny' if results['tiny'] else ''}{phases_flag}`",
           f"- card: {smoke.get('card', 'none (CPU)')}, {smoke.get('capability', '-')}, "
           f"{smoke.get('memory_gib', '-')} GiB; driver {smoke.get('driver')}; CUDA (torch) "
           f"{smoke.get('torch_cuda')}",
           f"- versions: Python {smoke.get('python')}, torch {smoke.get('torch')}, jax "
           f"{smoke.get('jax')} ({smoke.get('jax_backend')}), torchax {smoke.get('torchax')}, "
           f"diffusers {smoke.get('diffusers')}",
           f"- cuDNN fused attention against XLA's (one bf16 call): {smoke.get('fused_attention')}"]
    for name, entry in phases.items():
        if "error" in entry:
            out.append(f"- phase {name} FAILED ({entry['phase_s']:.0f} s): "
                       f"`{entry['error'].splitlines()[0][:300]}`")
    check = phases.get("check", {})
    if "jax" in check:
        out += ["", "## The built-in trained model, device against CPU", "",
                f"{check['model']}, {check['steps']} steps, {check['gate']}, fp32 at the highest "
                f"matmul precision; tolerance rel L2 {check['tolerance']}.", "",
                "| backend | rel L2 vs CPU | decisions equal | computed steps | loop compiles | ok |",
                "|---|---|---|---|---|---|"]
        for b in ("jax", "torch"):
            c = check[b]
            out.append(f"| {b} | {c['rel_l2']:.2e} | {c['decisions_equal']} | {c['computed']} | "
                       f"{c['loop_compiles']} | {c['ok']} |")
        out.append(f"\nJAX against torch on the device: rel L2 {check['jax_vs_torch_rel_l2']:.2e}.")
    jx, th = phases.get("jax", {}), phases.get("torch", {})
    # every size either timing phase finished (one may have been cut off after its first)
    for label in dict.fromkeys([*jx.get("sizes", {}), *th.get("sizes", {})]):
        out += ["", f"## {label}: per-step time", ""]
        size = jx.get("sizes", {}).get(label) or th["sizes"][label]
        out.append(f"{size['tokens']:,} image tokens, {size['steps']} steps, CFG (2 calls a "
                   "step); medians over rounds, warm-up excluded, a sync after every step.")
        out += ["", "| run | computed | median s/step | wall s | speedup vs same backend uncached "
                "| schedule ideal | share of ideal | first warm-up s | loop compiles |",
                "|---|---|---|---|---|---|---|---|---|"]
        rows = timed(results, label)
        for key, r in rows.items():
            speedup = gpu_speedup(rows, key)
            warm = "-" if r["warmup_s"] is None else f"{r['warmup_s']:.1f}"
            out.append(f"| {key} | {r['computed']}/{r['steps']} | {r['step_s']:.3f} | "
                       f"{r['wall_s']:.2f} | {speedup:.2f}x | {r['ideal']:.2f}x | "
                       f"{speedup / r['ideal']:.0%} | {warm} | {r['loop_compiles']} |")
        j = jx.get("sizes", {}).get(label)
        if j:
            peak = "-" if j["peak_bytes"] is None else f"{j['peak_bytes'] / GiB:.1f} GiB"
            out.append(f"\nJAX: attention {jx.get('attention')} (cuDNN's fused kernel where it "
                       f"applies: {jx.get('fused_attention_on_gpu')}, on a GPU only); backends "
                       "built (weights drawn on the device, inputs placed) in "
                       f"{j['weights_s']:.1f} s; compile from "
                       f"the persistent cache (after jax.clear_caches) {j['warm_compile_s']:.1f} s, "
                       f"{j['warm_compiled']} compiled; peak device memory {peak}.")
        t = th.get("sizes", {}).get(label)
        if t:
            peaks = ", ".join(f"{k} {v / GiB:.1f}" for k, v in t["peak_bytes"].items() if v)
            if peaks:
                out.append(f"torch peak GiB: {peaks}.")
            if "ours_vs_diffusers_one_call" in t:
                out.append(f"Same weights, one call, ours (torch) vs diffusers: max abs diff / max "
                           f"abs {t['ours_vs_diffusers_one_call']:.2e}.")
    if phases.get("adapter", {}).get("runs"):
        from bench.gpu.adapter import lines as adapter_lines
        out += adapter_lines(phases["adapter"])
    return out


def _plan(plan: dict) -> list[str]:
    out = ["## Plan: why it fits the device time", "",
           f"{plan['model']}: {plan['blocks']} blocks, dim {plan['dim']}, FFN {plan['ffn']}. FLOPs "
           "of one model call: per block, the linear layers on every image token (2 FLOPs a "
           "multiply-add), the cross-attention's k/v on the text tokens, and QK^T and PV "
           "(4 L S dim); a step is two calls (CFG). Expected seconds at "
           f"{plan['assumed_mfu']:.0%} of an H100's {plan['peak_flops'] / 1e12:.0f} dense bf16 "
           "TFLOP/s (an assumption for the plan, not a result).", "",
           "| size | latent | image tokens | TFLOPs a step | expected s a step | steps x rounds | "
           "timed runs | expected s |", "|---|---|---|---|---|---|---|---|"]
    for s in plan["sizes"]:
        out.append(f"| {s['size']} | {'x'.join(map(str, s['latent']))} | {s['tokens']:,} | "
                   f"{s['step_tflops']:.1f} | {s['expected_step_s']:.2f} | {s['steps']} x "
                   f"{s['rounds']} | {len(s['runs'])} | {s['expected_run_s']:.0f} |")
    out += ["", "| part | expected s |", "|---|---|"]
    out += [f"| {k} | {v:.0f} |" for k, v in plan["seconds"].items()]
    fits = "fits" if plan["total_s"] <= plan["budget_s"] else "does NOT fit"
    out += [f"| **total** | **{plan['total_s']:.0f}** ({fits} {plan['budget_s'] / 60:.0f} min) |",
            "", "Timed runs per round: " + ", ".join(plan["sizes"][0]["runs"]) + "."]
    return out

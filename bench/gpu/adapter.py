"""bench.gpu's adapter phase: our gate inside diffusers' own WanPipeline (adapters/diffusers) beside
diffusers' FirstBlockCache hook, on the same card, the same weights and the same inputs.

    python -m bench.gpu --phases smoke,adapter --out bench/results/gpu_adapter   # on the GPU
    python -m bench.gpu --tiny --phases smoke,adapter --out DIR                  # the CPU, tiny

Wan2.2 TI2V-5B at 480p (seeded random bf16 weights drawn on the device, as the torch phase
draws them), a pipeline without text encoder or VAE sampling latents from given embeddings and
noise. Runs, each after an untimed warm-up call of two steps: the pipeline uncached; diffusers'
FirstBlockCache at FB_THRESHOLD; the adapter with caching off (what its hook costs); the adapter's
FBCache at the same threshold on the same metric; the adapter's balanced preset. Each: wall
seconds of the call (a sync after), transformer calls computed (the adapter's report; diffusers'
hook reports none), rel L2 of the final latents against the uncached pipeline's, peak memory.
A separate command (about 2 minutes of device time) because the default phases fill one."""

from __future__ import annotations

import time

FB_THRESHOLD = 0.05  # the same threshold and metric (residual rel L1 of block 0) on both sides
RUNS = ("diffusers none", f"diffusers FirstBlockCache {FB_THRESHOLD}", "adapter off",
        f"adapter fbcache {FB_THRESHOLD}", "adapter preset balanced")


def phase_adapter(args) -> dict:
    import torch
    from diffusers.hooks import FirstBlockCacheConfig

    from adapters.diffusers import cache_report, disable_cache, enable_cache
    from adapters.diffusers.tiny import call_inputs, make_pipeline
    from bench.gpu import torch_wan_step as tws
    from bench.gpu.plan import REAL, TINY
    from sampling.pipelines import get_pipeline

    ours = get_pipeline(TINY if args.tiny else REAL)
    device = torch.device("cpu" if args.tiny else "cuda")
    steps = 4 if args.tiny else 8
    size = ours.size if args.tiny else (480, 832, 81)
    model = tws.random_bf16_model(ours.experts[0][1], device, 0)
    transformer = tws.diffusers_wan(model, device)
    del model  # diffusers' copy holds the weights (shared tensors); ours is not run here
    pipe = make_pipeline(ours, {None: transformer})
    shape = ours.latent_shape(*size)
    inputs = call_inputs(ours, ours.synthesize(shape, True, False, 0), shape, 0,
                         ours.config.text_len)
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    inputs["num_inference_steps"] = steps

    def call(n):
        latents = pipe(**{**inputs, "num_inference_steps": n}).frames
        tws.sync(device)
        return latents

    on = {"diffusers none": (lambda: None, lambda: None),
          RUNS[1]: (lambda: transformer.enable_cache(FirstBlockCacheConfig(threshold=FB_THRESHOLD)),
                    transformer.disable_cache),
          "adapter off": (lambda: enable_cache(pipe), lambda: disable_cache(pipe)),
          RUNS[3]: (lambda: enable_cache(pipe, fbcache=True, fb_thresh=FB_THRESHOLD,
                                         fb_metric="residual_tensor_rel_l1"),
                    lambda: disable_cache(pipe)),
          "adapter preset balanced": (lambda: enable_cache(pipe, preset="balanced"),
                                      lambda: disable_cache(pipe))}
    out = {"device": tws.device_name(device), "model": ours.name, "pixels": list(size),
           "tokens": ours.tokens(shape), "steps": steps, "runs": {}}
    reference = None
    with torch.no_grad():
        for name in RUNS:
            enable, disable = on[name]
            enable()
            try:
                call(2)  # warm-up: kernels, the gate's stages, allocator
                tws.start_peak(device)
                began = time.perf_counter()
                latents = call(steps).float()
                wall = time.perf_counter() - began
                report = cache_report(pipe) if name.startswith("adapter") else None
            finally:
                disable()
            if reference is None:
                reference = latents
            rel = float((latents - reference).norm() / reference.norm())
            out["runs"][name] = {
                "wall_s": wall, "rel_l2": rel, "peak_bytes": tws.peak_bytes(device),
                "calls": 2 * steps,
                "computed": None if report is None else report["computed"],
                "ideal": None if report is None else report["ideal_speedup"],
                "signal_reads": None if report is None else report["signal_reads"]}
    return out


def lines(entry: dict) -> list[str]:
    """The page's section for the adapter phase."""
    runs = entry["runs"]
    base = runs.get("diffusers none", {}).get("wall_s")
    out = ["", "## Our gate inside diffusers' WanPipeline, beside diffusers' FirstBlockCache", "",
           f"{entry['model']} at {'x'.join(map(str, entry['pixels']))} ({entry['tokens']:,} "
           f"tokens), {entry['steps']} steps, CFG: one pipeline call a run, after a 2-step "
           "warm-up; random bf16 weights, so what the gates decide says little of a trained "
           "model (the speed of a decision taken does).", "",
           "| run | calls computed | wall s | speedup vs the pipeline uncached | schedule ideal "
           "| rel L2 vs uncached | signal reads |", "|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        speedup = "-" if not base else f"{base / r['wall_s']:.2f}x"
        computed = "-" if r["computed"] is None else f"{r['computed']}/{r['calls']}"
        ideal = "-" if r["ideal"] is None else f"{r['ideal']:.2f}x"
        reads = "-" if r["signal_reads"] is None else str(r["signal_reads"])
        out.append(f"| {name} | {computed} | {r['wall_s']:.2f} | {speedup} | {ideal} | "
                   f"{r['rel_l2']:.2e} | {reads} |")
    return out

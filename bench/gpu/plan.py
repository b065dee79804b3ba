"""What bench.gpu's timing phases run and what they cost, by arithmetic before any device
time is spent: the sizes (pixels, steps, rounds), each call's FLOPs, the runs of each phase, and
the plan the page prints (`python -m bench.gpu --plan_only`)."""

from __future__ import annotations

from types import SimpleNamespace

REAL, TINY = "wan2.2-ti2v-5b", "wan-tiny-ti2v"
# what one command runs by default (8 minutes of device time); the adapter phase is a second
# command of its own (bench/gpu/adapter.py)
DEFAULT_PHASES = ("smoke", "check", "jax", "torch")


class Size(SimpleNamespace):
    """One size the timing phases run: pixels, steps, rounds and the cached runs beside uncached."""


def sizes(tiny: bool) -> dict[str, Size]:
    """label -> Size. 480p is TI2V-5B's 832x480, 81 frames; 720p-class its 1280x704, 121 frames
    (31 x 22 x 40 = 27,280 tokens), timed uncached and eager only: the cached runs' ratio to
    their ideal does not need it, and the device time has no room for more compiles."""
    if tiny:
        from sampling.pipelines import get_pipeline
        # torch.compile of even the tiny model takes a minute on a CPU (inductor's C++ build);
        # tests/test_torch_backend.py covers the compiled path, so the tiny mode leaves it out
        return {"tiny": Size(pixels=get_pipeline(TINY).size, steps=4, rounds=2,
                             cached=("deepcache", "teacache"), compiled=False)}
    return {"480p": Size(pixels=(480, 832, 81), steps=6, rounds=2, cached=("deepcache", "teacache"),
                         compiled=True),
            "720p": Size(pixels=(704, 1280, 121), steps=3, rounds=1, cached=(), compiled=False)}


# --- the plan: what the timing phases cost, by arithmetic ---------------------------------------

H100_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak of an H100 SXM (H200: the same chip)
ASSUMED_MFU = 0.35  # share of that peak a DiT step is assumed to reach (plan only, not a result)
# Compile seconds per program set, estimates (the run measures them): the JAX set of TI2V-5B
# (probe, scanned middle, tail, helpers) took 146 s compiled by libtpu for 8 chips on our
# shared 2-core machine (bench/results/tpu_aot.md), about a third of that on a 16-core GPU host;
# torch.compile (dynamo and inductor over one stage's graph) about twice the JAX set.
COMPILE_SECONDS = {"jax": 45.0, "torch_compile": 90.0}
FIXED_SECONDS = {"smoke": 30.0, "check": 40.0, "jax startup and weights": 30.0,
                 "torch startup and weights": 30.0}
DEVICE_MINUTES = 8.0  # the plan must fit this; the device tool allows 10 a command


def call_flops(cfg, tokens: int) -> float:
    """FLOPs of one model call: per block, self-attention's q/k/v/o and the cross-attention's q/o
    projections and the FFN on every image token (2 FLOPs a multiply-add), the cross-attention's
    k/v on the text tokens, and the attention products (QK^T and PV: 4 * L * S * dim)."""
    d, f, text = cfg.dim, cfg.ffn_dim, cfg.text_len
    per_token = 2 * (4 * d * d + 2 * d * d + 2 * d * f)
    text_kv = 2 * 2 * d * d * text
    attention = 4 * tokens * tokens * d + 4 * tokens * text * d
    return cfg.num_layers * (tokens * per_token + text_kv + attention)


def plan(tiny: bool = False) -> dict:
    """Token counts, FLOPs per step and expected seconds of every timed run, and the total."""
    from modules.registry import build_model
    from sampling.pipelines import get_pipeline

    pipe = get_pipeline(TINY if tiny else REAL)
    cfg = build_model(pipe.experts[0][1], meta=True).config
    rows, total, timed_sizes = [], dict(FIXED_SECONDS), sizes(tiny)
    for label, size in timed_sizes.items():
        shape = pipe.latent_shape(*size.pixels)
        tokens = pipe.tokens(shape)
        step_flops = 2 * call_flops(cfg, tokens)  # CFG: two calls a step
        step_s = step_flops / (H100_BF16_FLOPS * ASSUMED_MFU)
        runs = timed_runs(size)
        # a cached run's steps cost about its computed share; counted whole here (an upper
        # bound), and each run's warm-up (every program once, about a step) in the first round
        seconds = (size.rounds * size.steps + 1) * len(runs) * step_s
        rows.append(dict(size=label, pixels=size.pixels, latent=list(shape), tokens=tokens,
                         text_tokens=cfg.text_len, step_tflops=step_flops / 1e12,
                         expected_step_s=step_s, steps=size.steps, rounds=size.rounds, runs=runs,
                         expected_run_s=seconds))
        total[f"runs at {label}"] = seconds
    total["jax compiles"] = COMPILE_SECONDS["jax"] * sum(len(jax_plans(s)) for s in timed_sizes.values())
    total["torch compiles"] = COMPILE_SECONDS["torch_compile"] * sum(
        mode == "compiled" for s in timed_sizes.values() for mode, _ in torch_runs(s))
    return dict(model=pipe.name, blocks=cfg.num_layers, dim=cfg.dim, ffn=cfg.ffn_dim, sizes=rows,
                seconds=total, total_s=sum(total.values()), peak_flops=H100_BF16_FLOPS,
                assumed_mfu=ASSUMED_MFU, budget_s=DEVICE_MINUTES * 60)


def timed_runs(size: Size) -> list[str]:
    """Every timed run of one size, in the order a round runs them."""
    return ([f"jax {c}" for c in ["none", *size.cached]]
            + [f"torch {mode} {c}" for mode, c in torch_runs(size)] + ["diffusers none"])


def torch_runs(size: Size) -> list[tuple[str, str]]:
    """(mode, run) of our torch backend at one size: eager uncached and cached, compiled uncached."""
    return [("eager", c) for c in ["none", *size.cached]] + ([("compiled", "none")]
                                                             if size.compiled else [])


def jax_plans(size: Size) -> list[str]:
    """The runs of one size that get their own JAX backend (weights and programs). The uncached
    run shares DeepCache's, where there is one: its every step computes probe, middle and tail,
    as each computed step of a cached run does, and one program set less fits the device time."""
    return list(size.cached) if "deepcache" in size.cached else ["none", *size.cached]

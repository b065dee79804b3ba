"""Our gate inside diffusers' image-to-video pipelines (adapters/diffusers), on tiny random models
(tests/diffusers_i2v.py): WanImageToVideoPipeline in the Wan2.2 I2V-A14B layout (two experts,
one shared gate, one step count over the switch) and HunyuanVideo15ImageToVideoPipeline (the
step-distilled meanflow variant without CFG, and the 480p_i2v setting with CFG). With the gate
on, a call caches; computing every call, the staged cut gives the transformer's own latents
(the image conditioning included); `disable_cache` gives the pipeline back bit-identical; and the
pipeline decides step by step as our torch backend does given the same conditioning."""

from __future__ import annotations

import pytest
import torch

from adapters.diffusers import cache_report, disable_cache, enable_cache
from adapters.diffusers.gate import installed
from tests.diffusers_i2v import hunyuan_i2v_case, random_image, wan_a14b_case
from tests.diffusers_pipelines import settings

CASES = {"wan2.2-i2v-a14b": wan_a14b_case,
         "hunyuanvideo15-i2v-meanflow": hunyuan_i2v_case,
         "hunyuanvideo15-i2v-cfg": lambda: hunyuan_i2v_case("hunyuanvideo-tiny")}
CACHING = [["--preset", "balanced"], ["--fbcache", "--fb_thresh", "0.05"]]
EVERY_CALL = ["--teacache", "--teacache_thresh", "0.0"]  # the gate computes every call


@pytest.fixture(scope="module")
def cases():
    built = {}

    def get(name):
        if name not in built:
            built[name] = CASES[name]()
        return built[name]
    return get


def _trace(rows):
    return [(r["step"], r["expert"], r["branch"], r["action"], r["reason"]) for r in rows]


def _branches(case) -> int:
    return 1 if case.ours.guidance == 1.0 else 2  # CFG off: the guider runs "pred_cond" only


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("flags", CACHING, ids=" ".join)
@pytest.mark.parametrize("name", CASES)
def test_the_gate_caches_an_i2v_pipeline(cases, name, flags):
    case = cases(name)
    pipe = case.make()
    enable_cache(pipe, **settings(flags))
    latents = case.call(pipe)
    report = cache_report(pipe)
    assert latents.shape == case.shape and torch.isfinite(latents).all()
    assert report["steps"] == case.ours.steps  # num_inference_steps, once (not per expert)
    assert report["calls"] == _branches(case) * case.ours.steps
    assert 0 < report["reused"] < report["calls"], report["text"]
    assert report["computed"] + report["reused"] == report["calls"]
    assert "ideal speedup" in report["text"]


@pytest.mark.parametrize("flags", CACHING + [EVERY_CALL], ids=" ".join)
def test_the_a14b_experts_share_one_gate_over_the_switch(cases, flags):
    case = cases("wan2.2-i2v-a14b")
    pipe = case.make()
    enable_cache(pipe, **settings(flags))
    case.call(pipe)
    report = cache_report(pipe)
    # the steps the pipeline gives transformer (high noise): t >= boundary_ratio * 1000
    high = int((pipe.scheduler.timesteps >= 1000 * case.boundary_ratio).sum())
    assert 0 < high < case.ours.steps
    assert report["steps"] == case.ours.steps and report["expert_switches"] == 1
    rows = report["trace"]
    assert [r["expert"] for r in rows] == ["high"] * 2 * high + ["low"] * 2 * (case.ours.steps - high)
    assert [r["step"] for r in rows] == [s for s in range(case.ours.steps) for _ in range(2)]
    # the low-noise expert starts on its own computes: no residual of the other expert reused
    assert [r["action"] for r in rows[2 * high: 2 * high + 2]] == ["compute", "compute"]


@pytest.mark.parametrize("name", CASES)
def test_computing_every_call_gives_the_pipelines_own_latents(cases, name):
    """The staged cut is the transformer's own forward, the image conditioning included (the
    image latent and mask channels; HunyuanVideo-1.5's SigLIP tokens as well)."""
    case = cases(name)
    never = case.call(case.make())
    pipe = case.make()
    enable_cache(pipe, **settings(EVERY_CALL))
    gated = case.call(pipe)
    report = cache_report(pipe)
    assert report["reused"] == 0 and report["calls"] == _branches(case) * case.ours.steps
    assert _rel(gated, never) < 1e-5
    # what makes the comparison bite: the image does reach the latents
    _, height, width = case.pixels
    other = case.call(case.make(), image=random_image(width, height, seed=1))
    assert _rel(other, never) > 1e-3


@pytest.mark.parametrize("name", CASES)
def test_disable_cache_gives_the_pipeline_back_bit_identical(cases, name):
    case = cases(name)
    never = case.call(case.make())
    pipe = case.make()
    enable_cache(pipe, preset="balanced")
    cached = case.call(pipe)
    assert not torch.equal(cached, never)
    last = disable_cache(pipe)
    assert last["reused"] > 0 and cache_report(pipe) is None
    transformers = [pipe.transformer, getattr(pipe, "transformer_2", None)]
    assert all(installed(t) is None for t in transformers if t is not None)
    assert torch.equal(case.call(pipe), never)


@pytest.mark.parametrize("flags", [EVERY_CALL, *CACHING], ids=" ".join)
@pytest.mark.parametrize("name", CASES)
def test_an_i2v_pipeline_decides_as_our_backend_does(cases, name, flags):
    """Given the conditioning the pipeline made (read off its transformer's inputs), our torch
    backend takes the same decisions step by step and ends at the same latents."""
    case = cases(name)
    cond = case.conditioning()
    # the pipeline's layout is ours (trap T9): the mask marks latent frame 0 (Wan: its 4 channels
    # the 4 video frames a latent frame holds), the image latent is there
    if "condition" in cond:  # Wan: [mask 4 | image latent]
        mask, image = cond["condition"][:, :4], cond["condition"][:, 4:]
    else:  # HunyuanVideo-1.5: [image latent | mask 1]
        mask, image = cond["mask"], None
        assert cond["image_embeds"].shape == (1, case.ours.config.vision_len,
                                              case.ours.config.vision_dim)
    assert (mask[:, :, 0] == 1).all() and (mask[:, :, 1:] == 0).all()
    if image is not None:
        assert image[:, :, 0].abs().sum() > 0
    ours = case.our_run(flags)
    pipe = case.make()
    enable_cache(pipe, **settings(flags))
    theirs = case.call(pipe)
    report = cache_report(pipe)
    assert _trace(report["trace"]) == _trace(ours.gate.telemetry.trace)
    assert _rel(theirs, ours.latents) < 1e-5  # measured <= 4e-7 (diffusers' layers vs ours)
    if flags != EVERY_CALL:
        assert report["reused"] > 0

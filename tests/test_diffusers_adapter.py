"""Our gate inside diffusers pipelines (adapters/diffusers): on the same trained weights, inputs
and schedule, the pipeline with `enable_cache` takes the decisions our torch backend takes, step
by step, and ends at the same latents (fp32); Wan2.2 A14B's two experts share one gate and one
step count; HunyuanVideo-1.5, where diffusers' own hooks raise, caches; `disable_cache` leaves
the pipeline bit-identical to one that never had it; bad settings change nothing."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adapters.diffusers import CacheSettingsError, cache_report, disable_cache, enable_cache
from tests.diffusers_pipelines import hunyuan_case, random_case, settings, wan_case

ROOT = Path(__file__).resolve().parents[1]
# a threshold-driven gate (its computes land where the signal says), a preset, a schedule
SETTINGS = [["--teacache", "--teacache_thresh", "0.05"], ["--preset", "balanced"],
            ["--fbcache", "--fb_thresh", "0.02", "--forecast", "1"]]


def _trace(rows):
    return [(r["step"], r["expert"], r["branch"], r["action"], r["reason"]) for r in rows]


def _agree(case, flags, **enable):
    ours = case.our_run(flags)
    pipe = case.make()
    enable_cache(pipe, **settings(flags), **enable)
    theirs = case.call(pipe)
    report = cache_report(pipe)
    assert _trace(report["trace"]) == _trace(ours.gate.telemetry.trace)
    rel = float((theirs - ours.latents).abs().max() / ours.latents.abs().max())
    assert rel < 1e-4, rel  # measured 1e-6 (diffusers' layers and schedulers vs ours)
    return report, ours


@pytest.fixture(scope="module")
def wan():
    return wan_case()


@pytest.fixture(scope="module")
def hunyuan():
    return hunyuan_case()


@pytest.mark.parametrize("flags", SETTINGS, ids=lambda f: " ".join(f))
def test_a_wan_pipeline_decides_as_our_backend_does(wan, flags):
    report, _ = _agree(wan, flags)
    assert 0 < report["reused"] < report["calls"] == 2 * wan.ours.steps  # it does cache
    assert report["steps"] == wan.ours.steps
    assert "computed" in report["text"] and "ideal speedup" in report["text"]


@pytest.mark.parametrize("flags", SETTINGS[:2], ids=lambda f: " ".join(f))
def test_a_hunyuan_video15_pipeline_decides_as_our_backend_does(hunyuan, flags):
    report, _ = _agree(hunyuan, flags)
    assert 0 < report["reused"] < report["calls"]


@pytest.mark.parametrize("name", ["wan-tiny-ti2v", "hunyuanvideo-tiny"])
@pytest.mark.parametrize("flags", [["--preset", "balanced"], ["--fbcache", "--fb_thresh", "0.05"]],
                         ids=lambda f: " ".join(f))
def test_random_weight_pipelines_decide_as_our_backend_does(name, flags):
    report, _ = _agree(random_case(name), flags)
    assert 0 < report["reused"] < report["calls"]


def test_diffusers_own_hooks_raise_on_hunyuan_video15_and_ours_caches(hunyuan):
    from diffusers.hooks import FirstBlockCacheConfig
    pipe = hunyuan.make()
    with pytest.raises(Exception, match="HunyuanVideo15TransformerBlock|not registered|supported"):
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    fresh = hunyuan.make()
    enable_cache(fresh, fbcache=True, fb_thresh=0.05)
    hunyuan.call(fresh)
    assert cache_report(fresh)["reused"] > 0


def test_the_a14b_experts_share_one_gate_and_one_step_count():
    case = wan_case(two_experts=True)
    report, ours = _agree(case, ["--teacache", "--teacache_thresh", "0.05"])
    assert report["steps"] == case.ours.steps  # not a count per transformer (diffusers 14025)
    assert report["expert_switches"] == 1 == ours.gate.summary()["expert_switches"]
    experts = [r["expert"] for r in report["trace"] if r["branch"] == "cond"]
    assert experts[0] == "high" and experts[-1] == "low" and len(experts) == case.ours.steps


def test_disable_cache_gives_the_pipeline_back_bit_identical(wan):
    never = wan.call(wan.make())
    pipe = wan.make()
    enable_cache(pipe, preset="balanced")
    cached = wan.call(pipe)
    assert not torch.equal(cached, never)
    last = disable_cache(pipe)
    assert last["reused"] > 0 and cache_report(pipe) is None
    assert torch.equal(wan.call(pipe), never)
    enable_cache(pipe, preset="balanced")  # and on again
    assert torch.equal(wan.call(pipe), cached)


def test_a_second_run_is_a_new_run(wan):
    pipe = wan.make()
    enable_cache(pipe, teacache=True, teacache_thresh=0.05)
    first = wan.call(pipe)
    first_trace = _trace(cache_report(pipe)["trace"])
    assert torch.equal(wan.call(pipe), first)
    assert _trace(cache_report(pipe)["trace"]) == first_trace


@pytest.mark.parametrize("bad, needles", [
    ({"teacache": True, "teacache_tresh": 0.1}, ["unknown setting 'teacache_tresh'",
                                                 "did you mean 'teacache_thresh'"]),
    ({"teacache": True, "teacache_thresh": "lots"}, ["--teacache_thresh", "lots"]),
    ({"teacache_thresh": 0.1}, ["--teacache_thresh given but teacache is not enabled"]),
    ({"teacache": "yes"}, ["teacache='yes': expected True or False"]),
    ({"preset": "balanced", "budget_rel_err": 0.03,
      "budget_profile": "bench/results/pareto/trained/budget_profile_wan.json"},
     ["budgeted mode chooses the technique; drop preset"]),
    ({"budget_rel_err": 0.03,
      "budget_profile": "bench/results/pareto/trained_hunyuan/budget_profile_hunyuan.json"},
     ["was calibrated for hunyuanvideo-tiny-trained", "wan-tiny-trained"]),
    ({"budget_speedup": 2.0}, ["give budget_profile"]),
    ({"enable_cache": True, "fn_blocks": 4, "bn_blocks": 4}, ["exceed the transformer's 6 "
                                                             "blocks"]),
])
def test_bad_settings_are_one_clear_error_and_change_nothing(wan, bad, needles):
    pipe = wan.make()
    forward = pipe.transformer.forward
    before = copy.deepcopy(pipe.transformer.state_dict())
    with pytest.raises(CacheSettingsError) as exc:
        enable_cache(pipe, **bad)
    for needle in needles:
        assert needle in str(exc.value), str(exc.value)
    assert pipe.transformer.forward == forward and cache_report(pipe) is None
    assert all(torch.equal(v, before[k]) for k, v in pipe.transformer.state_dict().items())


def test_unsupported_pipelines_and_transformers_are_refused(wan):
    import types
    with pytest.raises(CacheSettingsError, match="has no transformer"):
        enable_cache(types.SimpleNamespace(unet=torch.nn.Linear(2, 2)))
    with pytest.raises(CacheSettingsError, match="transformer Linear: the gate knows "
                                                 "HunyuanVideo15Transformer3DModel, "
                                                 "WanTransformer3DModel"):
        enable_cache(types.SimpleNamespace(transformer=torch.nn.Linear(2, 2)))
    pipe = wan.make()
    enable_cache(pipe, preset="balanced")
    with pytest.raises(CacheSettingsError, match="already on this pipeline"):
        enable_cache(pipe, preset="balanced")
    disable_cache(pipe)
    pipe.transformer.compile()
    with pytest.raises(CacheSettingsError, match="compiled as a whole .* compile=True"):
        enable_cache(pipe, preset="balanced")


def test_compiled_stages_compile_in_the_first_step_and_never_again():
    """compile=True compiles probe, middle and tail (static shapes) during the first step; the
    rest of the run and a second run compile nothing (dynamo's own frame counter). In its own
    process: torch.compile breaks where torchax was imported."""
    out = subprocess.run([sys.executable, "-m", "tests.diffusers_compile_check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    seen = r["per_step"]
    assert seen[0] - r["before"] == 3 and len(set(seen)) == 1, r
    assert r["reported"] == seen[-1] == r["after_second"] and r["second_equal"], r
    assert r["eager_diff"] < 1e-4 and r["same_trace"], r


@pytest.mark.parametrize("flags, reads", [(["--teacache", "--teacache_thresh", "0.05"], 100),
                                          (["--enable_cache", "--cache_type", "deepcache"], 0)])
def test_at_most_one_device_read_a_call_and_none_for_a_schedule(wan, flags, reads):
    pipe = wan.make()
    enable_cache(pipe, **settings(flags))
    wan.call(pipe)
    assert cache_report(pipe)["signal_reads"] == reads

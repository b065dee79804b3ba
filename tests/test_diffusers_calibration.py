"""Calibration through a diffusers pipeline (adapters/diffusers/calibration.py): on the same trained
weights and draws it measures what our calibrate command measures on our torch backend (the
TeaCache fit, MagCache's ratios, budgeted mode's configurations with their errors and computed
fractions, screening), its profile drives `enable_cache`, and a profile of other weights or
another step count is refused."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from adapters.diffusers import CacheSettingsError, cache_report, enable_cache
from adapters.diffusers.calibration import calibrate
from adapters.diffusers.tiny import call_inputs
from cache import CMConfig, TeaCacheConfig
from commands.calibrate import collect, runner
from modules.checkpoint import model_fingerprint
from sampling import budget_space, calibration
from sampling.stages import SignalPlan
from tests.diffusers_pipelines import wan_case
from torch_backend.backend import TorchBackend

STEPS = 12
SPACE = (("FBCache 0.2", {"fbcache": {"threshold": 0.2, "metric": "residual_tensor_rel_l1"}}),
         ("TeaCache relative 3", {"teacache": {"threshold": 3.0, "relative": True}}))


@pytest.fixture(scope="module")
def wan():
    return wan_case()


def _draws(case, seeds):
    out = []
    for seed in seeds:
        tensors = case.ours.synthesize(case.shape, True, False, seed)
        out.append({**call_inputs(case.ours, tensors, case.shape, seed,
                                  getattr(case.ours.config, "text_len", None)),
                    "num_inference_steps": STEPS})
    return out


def _small_space(monkeypatch):
    """Two configurations and the first two static schedules of the run's own sigma grid."""
    schedules = budget_space.static_schedules
    monkeypatch.setattr(budget_space, "SPACE", SPACE)
    monkeypatch.setattr(budget_space, "static_schedules", lambda sigmas: schedules(sigmas)[:2])


def test_the_adapter_calibrates_what_our_command_measures(wan, tmp_path, monkeypatch):
    _small_space(monkeypatch)
    pipe = wan.make()
    out = tmp_path / "profile.json"
    lines = []
    report = calibrate(pipe, _draws(wan, (1, 2)), out=str(out), budget=True,
                       screen_draws=_draws(wan, (3,)), log=lines.append)
    profile = json.loads(out.read_text())
    assert report["calls"] == 2 * 2 * (STEPS - 1)  # two draws, two branches, every change
    assert "fit R^2" in report["text"] and "bound for an unseen draw" in report["text"]
    # the same draws on our torch backend, through our command's own runners
    ours = {seed: wan.ours.synthesize(wan.shape, True, False, seed) for seed in (1, 2)}
    model = wan.models[None]
    plan = SignalPlan.from_config(CMConfig(teacache=TeaCacheConfig(signal="modulated_input")))
    pairs, ratios = collect(TorchBackend({None: model}, plan), wan.ours,
                            ours, wan.shape, signal="modulated_input", steps=STEPS,
                            solver=wan.ours.solver, shift=wan.ours.shift)
    fit = calibration.fit(pairs, 4)
    # the pairs agree to float noise (1e-6); a degree-4 fit's coefficients amplify it (tens of
    # percent on the highest power), so the curves are compared where they were fitted
    rel = np.linspace(*fit["rel_range"], 50)
    assert np.polyval(profile["coefficients"], rel) == pytest.approx(
        np.polyval(fit["coefficients"], rel), rel=1e-3, abs=1e-5)
    assert profile["r2"] == pytest.approx(fit["r2"], abs=1e-4)
    assert profile["rel_range"] == pytest.approx(fit["rel_range"], rel=1e-4)
    for branch, per_step in ratios.items():
        assert profile["magcache"][branch] == pytest.approx(per_step, abs=2e-6)
    once = runner(lambda plan: TorchBackend({None: model}, plan), wan.ours, wan.shape,
                  steps=STEPS, solver=wan.ours.solver, shift=wan.ours.shift)
    space = budget_space.space(wan.ours.solver, STEPS, wan.ours.shift)
    measured = calibration.measure_space(once, ours, space=space)
    block = profile["budget"]
    assert block["model"] in ("wan-tiny-trained", "wan-tiny-ti2v")
    assert (block["steps"], block["solver"], block["shift"]) == (STEPS, "unipc", wan.ours.shift)
    assert [c["label"] for c in block["candidates"]] == [c["label"] for c in measured]
    for theirs, mine in zip(block["candidates"], measured, strict=True):
        assert theirs["computed"] == pytest.approx(mine["computed"], abs=1e-12)
        assert theirs["rel_l2"] == pytest.approx(mine["rel_l2"], rel=1e-3, abs=1e-6)
    assert any("screen" in c for c in block["candidates"])
    assert block["screen_seeds"] == [2]  # draws are numbered in the order given
    assert lines[-1] == f"wrote {out}"
    assert profile["weights_fingerprint"] == {"null": model_fingerprint(model)}


def test_the_static_schedules_of_a_diffusers_scheduler_are_our_samplers(wan):
    pipe = wan.make()
    pipe.scheduler.set_timesteps(STEPS)
    theirs = budget_space.static_schedules([float(s) for s in pipe.scheduler.sigmas])
    ours = budget_space.run_static_schedules(wan.ours.solver, STEPS, wan.ours.shift)
    assert [label for label, _ in theirs] == [label for label, _ in ours]
    assert [fields for _, fields in theirs] == [fields for _, fields in ours]


@pytest.fixture(scope="module")
def calibrated(wan, tmp_path_factory):
    """A profile the adapter calibrated (fit, ratios, budget) on two draws, the small space."""
    with pytest.MonkeyPatch.context() as mp:
        _small_space(mp)
        out = tmp_path_factory.mktemp("profile") / "profile.json"
        calibrate(wan.make(), _draws(wan, (1, 2)), out=str(out), budget=True)
    return str(out)


def test_its_profile_drives_the_gate(wan, calibrated):
    for settings in ({"teacache": True, "teacache_policy": f"poly:{calibrated}",
                      "teacache_thresh": 0.3},
                     {"magcache": True, "magcache_profile": calibrated},
                     {"budget_speedup": 1.2, "budget_profile": calibrated}):
        pipe = wan.make()
        enable_cache(pipe, **settings)
        pipe(**_draws(wan, (5,))[0])
        report = cache_report(pipe)
        assert report["reused"] > 0, settings
        if "budget_profile" in settings:
            assert report["budget"]["choice"] is not None


def test_a_profile_of_other_weights_or_steps_is_refused(wan, calibrated):
    other = wan_case(two_experts=True)  # its high expert has other trained weights
    pipe = other.make()
    with pytest.raises(CacheSettingsError, match="calibrated on other weights"):
        enable_cache(pipe, teacache=True, teacache_policy=f"poly:{calibrated}")
    assert getattr(pipe.transformer, "_diffusers_hook", None) is None \
        or pipe.transformer._diffusers_hook.get_hook("dit_cache_gate") is None
    enable_cache(pipe, teacache=True, teacache_policy=f"poly:{calibrated}", accept_profile=True)
    # the budget was measured at STEPS steps: another count is another schedule
    pipe = wan.make()
    enable_cache(pipe, budget_speedup=1.2, budget_profile=calibrated)
    draw = {**_draws(wan, (5,))[0], "num_inference_steps": STEPS + 2}
    with pytest.raises(CacheSettingsError, match=f"calibrated at {STEPS} steps"):
        pipe(**draw)


@pytest.mark.parametrize("bad, needle", [
    ({"draws": [{"prompt_embeds": torch.zeros(1)}]}, "latents= or a seeded generator="),
    ({"draws": "a prompt"}, "expected a list"),
    ({"budget": True, "draws": 1}, "expected 2 or more"),
    ({"draws": [{"output_type": "pil"}]}, "drop output_type"),
    ({"screen_draws": 2}, "expected budget=True"),
    ({"signal": "nope"}, "signal 'nope'"),
    ({"degree": -1}, "degree -1"),
    ({"out": "/nonexistent/folder/p.json"}, "out '/nonexistent/folder/p.json'"),
])
def test_bad_calibration_input_is_one_clear_error_before_any_sampling(wan, tmp_path, bad,
                                                                      needle):
    pipe = wan.make()
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    kwargs = {"draws": _draws(wan, (1,)), "out": str(tmp_path / "p.json"), **bad}
    if isinstance(kwargs["draws"], int):
        kwargs["draws"] = _draws(wan, range(kwargs["draws"]))
    if isinstance(kwargs.get("screen_draws"), int):
        kwargs["screen_draws"] = _draws(wan, range(kwargs["screen_draws"]))
    with pytest.raises(CacheSettingsError, match=re.escape(needle)):
        calibrate(pipe, **kwargs)
    assert calls == [] and list(tmp_path.iterdir()) == []


def test_a_seeded_generator_is_a_draw_sampled_alike_every_time(wan, tmp_path, monkeypatch):
    # each draw runs many times: its generator is put back before every call, so a
    # configuration that computes every call errs 0 against the draw's uncached run (from other
    # noise it would err ~1)
    monkeypatch.setattr(budget_space, "SPACE", (("TeaCache 0", {"teacache": {"threshold": 0.0}}),))
    monkeypatch.setattr(budget_space, "static_schedules", lambda sigmas: ())
    draws = _draws(wan, (1, 2))
    for seed, draw in zip((1, 2), draws, strict=True):
        del draw["latents"]  # the pipeline draws its own, from the generator
        draw["generator"] = torch.Generator().manual_seed(seed)
    out = tmp_path / "profile.json"
    calibrate(wan.make(), draws, out=str(out), budget=True)
    [candidate] = json.loads(out.read_text())["budget"]["candidates"]
    assert candidate["rel_l2"] == [0.0, 0.0] and candidate["computed"] == [1.0, 1.0]


def test_the_a14b_experts_are_fitted_apart_through_the_adapter(tmp_path):
    case = wan_case(two_experts=True)
    out = tmp_path / "profile.json"
    draws = _draws(case, (1,))
    low, high = case.ours.guidance
    draws[0].update(guidance_scale=high, guidance_scale_2=low)
    calibrate(case.make(), draws, out=str(out), degree=2)
    profile = json.loads(out.read_text())
    assert set(profile["experts"]) == {"high", "low"}
    assert profile["weights_fingerprint"] == {e: model_fingerprint(m)
                                              for e, m in case.models.items()}


def test_a_runs_file_resumes_the_budget_runs_and_refuses_other_draws(wan, tmp_path, monkeypatch):
    _small_space(monkeypatch)
    runs, out = tmp_path / "runs.jsonl", tmp_path / "profile.json"
    pipe = wan.make()
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    calibrate(pipe, _draws(wan, (1, 2)), out=str(out), budget=True, runs=str(runs))
    first, whole = len(calls), json.loads(out.read_text())["budget"]
    calls.clear()
    calibrate(pipe, _draws(wan, (1, 2)), out=str(out), budget=True, runs=str(runs))
    # again: the fit's runs only (2 draws x 2 branches x STEPS calls), no configuration run
    assert len(calls) == 2 * 2 * STEPS < first
    assert json.loads(out.read_text())["budget"] == whole
    with pytest.raises(CacheSettingsError, match="other weights or settings"):
        calibrate(pipe, _draws(wan, (1, 3)), out=str(out), budget=True, runs=str(runs))

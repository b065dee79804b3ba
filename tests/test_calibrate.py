"""Calibration: a fitted TeaCache profile is written, loaded and applied per expert."""

import json

import numpy as np
import pytest

from cache import CMConfig, ConfigError, TeaCacheConfig
from sampling import calibrate
from sampling.pipelines import get_pipeline
from sampling.run import make_sample, sample_once
from sampling.stages import SignalPlan
from tests.model_inputs import random_model
from torch_backend.backend import TorchBackend


def test_calibrated_profile_is_loaded_and_drives_the_decisions(tmp_path):
    path = tmp_path / "profile.json"
    assert calibrate.main(["--model", "wan-tiny-i2v", "--samples", "2", "--num_inference_steps",
                           "16", "--out", str(path)]) == 0
    profile = json.loads(path.read_text())
    assert set(profile["experts"]) == {"high", "low"} and len(profile["coefficients"]) == 5
    assert profile["points"] > 40

    pipe = get_pipeline("wan-tiny-i2v")
    models = {e: random_model(c, seed=i, std=0.2) for i, (e, c) in enumerate(pipe.experts)}
    shape = pipe.latent_shape(*pipe.size)
    tensors = pipe.synthesize(shape, True, True, 0)
    traces = {}
    for policy in ("linear", f"poly:{path}"):
        config = CMConfig(teacache=TeaCacheConfig(threshold=0.3, policy=policy))
        backend = TorchBackend(models, SignalPlan.from_config(config))
        sample = make_sample(backend, pipe, tensors, shape, image=True, seed=0)
        traj = sample_once(backend, config, sample, solver="unipc", steps=16, shift=5.0)
        traces[policy] = traj.gate.telemetry.trace
    rows = [r for r in traces[f"poly:{path}"] if r["rel"] is not None]
    for r in rows:  # the gate applied the fitted polynomial of the row's expert, clamped at 0
        want = np.polyval(profile["experts"][r["expert"]], r["rel"])
        assert r["rescaled"] == pytest.approx(max(want, 0.0), rel=1e-9, abs=1e-12)
        assert ("rescale_clamped" in (r["notes"] or "")) == (want < 0)
    actions = {p: [r["action"] for r in t] for p, t in traces.items()}
    assert actions["linear"] != actions[f"poly:{path}"]


def test_fit_recovers_a_known_polynomial():
    x = np.linspace(0.0, 0.2, 30)
    pairs = [("high" if i % 2 else "low", float(v), float(2.0 * v * v + 0.5 * v + 0.01))
             for i, v in enumerate(x)]
    result = calibrate.fit(pairs, degree=2)
    assert result["coefficients"] == pytest.approx([2.0, 0.5, 0.01], abs=1e-9)
    assert result["r2"] == pytest.approx(1.0) and set(result["experts"]) == {"high", "low"}
    # the rel values each fit saw: the gate counts evaluations outside them
    assert result["rel_range"] == [0.0, pytest.approx(0.2)]
    assert result["experts_rel_range"]["low"] == [0.0, pytest.approx(x[-2])]
    assert result["experts_rel_range"]["high"] == [pytest.approx(x[1]), pytest.approx(0.2)]


def test_a_bad_profile_file_is_a_config_error(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"signal": "modulated_input"}')
    with pytest.raises(ConfigError, match="expected the JSON"):
        TeaCacheConfig(policy=f"poly:{path}")
    with pytest.raises(ConfigError, match="calibrated profile file"):
        TeaCacheConfig(policy=f"poly:{tmp_path / 'missing.json'}")


@pytest.mark.parametrize("model", ["hunyuanvideo-tiny", "wan-tiny-ti2v"])
def test_budgeted_mode_meets_a_relative_error_budget_within_20_percent(tmp_path, model):
    from sampling.stage2 import build_parser, run
    path = tmp_path / "profile.json"
    assert calibrate.main(["--model", model, "--samples", "1", "--num_inference_steps", "16",
                           "--sweep", "8", "--out", str(path)]) == 0
    curve = json.loads(path.read_text())["budget_curve"]
    errors = [e for _, e, _ in curve if e > 0]
    assert errors, "the sweep never skipped"
    budget = errors[len(errors) // 2] * 1.1  # a budget between two measured points
    args = build_parser().parse_args([
        "--model", model, "--backend", "torch", "--teacache", "--teacache_policy", f"poly:{path}",
        "--budget_rel_err", str(budget), "--compare", "--seed", "0", "--num_inference_steps",
        "16", "--output_dir", str(tmp_path / "out"), "--no_progress"])
    report = run(args)
    achieved = report["compare"]["rel_l2"]
    assert 0.8 * budget <= achieved <= 1.2 * budget, (budget, achieved, curve)
    assert report["budget"]["threshold"] > 0 and report["time"]["cached_steps"] > 0


def test_budget_requests_are_checked():
    from sampling.budget import BudgetError, threshold_for
    curve = [[0.01, 0.0, 1.0], [0.1, 0.01, 0.5], [1.0, 0.05, 0.2]]
    assert threshold_for(curve, rel_err=0.02) == (0.1, 0.01, 0.5)
    assert threshold_for(curve, rel_err=0.001) == (0.01, 0.0, 1.0)
    assert threshold_for(curve, speedup=2.0) == (0.1, 0.01, 0.5)
    with pytest.raises(BudgetError, match="one target"):
        threshold_for(curve, rel_err=0.1, speedup=2.0)

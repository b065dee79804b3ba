"""Exact per-step decisions for given signal sequences (golden traces, worked out by hand)."""

import numpy as np
import pytest

from cache import (
    TEACACHE_PROFILES,
    CacheManager,
    CMConfig,
    ConfigError,
    DeepCacheConfig,
    FailSafe,
    FBCacheConfig,
    LimitsConfig,
    Signals,
    TeaCacheConfig,
)
from tests.gate_driver import run

SIGS = [1.0, 1.02, 1.05, 1.2, 1.21, 1.22, 1.5, 1.51, 1.52, 1.6]
# rel: -, .0200, .0294, .1429, .0083, .0083, .2295, .0067, .0066, .0526
# accum (thr .1): warmup | .020 S | .049 S | .192 C | .008 S | .017 S | .230 C | .007 S | .013 S | last


def gate(config, steps):
    g = CacheManager(config)
    g.attach(steps)
    return g


def test_teacache_linear_golden():
    g = gate(CMConfig(teacache=TeaCacheConfig(threshold=0.1)), 10)
    assert run(g, SIGS) == {"cond": "CSSCSSCSSC"}
    rows = [r for r in g.telemetry.trace]
    assert [r["reason"] for r in rows] == [
        "warmup", "below_threshold", "below_threshold", "above_threshold", "below_threshold",
        "below_threshold", "above_threshold", "below_threshold", "below_threshold", "last_steps"]
    assert rows[2]["accum"] == pytest.approx(0.02 / 1.0 + 0.03 / 1.02, rel=1e-6)
    assert rows[3]["rel"] == pytest.approx(0.15 / 1.05, rel=1e-6)


def test_teacache_threshold_scales_the_skips():
    assert run(gate(CMConfig(teacache=TeaCacheConfig(threshold=0.03)), 10), SIGS)["cond"] == "CSCCSSCSSC"
    # accum peaks at .452, so 0.5 skips every step between the guards
    assert run(gate(CMConfig(teacache=TeaCacheConfig(threshold=0.5)), 10), SIGS)["cond"] == "CSSSSSSSSC"


def test_teacache_poly_profile_golden():
    profile = TEACACHE_PROFILES["hunyuanvideo"]
    assert profile(0.01) == pytest.approx(np.polyval(profile.coefficients, 0.01), rel=1e-12)
    per_step = profile(0.01)  # about 0.0710: two steps stay under 0.15, the third crosses it
    assert 0.15 / 3 < per_step < 0.15 / 2
    sigs = [1.01 ** k for k in range(10)]
    g = gate(CMConfig(teacache=TeaCacheConfig(threshold=0.15, policy="poly:hunyuanvideo")), 10)
    assert run(g, sigs) == {"cond": "CSSCSSCSSC"}
    assert g.telemetry.trace[1]["rescaled"] == pytest.approx(per_step, rel=1e-6)


def test_fbcache_signature_metrics_accumulate():
    for metric in ("hidden_rel_l1", "hidden_rel_l2", "residual_rel_l1"):
        g = gate(CMConfig(fbcache=FBCacheConfig(threshold=0.1, metric=metric)), 10)
        assert run(g, SIGS) == {"cond": "CSSCSSCSSC"}, metric


def test_fbcache_residual_metrics_resume_after_block0():
    g = gate(CMConfig(fbcache=FBCacheConfig(metric="residual_rel_l1")), 3)
    g.begin_step("cond")
    assert g.decide(Signals(fbcache=1.0)).resume_from_block == 1
    g = gate(CMConfig(fbcache=FBCacheConfig(metric="hidden_rel_l1")), 3)
    g.begin_step("cond")
    assert g.decide(Signals(fbcache=1.0)).resume_from_block == 0


def test_fbcache_tensor_metric_compares_with_last_refresh_without_accumulating():
    # values are the backend's rel against the residual of the last computed step
    rels = [None, 0.01, 0.04, 0.06, 0.02, 0.049, 0.05, 0.0]
    g = gate(CMConfig(fbcache=FBCacheConfig(threshold=0.05, metric="residual_tensor_rel_l1")), 8)
    # .01+.04 would cross .05 if accumulated; the tensor metric does not accumulate
    assert run(g, [Signals(fbcache=r) for r in rels]) == {"cond": "CSSCSSCC"}


def test_fbcache_ema_smooths_rel():
    # raw rel: -, .04, .12, 0, -; ema .5 -> .04, .08, .04: accum .04 S, .12 C, .04 S
    sigs = [1.0, 1.04, 1.04 * 1.12, 1.04 * 1.12, 2.0]
    g = gate(CMConfig(fbcache=FBCacheConfig(threshold=0.1, ema=0.5)), 5)
    assert run(g, sigs) == {"cond": "CSCSC"}
    assert [round(r["rel"], 6) for r in g.telemetry.trace[1:4]] == [0.04, 0.08, 0.04]


def test_deepcache_11_45_4_over_50_computes_exactly_25_steps():
    g = gate(CMConfig(deepcache=DeepCacheConfig(start=11, end=45, interval=4)), 50)
    trace = run(g, [None] * 50, [None] * 50)
    computed = [i for i, a in enumerate(trace["cond"]) if a == "C"]
    assert computed == list(range(11)) + list(range(11, 45, 4)) + list(range(45, 50))
    assert len(computed) == 25
    assert trace["uncond"] == trace["cond"]
    assert g.plan() == [a == "C" for a in trace["cond"]]
    assert g.config.needs_signals == () and g.config.tail_blocks == 1


def test_priority_first_skip_eligible_mode_wins():
    # FBCache threshold 0 never votes skip; TeaCache does, so TeaCache decides
    cfg = CMConfig(fbcache=FBCacheConfig(threshold=0.0), teacache=TeaCacheConfig(threshold=0.1))
    g = gate(cfg, 10)
    assert run(g, SIGS) == {"cond": "CSSCSSCSSC"}
    modes = {r["mode"] for r in g.telemetry.trace if r["action"] == "skip"}
    assert modes == {"tc"}
    # when both vote skip, the first in evaluation_order is recorded
    cfg = CMConfig(fbcache=FBCacheConfig(threshold=0.1), teacache=TeaCacheConfig(threshold=0.1),
                   evaluation_order=("tc", "fb"))
    g = gate(cfg, 10)
    run(g, SIGS)
    assert {r["mode"] for r in g.telemetry.trace if r["action"] == "skip"} == {"tc"}


def test_no_technique_always_computes():
    g = gate(CMConfig(), 5)
    assert run(g, [1.0] * 5, [1.0] * 5) == {"cond": "CCCCC", "uncond": "CCCCC"}
    assert {r["reason"] for r in g.telemetry.trace} == {"no_mode"}


def test_teacache_ema_golden():
    """ema 0.5 on SIGS, threshold .1 (by hand): smoothed rel .0200, .0247, .0838 (accum .128: C),
    .0461, .0272 (accum .073), .1283 (C), .0675, .0371 (accum .105: C where plain TeaCache skips)."""
    g = gate(CMConfig(teacache=TeaCacheConfig(threshold=0.1, ema=0.5)), 10)
    assert run(g, SIGS) == {"cond": "CSSCSSCSCC"}
    assert g.telemetry.trace[2]["rel"] == pytest.approx(0.5 * 0.02 + 0.5 * 0.03 / 1.02, rel=1e-6)


STEADY = [1.03 ** i for i in range(10)]  # rel .03 every step


def test_noise_adapt_linear_golden():
    """threshold .1 x (1.5 - step / 9): the accumulated .09 at step 7 passes the tightened
    threshold .072 (plain: skips until .12 at steps 4 and 8)."""
    plain = gate(CMConfig(teacache=TeaCacheConfig(threshold=0.1)), 10)
    assert run(plain, STEADY) == {"cond": "CSSSCSSSCC"}
    adapted = gate(CMConfig(teacache=TeaCacheConfig(threshold=0.1), noise_adapt="linear"), 10)
    assert run(adapted, STEADY) == {"cond": "CSSSCSSCSC"}
    fb = gate(CMConfig(fbcache=FBCacheConfig(threshold=0.1), noise_adapt="linear"), 10)
    assert run(fb, STEADY) == {"cond": "CSSSCSSCSC"}


def test_noise_adapt_tables():
    from cache import noise_adapt
    assert noise_adapt.factor("none", 3, 10) == 1.0
    assert noise_adapt.factor("linear", 0, 10) == 1.5 and noise_adapt.factor("linear", 9, 10) == 0.5
    assert noise_adapt.factor("table:plateau", 5, 11) == pytest.approx(1.0)
    assert noise_adapt.factor("table:plateau", 10, 11) == pytest.approx(0.5)
    with pytest.raises(ConfigError, match="table:<name>"):
        CMConfig(noise_adapt="table:nope")


def test_dry_run_records_the_prospective_trace_and_always_computes():
    live = gate(CMConfig(teacache=TeaCacheConfig(threshold=0.1)), 10)
    live_trace = run(live, SIGS, SIGS)
    dry = gate(CMConfig(teacache=TeaCacheConfig(threshold=0.1), dry_run=True), 10)
    assert run(dry, SIGS, SIGS) == {"cond": "C" * 10, "uncond": "C" * 10}
    prospective = {b: "".join("S" if r["action"] == "skip" else "C"
                              for r in dry.telemetry.trace if r["branch"] == b)
                   for b in ("cond", "uncond")}
    assert prospective == live_trace == {"cond": "CSSCSSCSSC", "uncond": "CSSCSSCSSC"}
    assert dry.summary()["failsafe_count"] == 0


def test_forecasting_extrapolates_the_residual_from_the_last_computed_ones():
    """The driver's middle blocks add step + 1, so the residual grows linearly with the step:
    order 1 forecasts it exactly; plain reuse returns the last computed one."""
    import numpy as np

    from tests.gate_driver import call
    # computes at steps 0, 1, 2 and 5 (warm-up, before start, refreshes); reuses at 3 and 4
    for order, want in ((0, [1.0, 2.0, 3.0, 3.0, 3.0, 6.0]), (1, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])):
        g = gate(CMConfig(deepcache=DeepCacheConfig(start=2, end=6, interval=3), forecast=order,
                          last_steps=0), 6)
        outs = [float(call(g, "cond", Signals(), step=s, h=np.zeros(2))[1][0]) for s in range(6)]
        assert outs == want


def test_quadratic_forecast_weights():
    from cache.residuals import extrapolation_weights
    w = extrapolation_weights([1, 2, 4], 5)  # a quadratic through (1,1), (2,4), (4,16) gives 25
    assert sum(wi * v for wi, v in zip(w, [1, 4, 16], strict=True)) == pytest.approx(25.0)
    with pytest.raises(ConfigError, match="forecasting order"):
        CMConfig(forecast=3)


def test_scene_guard_forces_a_compute_when_the_latent_jumps():
    still = [Signals(teacache=1.0, latent_delta=d) for d in
             (None, 0.01, 0.01, 0.5, 0.01, 0.01, 0.01, 0.6, 0.01, 0.01)]
    g = gate(CMConfig(teacache=TeaCacheConfig(threshold=0.1), scene_guard=0.2), 10)
    assert run(g, still, still) == {"cond": "CSSCSSSCSC", "uncond": "CSSCSSSCSC"}
    reasons = [r["reason"] for r in g.telemetry.trace if r["branch"] == "cond"]
    assert reasons[3] == reasons[7] == "scene_change"
    assert run(gate(CMConfig(teacache=TeaCacheConfig(threshold=0.1)), 10), still)["cond"] == "CSSSSSSSSC"
    assert "latent_delta" in CMConfig(deepcache=DeepCacheConfig(), scene_guard=0.2).needs_signals


def test_control_guard_computes_when_the_conditioning_changes_and_restarts_alternation():
    sig = [Signals(teacache=1.0, control_delta=d) for d in
           (None, None, None, 0.3, None, None, 0.01, None, None, None)]
    g = gate(CMConfig(teacache=TeaCacheConfig(threshold=0.1), ctrl_guard=0.1), 10)
    assert run(g, sig, sig) == {"cond": "CSSCSSSSSC", "uncond": "CSSCSSSSSC"}
    reasons = [r["reason"] for r in g.telemetry.trace if r["branch"] == "cond"]
    assert reasons[3] == "control_change" and reasons.count("control_change") == 1
    assert [r["signal_control_delta"] for r in g.telemetry.trace if r["branch"] == "cond"][3] == 0.3
    # guard off: the same signals reuse through the change
    assert run(gate(CMConfig(teacache=TeaCacheConfig(threshold=0.1)), 10), sig)["cond"] == "CSSSSSSSSC"
    # alternating: eligible steps skip every other time; the change restarts the pattern, so the
    # step after it (eligible again) may skip at once
    alt = CMConfig(teacache=TeaCacheConfig(threshold=0.1), ctrl_guard=0.1,
                   limits=LimitsConfig(alternating=True))
    assert run(gate(alt, 10), sig)["cond"] == "CSCCSCSCSC"
    no_change = [Signals(teacache=1.0)] * 10
    assert run(gate(alt, 10), no_change)["cond"] == "CSCSCSCSCC"


def test_bn_ids_keep_one_residual_per_reused_tail_run_and_hand_them_back_on_reuse():
    config = CMConfig(deepcache=DeepCacheConfig(start=0, end=10, interval=2),
                      bn_blocks=5, bn_ids=(3, 1))
    assert config.bn_ids == (1, 3) and config.tail_runs == ((0, 1), (2, 3), (4, 5))
    g = gate(config, 5)
    h = np.zeros(3, np.float32)
    tails = []
    for step in range(5):
        g.begin_step("cond")
        applied = g.apply(g.decide(Signals()), h)
        if applied.decision.skip:
            tails.append(applied.tail)
            continue
        g.update(applied.decision, h, h + step, tail=tuple(h + 10 * step + k for k in range(3)))
    assert [r["action"] for r in g.telemetry.trace] == ["compute", "skip", "compute", "skip", "compute"]
    assert [[float(t[0]) for t in tail] for tail in tails] == [[0, 1, 2], [20, 21, 22]]
    # a compute that hands back the wrong number of tail residuals cannot be reused from
    g2 = gate(config, 3)
    g2.begin_step("cond")
    d = g2.decide(Signals())
    g2.update(d, h, h + 1, tail=(h,))
    g2.begin_step("cond")
    applied = g2.apply(g2.decide(Signals()), h)
    assert not applied.decision.skip and applied.decision.failsafe == FailSafe.MISSING_RESIDUAL


@pytest.mark.parametrize("kwargs, message", [
    (dict(bn_ids=(0,)), "there are none"),
    (dict(bn_blocks=2, bn_ids=(2,)), r"\[0, 2\)"),
    (dict(bn_blocks=3, bn_ids=(1, 1)), "distinct"),
    (dict(bn_blocks=3, bn_ids="1"), "sequence"),
    (dict(ctrl_guard=-1.0), "ctrl_guard"),
    (dict(fbcache=dict(saliency=0.5)), "tensor metric"),
])
def test_bn_ids_ctrl_guard_and_saliency_are_validated(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        if "fbcache" in kwargs:
            kwargs = {"fbcache": FBCacheConfig(**kwargs["fbcache"])}
        CMConfig(**kwargs)


# A calibrated profile p(rel) = 2 rel - 0.01, fitted on rel in [0.01, 0.2]: below 0.005 its value
# is negative. Signatures: five tiny changes (rel 0.001: p = -0.008), four of 3.5 % (p = 0.06),
# one of 30 % (above the range: p = 0.59), one more of 3.5 %.
OUT_OF_RANGE_SIGS = [1.001 ** k for k in range(6)]
for _factor in (1.035, 1.035, 1.035, 1.035, 1.3, 1.035):
    OUT_OF_RANGE_SIGS.append(OUT_OF_RANGE_SIGS[-1] * _factor)


def fitted_profile(tmp_path, with_range=True):
    import json
    profile = {"signal": "modulated_input", "coefficients": [2.0, -0.01]}
    if with_range:
        profile["rel_range"] = [0.01, 0.2]
    path = tmp_path / ("profile.json" if with_range else "old_profile.json")
    path.write_text(json.dumps(profile))
    return f"poly:{path}"


def test_teacache_rescale_is_clamped_at_zero_below_the_fitted_range(tmp_path):
    """Unclamped, steps 1-5 would leave the accumulator at -0.04 and the next computes would
    come a step late (CSSSSSSSCSCC); a long run of tiny changes would reuse to the last step."""
    g = gate(CMConfig(teacache=TeaCacheConfig(threshold=0.1, policy=fitted_profile(tmp_path))), 12)
    assert run(g, OUT_OF_RANGE_SIGS) == {"cond": "CSSSSSSCSCCC"}
    rows = g.telemetry.trace
    expected_accum = [None, 0, 0, 0, 0, 0, 0.06, 0.12, 0.06, 0.12, 0.59, 0.06]
    assert [r["accum"] for r in rows] == [None if a is None else pytest.approx(a, abs=1e-6)
                                         for a in expected_accum]
    assert [r["rescaled"] for r in rows[1:6]] == [0.0] * 5
    below = "profile_below_range+rescale_clamped"
    assert [r["notes"] for r in rows] == [None, *[below] * 5, None, None, None, None,
                                         "profile_above_range", None]
    summary = g.summary()
    assert summary["notes"] == {"profile_below_range": 5, "profile_above_range": 1,
                                "rescale_clamped": 5}
    assert summary["branches"]["cond"]["notes"] == summary["notes"]


def test_the_summary_warns_once_when_a_profile_ran_outside_its_fitted_range(tmp_path):
    from commands.stage2_report import profile_warnings
    config = CMConfig(teacache=TeaCacheConfig(threshold=0.1, policy=fitted_profile(tmp_path)))
    g = gate(config, 12)
    run(g, OUT_OF_RANGE_SIGS)
    warnings = profile_warnings(config, g.summary(), g.telemetry.trace)
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "outside the rel range it was fitted on [0.01, 0.2] on 6 of 11 measured calls " \
           "(5 below, 1 above)" in warnings[0]
    assert "5 rescaled changes came out negative and counted as 0" in warnings[0]
    g = gate(config, 12)
    run(g, [1.05 ** k for k in range(12)])  # rel 0.05 throughout: inside the range
    assert profile_warnings(config, g.summary(), g.telemetry.trace) == []


def test_a_profile_without_a_fitted_range_still_loads_and_is_still_clamped(tmp_path):
    config = CMConfig(teacache=TeaCacheConfig(threshold=0.1,
                                              policy=fitted_profile(tmp_path, with_range=False)))
    assert config.teacache.profile.rel_range is None
    g = gate(config, 12)
    assert run(g, OUT_OF_RANGE_SIGS) == {"cond": "CSSSSSSCSCCC"}
    assert g.summary()["notes"] == {"profile_below_range": 0, "profile_above_range": 0,
                                    "rescale_clamped": 5}


def test_teacache_relative_threshold_counts_multiples_of_the_mean_change():
    """rel 0.02 every step: the mean is 0.02, so threshold 1.5 means 0.03 (worked by hand):
    warmup | .02 S | .04 C | .02 S | .04 C | .02 S | .04 C | .02 S | .04 C | last."""
    config = CMConfig(teacache=TeaCacheConfig(threshold=1.5, relative=True))
    g = gate(config, 10)
    assert run(g, [1.02 ** k for k in range(10)]) == {"cond": "CSCSCSCSCC"}
    assert [r["threshold"] for r in g.telemetry.trace[1:]] == [pytest.approx(0.03)] * 9
    # a varying rel: .01, .01, .04, .01 -> means .01, .01, .02, .0175 -> thresholds x1.5
    sigs = [1.0, 1.01, 1.01 * 1.01, 1.01 * 1.01 * 1.04, 1.01 * 1.01 * 1.04 * 1.01, 1.0]
    g = gate(config, 6)
    run(g, sigs)
    rows = g.telemetry.trace
    assert [r["threshold"] for r in rows[1:5]] == [pytest.approx(v) for v in
                                                   (0.015, 0.015, 0.03, 0.02625)]
    assert [r["action"] for r in rows[1:5]] == ["skip", "compute", "compute", "skip"]


def test_teacache_relative_threshold_takes_the_same_decisions_on_a_100x_quieter_signal():
    rels = [0.02, 0.01, 0.03, 0.005, 0.02, 0.04, 0.01, 0.01, 0.02, 0.03, 0.01]

    def signatures(scale):
        sigs = [1.0]
        for r in rels:
            sigs.append(sigs[-1] * (1 + r * scale))
        return sigs

    def actions(config, scale):
        return run(gate(config, len(rels) + 1), signatures(scale))["cond"]

    relative = CMConfig(teacache=TeaCacheConfig(threshold=2.0, relative=True))
    assert actions(relative, 1.0) == actions(relative, 0.01)
    assert "S" in actions(relative, 1.0) and actions(relative, 1.0).count("C") > 2
    absolute = CMConfig(teacache=TeaCacheConfig(threshold=0.05))
    assert actions(absolute, 0.01) == "C" + "S" * (len(rels) - 1) + "C"  # 0.05 is never reached
    assert actions(absolute, 1.0) != actions(absolute, 0.01)


def test_a_signal_that_never_moves_computes_in_relative_mode():
    g = gate(CMConfig(teacache=TeaCacheConfig(threshold=3.0, relative=True)), 6)
    assert run(g, [1.0] * 6) == {"cond": "CCCCCC"}

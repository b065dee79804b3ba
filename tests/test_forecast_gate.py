"""Forecast-aware reuse (issue 17): the probe's reference is block 0's residual forecast to the
call's step, the order is capped by the history and the gap, and the tensor metric may be summed
over a reuse run. Golden traces worked out by hand."""

import numpy as np
import pytest

from cache import CacheManager, CMConfig, ConfigError, FBCacheConfig, Signals
from cache.residuals import NumpyOps, Slot, forecast_order
from tests.gate_driver import middle_blocks, run


def tensor_fb(threshold, **kw):
    return FBCacheConfig(threshold=threshold, metric="residual_tensor_rel_l1", **kw)


def test_forecast_order_is_capped_by_the_history_and_by_the_reach():
    assert forecast_order([3], 5, 2) == 0  # one stored residual: plain reuse
    assert forecast_order([0, 3], 5, 2) == 1
    assert forecast_order([0, 3, 6], 20, 2) == 2  # no reach: the highest order the history allows
    assert forecast_order([0, 3, 6], 9, 2, reach=1.0) == 2  # gap 3 <= 1.0 x spacing 3
    assert forecast_order([0, 3, 6], 10, 2, reach=1.0) == 1  # gap 4 > 3: linear
    assert forecast_order([0, 3, 6], 10, 1, reach=0.1) == 1  # the reach only limits order 2


def test_fetch_forecasts_linearly_beyond_the_reach():
    ops, slot = NumpyOps(), Slot()
    for s in (0, 4, 5):  # a residual quadratic in the step: s^2
        slot.store(ops, np.full(2, float(s * s)), s, keep=2)
    x = np.zeros(2)
    assert slot.fetch(ops, x, 7, 2)[0][0] == pytest.approx(49.0)  # exact quadratic
    # gap 2 > 1.0 x spacing 1: the line through (4, 16) and (5, 25) gives 43
    assert slot.fetch(ops, x, 7, 2, reach=1.0)[0][0] == pytest.approx(43.0)
    assert slot.reference(ops, 7, 2, reach=1.0)[0] == pytest.approx(43.0)


def drive(gate, steps, first_block):
    """Play the backend with the tensor metric: block 0 adds first_block(step), the probe
    compares it with gate.probe_reference as mean |r1 - ref| / mean |ref|; the middle blocks
    add step + 1. Returns the cond actions and outputs."""
    actions, outs = [], []
    for step in range(steps):
        gate.begin_step("cond")
        ref = gate.probe_reference("cond")
        r1 = np.full(4, first_block(step))
        rel = None if ref is None else float(np.abs(r1 - ref).mean() / np.abs(ref).mean())
        decision = gate.decide(Signals(fbcache=rel))
        h = np.zeros(4)
        out, _, decision, _ = gate.apply(decision, h)
        if not decision.skip:
            out = middle_blocks(h, step)
            gate.update(decision, h, out, probe=r1)
        actions.append("S" if decision.skip else "C")
        outs.append(float(out[0]))
    return "".join(actions), outs


def gate_for(config, steps):
    g = CacheManager(config)
    g.attach(steps)
    return g


def test_forecast_gate_measures_the_forecast_error_not_the_raw_change():
    """Block 0's residual 1 + 0.1 s moves in a straight line. Measured against the last computed
    one (no forecast_gate) the change grows with the gap: 0.1, 0.2 (compute), 0.083, 0.167
    (compute), 0.071, 0.143, 0.214 (compute), 0.059, last step. With forecast_gate the first run
    has one stored residual (order 0: the same 0.1, 0.2), then the line through steps 0 and 2
    forecasts block 0 exactly: error 0, so every step reuses up to the last, and the middle's
    residual (step + 1, also a line) is forecast exactly."""
    line = lambda s: 1.0 + 0.1 * s  # noqa: E731
    plain = gate_for(CMConfig(fbcache=tensor_fb(0.15), forecast=1), 10)
    assert drive(plain, 10, line)[0] == "CSCSCSSCSC"
    gated = gate_for(CMConfig(fbcache=tensor_fb(0.15), forecast=1, forecast_gate=True), 10)
    actions, outs = drive(gated, 10, line)
    assert actions == "CSCSSSSSSC"
    assert outs == [1.0, 1.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]  # step 1: plain reuse
    rels = [r["rel"] for r in gated.telemetry.trace]
    assert rels[1:3] == pytest.approx([0.1, 0.2]) and rels[3:9] == pytest.approx([0.0] * 6, abs=1e-12)


def test_forecast_gate_reference_outside_a_call_is_the_stored_residual():
    g = gate_for(CMConfig(fbcache=tensor_fb(0.15), forecast=1, forecast_gate=True), 10)
    drive(g, 4, lambda s: 1.0 + 0.1 * s)
    assert g.probe_reference("cond")[0] == pytest.approx(1.2)  # stored at step 2, no forecast
    assert g.probe_reference("uncond") is None


def test_accumulated_tensor_metric_sums_over_the_reuse_run():
    # the same values as the plain tensor-metric golden trace: there .01 S .04 S .06 C .02 S .049 S
    # .05 C; summed, .01 + .04 reaches .05 (compute), .06 C, .02 S, .02 + .049 C, .05 C, last
    rels = [None, 0.01, 0.04, 0.06, 0.02, 0.049, 0.05, 0.0]
    g = gate_for(CMConfig(fbcache=tensor_fb(0.05, accumulate=True)), 8)
    assert run(g, [Signals(fbcache=r) for r in rels]) == {"cond": "CSCCSCCC"}
    assert [round(r["accum"], 6) for r in g.telemetry.trace[1:7]] == [0.01, 0.05, 0.06, 0.02, 0.069, 0.05]


def test_forecast_gate_config_is_checked():
    with pytest.raises(ConfigError, match="forecast >= 1"):
        CMConfig(fbcache=tensor_fb(0.1), forecast_gate=True)
    with pytest.raises(ConfigError, match="residual_tensor_rel_l1"):
        CMConfig(fbcache=FBCacheConfig(threshold=0.1), forecast=2, forecast_gate=True)
    with pytest.raises(ConfigError, match="forecast_reach"):
        CMConfig(fbcache=tensor_fb(0.1), forecast=2, forecast_reach=-1.0)
    with pytest.raises(ConfigError, match="accumulate"):
        tensor_fb(0.1, accumulate="yes")


def test_flags_map_onto_the_forecast_gate():
    from cache.flags import config_of
    from sampling.cache_cli import cache_flags
    from commands.stage2 import build_parser

    def parse(*args):
        return config_of(cache_flags(build_parser().parse_args(list(args))))

    cfg = parse("--fbcache", "--fb_metric", "residual_tensor_rel_l1", "--fb_accumulate", "true",
                "--forecast", "2", "--forecast_gate", "true", "--forecast_reach", "1.5")
    assert cfg.forecast_gate and cfg.forecast_reach == 1.5 and cfg.fbcache.accumulate
    with pytest.raises(ConfigError, match="--forecast_gate"):
        parse("--fbcache", "--forecast_gate", "true")
    with pytest.raises(ConfigError, match="--forecast_reach"):
        parse("--fbcache", "--forecast_reach", "-2")


# --- step-size weighting (CMConfig.step_weight) -----------------------------------------------

# 6 steps whose sizes are .05 .05 .1 .1 .2 .5 (mean 1/6): weights .3 .3 .6 .6 1.2 3.0 at p = 1
SIGMAS = [1.0, 0.95, 0.9, 0.8, 0.7, 0.5, 0.0]
FLAT = [None] + [0.1] * 5  # the tensor metric's value of each step (none at step 0)


def weighted_gate(step_weight, sigmas=SIGMAS, steps=6):
    g = CacheManager(CMConfig(fbcache=tensor_fb(0.2, accumulate=True), last_steps=0,
                              step_weight=step_weight))
    g.attach(steps)
    if sigmas is not None:
        g.set_schedule(sigmas)
    return g


def test_step_weight_scales_each_steps_metric_by_its_step_size():
    """Unweighted, .1 a step reaches .2 every second step: C S C S C S. Weighted by the step
    size over the mean, steps 1-3 add .03 .06 .06 (reuse, the sum .15), step 4 adds .12 (.27:
    compute) and step 5's .3 alone passes .2: C S S S C C."""
    plain = weighted_gate(0.0)
    assert run(plain, [Signals(fbcache=r) for r in FLAT]) == {"cond": "CSCSCS"}
    g = weighted_gate(1.0)
    assert run(g, [Signals(fbcache=r) for r in FLAT]) == {"cond": "CSSSCC"}
    rows = g.telemetry.trace
    assert [r["rel"] for r in rows[1:]] == pytest.approx([0.1] * 5)  # the raw value is kept
    assert [r["rescaled"] for r in rows[1:]] == pytest.approx([0.03, 0.06, 0.06, 0.12, 0.3])
    assert [r["accum"] for r in rows[1:]] == pytest.approx([0.03, 0.09, 0.15, 0.27, 0.3])
    assert [r["reason"] for r in rows[4:]] == ["above_threshold"] * 2


def test_step_weight_exponent_and_its_absence():
    """p = 0.5 weighs by the square root: .055 .077 .077 .110 .173 (steps 1-5) sum to .209 at
    step 3 (compute), then .110 S, .283 C. Without a schedule, or with one of another length,
    every weight is 1 and the trace is the unweighted one; step_weight 0 ignores a schedule."""
    g = weighted_gate(0.5)
    assert run(g, [Signals(fbcache=r) for r in FLAT]) == {"cond": "CSSCSC"}
    assert [r["rescaled"] for r in g.telemetry.trace[1:]] == pytest.approx(
        [0.1 * w ** 0.5 for w in (0.3, 0.6, 0.6, 1.2, 3.0)])
    for gate in (weighted_gate(1.0, sigmas=None), weighted_gate(1.0, sigmas=SIGMAS[:-1]),
                 weighted_gate(0.0)):
        assert run(gate, [Signals(fbcache=r) for r in FLAT]) == {"cond": "CSCSCS"}
        assert [r["rescaled"] for r in gate.telemetry.trace[1:]] == [0.1] * 5


def test_step_weight_config_and_flag_are_checked():
    from cache.flags import config_of
    from sampling.cache_cli import cache_flags
    from commands.stage2 import build_parser

    for bad in (-1.0, float("nan"), True):
        with pytest.raises(ConfigError, match="step_weight"):
            CMConfig(fbcache=tensor_fb(0.1), step_weight=bad)
    with pytest.raises(ConfigError, match="needs FBCache"):
        CMConfig(step_weight=1.0)
    assert CMConfig().step_weight == 0.0  # off by default

    def parse(*args):
        return config_of(cache_flags(build_parser().parse_args(list(args))))

    assert parse("--fbcache", "--step_weight", "1").step_weight == 1.0
    with pytest.raises(ConfigError, match="--step_weight"):
        parse("--fbcache", "--step_weight", "-1")


def test_sampling_loop_hands_the_schedule_to_the_gate():
    """On the torch backend the trace's weighted metric over the raw one is each step's size
    over the mean of the scheduler's sigmas."""
    from sampling.pipelines import get_pipeline
    from sampling.run import make_sample, sample_once
    from sampling.schedulers import make_scheduler
    from sampling.stages import SignalPlan
    from tests.model_inputs import random_model
    from torch_backend.backend import TorchBackend

    pipe = get_pipeline("wan-tiny-ti2v")
    shape = pipe.latent_shape(*pipe.size)
    tensors = pipe.synthesize(shape, True, False, 0)
    config = CMConfig(fbcache=tensor_fb(0.3, accumulate=True), forecast=2, forecast_gate=True,
                      step_weight=1.0)
    models = {e: random_model(c, seed=i, std=0.2) for i, (e, c) in enumerate(pipe.experts)}
    backend = TorchBackend(models, SignalPlan.from_config(config))
    sample = make_sample(backend, pipe, tensors, shape, image=False, seed=0)
    traj = sample_once(backend, config, sample, solver="unipc", steps=10, shift=5.0)
    sig = [float(s) for s in make_scheduler("unipc", 10, 5.0).sigmas]
    size = [a - b for a, b in zip(sig, sig[1:])]
    want = {i: d * len(size) / sum(size) for i, d in enumerate(size)}
    rows = [r for r in traj.gate.telemetry.trace if r["branch"] == "cond" and r["rel"]]
    assert len(rows) >= 5
    assert [r["rescaled"] / r["rel"] for r in rows] == pytest.approx([want[r["step"]] for r in rows])
    assert want[9] > 3 * want[1]  # shift 5: the late steps are the large ones

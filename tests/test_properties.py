"""Properties of the gate over generated signal sequences (hypothesis)."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from cache import TEACACHE_PROFILES, CacheManager, CMConfig, FBCacheConfig, Signals, TeaCacheConfig
from tests.gate_driver import run

signatures = st.lists(st.floats(min_value=0.01, max_value=100.0), min_size=2, max_size=40)
fb_metrics = st.sampled_from(["hidden_rel_l1", "hidden_rel_l2", "residual_rel_l1"])
policies = st.sampled_from(["linear"] + [f"poly:{name}" for name in TEACACHE_PROFILES])


def technique(kind, threshold, policy="linear", metric="hidden_rel_l1"):
    if kind == "tc":
        return {"teacache": TeaCacheConfig(threshold=threshold, policy=policy)}
    return {"fbcache": FBCacheConfig(threshold=threshold, metric=metric)}


def skips(sigs, **kw):
    g = CacheManager(CMConfig(**kw))
    g.attach(len(sigs))
    return run(g, sigs)["cond"].count("S")


@settings(max_examples=150, deadline=None)
@given(signatures, st.sampled_from(["tc", "fb"]), policies, fb_metrics)
def test_threshold_zero_never_skips(sigs, kind, policy, metric):
    # polynomial profiles can go negative, so this needs the explicit "<= 0 never skips" rule
    assert skips(sigs, **technique(kind, 0.0, policy, metric), warmup=0, last_steps=0) == 0


@settings(max_examples=150, deadline=None)
@given(signatures, st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.sampled_from(["tc", "fb"]),
       fb_metrics, st.integers(0, 3), st.integers(0, 3))
def test_raising_the_threshold_never_reduces_skips(sigs, a, b, kind, metric, warmup, last):
    # holds for nonnegative rescaled changes (linear policy), the greedy-refresh argument
    low, high = sorted((a, b))
    kw = dict(warmup=warmup, last_steps=last)
    assert (skips(sigs, **technique(kind, low, metric=metric), **kw)
            <= skips(sigs, **technique(kind, high, metric=metric), **kw))


@settings(max_examples=150, deadline=None)
@given(signatures, st.integers(0, 5), st.integers(0, 5), st.floats(0.0, 10.0), policies)
def test_warmup_and_last_steps_always_compute(sigs, warmup, last, threshold, policy):
    g = CacheManager(CMConfig(teacache=TeaCacheConfig(threshold=threshold, policy=policy),
                              warmup=warmup, last_steps=last))
    g.attach(len(sigs))
    actions = run(g, sigs, sigs)
    n = len(sigs)
    for i in [*range(min(warmup, n)), *range(max(0, n - last), n)]:
        assert actions["cond"][i] == "C" and actions["uncond"][i] == "C"


@settings(max_examples=150, deadline=None)
@given(signatures, st.data(), st.sampled_from(["tc", "fb"]), st.booleans())
def test_uncond_follows_cond_under_the_default_pair_policy(sigs, data, kind, sep_diff):
    uncond = data.draw(st.lists(st.floats(0.01, 100.0), min_size=len(sigs), max_size=len(sigs)))
    g = CacheManager(CMConfig(**technique(kind, 0.2), cfg_sep_diff=sep_diff))
    g.attach(len(sigs))
    actions = run(g, sigs, uncond)
    assert actions["uncond"] == actions["cond"]


@settings(max_examples=150, deadline=None)
@given(signatures, st.data(), st.sampled_from(["tc", "fb"]))
def test_nan_or_inf_signals_compute_and_count_invalid_metric(sigs, data, kind):
    bad = data.draw(st.sets(st.integers(0, len(sigs) - 1)))
    values = [data.draw(st.sampled_from([math.nan, math.inf, -math.inf])) if i in bad else s
              for i, s in enumerate(sigs)]
    g = CacheManager(CMConfig(**technique(kind, 0.5)))
    g.attach(len(sigs))
    actions = run(g, [Signals(teacache=v, fbcache=v) for v in values])["cond"]
    assert all(actions[i] == "C" for i in bad)
    assert g.summary()["failsafes"]["invalid_metric"] == len(bad)

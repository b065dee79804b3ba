"""MagCache in our gate (issue 28): golden traces worked out by hand, the flags and the profile the
calibrate command writes, and diffusers' MagCache hook as the oracle of the decisions."""

import argparse
import json

import pytest

from cache import CacheManager, CMConfig, ConfigError, MagCacheConfig
from cache.flags import config_of
from sampling.cache_cli import add_cache_arguments, cache_flags
from tests.gate_driver import run

# ratio per step; retention 0.2 of 10 steps keeps steps 0-1. By hand (threshold 0.06, K 2):
# 2: acc .99, err .0100 S | 3: acc .9702, err .0398 S | 4: acc .9411, err .0987 C (reset)
# 5: acc 1.05, err .05 S | 6: acc 1.05, err .10 C | 7: acc 1, err 0 S | 8: acc .9, err .1 C | 9: S
RATIOS = (1.0, 1.0, 0.99, 0.98, 0.97, 1.05, 1.0, 1.0, 0.9, 1.0)


def gate(config, steps=10):
    g = CacheManager(config)
    g.attach(steps)
    return g


def mag(**fields):
    return CMConfig(magcache=MagCacheConfig(**{"ratios": RATIOS, "max_skip": 2, **fields}),
                    warmup=0, last_steps=0)


def test_golden_trace():
    g = gate(mag())
    assert run(g, [None] * 10) == {"cond": "CCSSCSCSCS"}
    rows = g.telemetry.trace
    assert [r["reason"] for r in rows[:5]] == ["warmup", "warmup", "below_threshold",
                                               "below_threshold", "above_threshold"]
    assert rows[3]["accum"] == pytest.approx(0.01 + (1 - 0.99 * 0.98))
    assert rows[4]["rel"] == 0.97  # the trace shows the step's ratio


def test_max_skip_caps_a_reuse_run_and_the_threshold_scales_it():
    flat = (1.0,) * 10  # no drift at all: only K stops a run
    assert run(gate(mag(ratios=flat)), [None] * 10) == {"cond": "CCSSCSSCSS"}
    assert run(gate(mag(ratios=flat, max_skip=1)), [None] * 10) == {"cond": "CCSCSCSCSC"}
    assert run(gate(mag(threshold=0.2)), [None] * 10)["cond"] == "CCSSCSSCSS"
    assert run(gate(mag(threshold=0.0)), [None] * 10)["cond"] == "C" * 10
    assert run(gate(mag(retention=0.5)), [None] * 10)["cond"] == "CCCCCSCSCS"


def test_uncond_reads_its_own_ratios_and_another_step_count_the_nearest():
    config = MagCacheConfig(ratios=RATIOS, uncond_ratios=(1.0,) * 10)
    assert config.ratio_at("uncond", 4, 10) == 1.0 and config.ratio_at("cond", 4, 10) == 0.97
    # 19 steps over 10 calibrated ones: step k reads round(k * 9 / 18) = round(k / 2)
    assert [config.ratio_at("cond", k, 19) for k in (0, 1, 7, 8, 18)] == [
        RATIOS[0], RATIOS[0], RATIOS[4], RATIOS[4], RATIOS[9]]
    g = gate(CMConfig(magcache=config, warmup=0, last_steps=0, cfg_mode="separate"))
    # default K 3: cond as the golden trace (K never binds there), uncond flat: runs of 3
    assert run(g, [None] * 10, [None] * 10) == {"cond": "CCSSCSCSCS", "uncond": "CCSSSCSSSC"}


def test_no_signal_no_probe():
    config = mag()
    assert config.needs_signals == () and config.probe_blocks == 0 and config.modes == ("mc",)


def parse(argv):
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    return config_of(cache_flags(parser.parse_args(argv)))


def test_flags_read_the_profile_and_refuse_what_is_missing(tmp_path):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"magcache": {"cond": list(RATIOS), "uncond": [1.0] * 10}}))
    config = parse(["--enable_cache", "--cache_type", "magcache", "--magcache_profile",
                    str(profile), "--mag_thresh", "0.1", "--mag_max_skip", "4"])
    m = config.magcache
    assert (m.ratios, m.uncond_ratios, m.threshold, m.max_skip) == (RATIOS, (1.0,) * 10, 0.1, 4)
    assert m.profile == str(profile)
    for argv, needle in (
            (["--magcache"], "--magcache_profile"),
            (["--magcache", "--magcache_profile", str(tmp_path / "none.json")], "does not exist"),
            (["--mag_thresh", "0.1"], "magcache is not enabled"),
            (["--magcache", "--magcache_profile", str(profile), "--mag_retention", "2"],
             "fraction of the steps")):
        with pytest.raises(ConfigError, match=needle):
            parse(argv)
    profile.write_text(json.dumps({"magcache": {"cond": [1.0, -0.5]}}))
    with pytest.raises(ConfigError, match="positive finite"):
        parse(["--magcache", "--magcache_profile", str(profile)])


def test_decisions_match_diffusers_magcache_hook():
    """The same ratios, threshold, K and retention in diffusers' MagCacheConfig on the same tiny
    Wan model: the same calls skip (each CFG branch with its own state, as diffusers' cache
    contexts keep it; no forced first or last compute, as diffusers has none). Ratios and the
    retention are picked so that no sum lands on the threshold: diffusers tests `<=` and rounds
    the retention step, the official code (and ours) `<` and truncates."""
    pytest.importorskip("diffusers")
    import dataclasses

    from diffusers.hooks import MagCacheConfig as TheirConfig

    from bench.pareto import peers
    from bench.pareto import workload as pw

    family = dataclasses.replace(pw.families(3, 3)["wan"], size=(64, 64, 5))
    wl = pw.build_workload(family, steps=10)
    ours = pw.run_ours(wl, CMConfig(
        magcache=MagCacheConfig(ratios=RATIOS, max_skip=2, threshold=0.06, retention=0.2),
        warmup=0, last_steps=0, cfg_mode="separate"), pw.our_counter(wl))
    theirs = peers.run_diffusers(wl, peers.diffusers_hook(lambda: TheirConfig(
        threshold=0.06, max_skip_steps=2, retention_ratio=0.2, num_inference_steps=10,
        mag_ratios=list(RATIOS))))
    assert ours.per_call == theirs.per_call
    assert ours.per_call[4:6] == [0.0, 0.0]  # step 2 reuses in both branches

"""Validation: invalid configuration raises ConfigError naming the field and what it expects."""

import dataclasses

import pytest

from cache import CMConfig, ConfigError, DeepCacheConfig, FBCacheConfig, LimitsConfig, TeaCacheConfig


@pytest.mark.parametrize("build, words", [
    (lambda: TeaCacheConfig(threshold=-0.1), ["TeaCacheConfig.threshold", ">= 0"]),
    (lambda: TeaCacheConfig(threshold=float("nan")), ["TeaCacheConfig.threshold", "finite"]),
    (lambda: TeaCacheConfig(policy="cubic"), ["policy", "poly:<profile>"]),
    (lambda: TeaCacheConfig(policy="poly:wan2.1-t2v-14b-e", signal="modulated_input"),
     ["fitted on the time_embedding signal"]),
    (lambda: FBCacheConfig(metric="l3"), ["FBCacheConfig.metric", "hidden_rel_l1"]),
    (lambda: FBCacheConfig(downsample=0), ["FBCacheConfig.downsample", ">= 1"]),
    (lambda: FBCacheConfig(ema=1.0), ["FBCacheConfig.ema", "< 1.0"]),
    (lambda: DeepCacheConfig(start=20, end=10), ["end (10) must be >= start (20)"]),
    (lambda: DeepCacheConfig(interval=0), ["DeepCacheConfig.interval", ">= 1"]),
    (lambda: DeepCacheConfig(steps=(0, 2, 2)), ["DeepCacheConfig.steps", "distinct"]),
    (lambda: DeepCacheConfig(steps="0,2"), ["DeepCacheConfig.steps", "must list"]),
    (lambda: LimitsConfig(max_cached=-1), ["LimitsConfig.max_cached"]),
    (lambda: CMConfig(warmup=1.5), ["CMConfig.warmup", "integer"]),
    (lambda: CMConfig(cfg_mode="parallel"), ["CMConfig.cfg_mode", "cond_authoritative"]),
    (lambda: CMConfig(offload="disk"), ["CMConfig.offload", "'auto'"]),
    (lambda: CMConfig(evaluation_order=("tc", "tc")), ["distinct modes"]),
    (lambda: CMConfig(teacache=TeaCacheConfig(), evaluation_order=("fb",)), ["leaves out", "tc"]),
    (lambda: CMConfig(fbcache=FBCacheConfig(metric="residual_rel_l1"), fn_blocks=0), ["fn_blocks >= 1"]),
    (lambda: CMConfig(teacache={"threshold": 0.1}), ["CMConfig.teacache must be a TeaCacheConfig"]),
    (lambda: CMConfig(cfg_sep_diff="yes"), ["CMConfig.cfg_sep_diff", "True or False"]),
])
def test_invalid_values_name_the_field(build, words):
    with pytest.raises(ConfigError) as err:
        build()
    for word in words:
        assert word in str(err.value)


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CMConfig().warmup = 3


def test_derived_structure():
    assert CMConfig().probe_blocks == 0 and CMConfig().tail_blocks == 0 and not CMConfig().enabled
    fb = CMConfig(fbcache=FBCacheConfig(metric="residual_tensor_rel_l1"))
    assert fb.probe_blocks == 1 and fb.needs_signals == ("fbcache",)
    dc = CMConfig(deepcache=DeepCacheConfig(), bn_blocks=2)
    assert dc.tail_blocks == 2 and dc.needs_signals == ()
    tc = CMConfig(teacache=TeaCacheConfig(policy="poly:wan2.1-t2v-1.3b-e0"))
    assert tc.teacache.signature_of == "time_projection"
    assert CMConfig(teacache=TeaCacheConfig()).teacache.signature_of == "modulated_input"


def test_attach_rejects_bad_run_shapes():
    from cache import CacheManager
    g = CacheManager(CMConfig())
    with pytest.raises(ConfigError, match="num_steps"):
        g.attach(0)
    with pytest.raises(ConfigError, match="sp_world_size"):
        g.attach(10, sp_world_size=0)

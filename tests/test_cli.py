"""End-to-end runs of the main command and of the flag mapping."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cache import ConfigError
from cache.flags import config_from_args
from stage2_transformer_flax_deepcache import build_parser

ROOT = Path(__file__).resolve().parents[1]


def cli(*args):
    return subprocess.run([sys.executable, "stage2_transformer_flax_deepcache.py", *args],
                          cwd=ROOT, capture_output=True, text=True)


def test_main_command_resolves_the_deepcache_default():
    out = cli("--enable_cache")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["modes"] == ["dc"] and report["computed_fraction"] == 0.5
    assert report["config"]["deepcache"] == {"start": 11, "end": 45, "interval": 4}


def test_bad_flags_exit_nonzero_with_a_message():
    out = cli("--teacache", "--teacache_thresh", "-1")
    assert out.returncode == 2 and "TeaCacheConfig.threshold" in out.stderr and out.stdout == ""
    out = cli("--fb_metric", "hidden_rel_l1")
    assert out.returncode == 2 and "fbcache is not enabled" in out.stderr


def parse(*args):
    return config_from_args(build_parser().parse_args(list(args)))


def test_flags_map_onto_the_config():
    cfg = parse("--teacache", "--teacache_thresh", "0.12", "--teacache_warmup", "3",
                "--teacache_limits", "max_cached=-1,max_continuous=2", "--cfg_mode", "separate",
                "--fbcache", "--fb_metric", "residual_tensor_rel_l1", "--evaluation_order", "tc,fb")
    assert cfg.teacache.threshold == 0.12 and cfg.warmup == 3
    assert cfg.limits.max_cached is None and cfg.limits.max_continuous == 2
    assert cfg.cfg_mode == "separate" and cfg.modes == ("tc", "fb") and cfg.probe_blocks == 1


def test_unset_flags_keep_the_dataclass_defaults():
    from cache import CMConfig, TeaCacheConfig
    assert parse("--teacache") == CMConfig(teacache=TeaCacheConfig())
    assert parse() == CMConfig()


def test_aliases_must_agree():
    with pytest.raises(ConfigError, match="different values"):
        parse("--teacache", "--teacache_warmup", "1", "--fb_warmup", "2")
    assert parse("--teacache", "--teacache_warmup", "2", "--fb_warmup", "2").warmup == 2

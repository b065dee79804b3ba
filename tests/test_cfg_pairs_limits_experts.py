"""CFG pair policies, skip limits and the Wan2.2 expert switch, on golden traces."""

import math

import pytest

from cache import PAIR, CacheManager, CMConfig, LimitsConfig, Signals, TeaCacheConfig
from tests.gate_driver import call, run

SIGS = [1.0, 1.02, 1.05, 1.2, 1.21, 1.22, 1.5, 1.51, 1.52, 1.6]  # thr .1 -> CSSCSSCSSC
WILD = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0]  # rel 1.0 every step
STILL = [1.0] * 10  # rel 0 every step


def gate(steps=10, **kw):
    kw.setdefault("teacache", TeaCacheConfig(threshold=0.1))
    g = CacheManager(CMConfig(**kw))
    g.attach(steps)
    return g


def test_cond_authoritative_uncond_follows_without_its_own_signal():
    g = gate()
    assert run(g, SIGS, [None] * 10) == {"cond": "CSSCSSCSSC", "uncond": "CSSCSSCSSC"}
    assert g.summary()["failsafe_count"] == 0
    pair = g.summary()["pair"]
    assert pair["pair_total"] == 10 and pair["pair_skipped"] == 6


def test_cond_authoritative_with_sep_diff_measures_uncond_but_follows():
    g = gate(cfg_sep_diff=True)
    assert run(g, SIGS, WILD) == {"cond": "CSSCSSCSSC", "uncond": "CSSCSSCSSC"}
    uncond_rels = [r["rel"] for r in g.telemetry.trace if r["branch"] == "uncond"]
    assert uncond_rels[1:] == pytest.approx([1.0] * 9)


def test_separate_branches_decide_alone():
    g = gate(cfg_mode="separate")
    assert run(g, SIGS, WILD) == {"cond": "CSSCSSCSSC", "uncond": "CCCCCCCCCC"}
    g = gate(cfg_mode="separate")
    assert run(g, WILD, STILL) == {"cond": "CCCCCCCCCC", "uncond": "CSSSSSSSSC"}


def test_shared_diff_feeds_the_leader_rel_to_the_follower():
    g = gate(cfg_mode="shared_diff", limits=LimitsConfig(max_continuous=1))
    # the follower ignores its own (wild) signal and uses cond's rel in its own accumulator
    trace = run(g, SIGS, WILD)
    assert trace["uncond"] == trace["cond"]
    assert trace["cond"] == "CSCCSCCSCC"


def test_cfg_compute_first_makes_uncond_the_leader():
    g = gate(cfg_compute_first=True)
    actions = []
    for step in range(10):
        d_u, _ = call(g, "uncond", Signals(teacache=SIGS[step]), step=step)
        d_c, _ = call(g, "cond", None, step=step)
        actions.append((d_u.action, d_c.action))
    assert "".join("S" if u == "skip" else "C" for u, _ in actions) == "CSSCSSCSSC"
    assert all(u == c for u, c in actions)


@pytest.mark.parametrize("reduce, expected", [("max", "CCCCCCCCCC"), ("mean", "CSCSCSCSCC")])
def test_fused_pairs_combine_branch_rels(reduce, expected):
    # cond rel .02, uncond rel .2 each step; threshold .15: max -> .2 computes, mean -> .11, .22
    g = gate(cfg_mode="fused", pair_reduce=reduce, teacache=TeaCacheConfig(threshold=0.15))
    actions = ""
    for step in range(10):
        signals = {"cond": Signals(teacache=1.02 ** step), "uncond": Signals(teacache=1.2 ** step)}
        d, _ = call(g, PAIR, signals, step=step)
        actions += "S" if d.skip else "C"
    assert actions == expected


def test_fused_nan_in_either_branch_computes_both():
    g = gate(steps=5, cfg_mode="fused", pair_reduce="mean")
    reasons = []
    for step in range(5):
        uncond = math.nan if step == 2 else 1.0
        signals = {"cond": Signals(teacache=1.0), "uncond": Signals(teacache=uncond)}
        d, _ = call(g, PAIR, signals, step=step)
        reasons.append(d.reason)
    # the NaN resets the signatures, so step 3 has no reference and computes too
    assert reasons == ["warmup", "below_threshold", "invalid_metric", "no_reference", "last_steps"]
    assert g.summary()["failsafes"]["invalid_metric"] == 1


def test_max_continuous_max_cached_alternating():
    assert run(gate(limits=LimitsConfig(max_continuous=2)), STILL)["cond"] == "CSSCSSCSSC"
    assert run(gate(limits=LimitsConfig(max_cached=3)), STILL)["cond"] == "CSSSCCCCCC"
    assert run(gate(limits=LimitsConfig(alternating=True)), STILL)["cond"] == "CSCSCSCSCC"
    g = gate(limits=LimitsConfig(max_cached=3))
    run(g, STILL)
    assert g.summary()["branches"]["cond"]["compute_reasons"]["max_cached"] == 5


def test_expert_switch_resets_state_and_restarts_warmup():
    experts = ["high"] * 5 + ["low"] * 5
    g = gate()
    trace = run(g, STILL, [None] * 10, experts=experts)
    assert trace == {"cond": "CSSSSCSSSC", "uncond": "CSSSSCSSSC"}
    s = g.summary()
    assert s["expert_switches"] == 1
    assert s["experts"]["high"]["cond"]["skipped"] == 4 and s["experts"]["low"]["cond"]["skipped"] == 3
    rows = [r for r in g.telemetry.trace if r["branch"] == "cond"]
    assert [r["phase_step"] for r in rows] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert rows[5]["reason"] == "warmup" and rows[5]["expert"] == "low"


def test_no_residual_leaks_across_the_expert_switch():
    g = gate(warmup=0)
    call(g, "cond", Signals(teacache=1.0), expert="high", step=0)
    call(g, "cond", Signals(teacache=1.0), expert="high", step=1)
    d, _ = call(g, "cond", Signals(teacache=1.0), expert="low", step=2)
    assert not d.skip  # no reference signature and no residual in the new phase
    assert d.reason == "no_reference"

"""bench.pareto's harness on a tiny config: the uncached runs of ours and of diffusers agree,
and the block counting sees what really ran (a cached call runs fewer sub-layers)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import pytest
import torch

pytest.importorskip("diffusers")

from bench.pareto import (
    peers,  # noqa: E402
    report,
)
from bench.pareto import workload as pw
from cache import CMConfig, FBCacheConfig  # noqa: E402
from sampling.fidelity import fidelity  # noqa: E402

BLOCKS = 3


def workload(key: str, steps: int):
    family = pw.families(BLOCKS, BLOCKS)[key]
    small = dataclasses.replace(family, size=(64, 64, 5))  # 2 latent frames, few tokens
    return pw.build_workload(small, steps)


@pytest.mark.parametrize("key", ["wan", "hunyuan"])
def test_uncached_ours_and_diffusers_agree(key):
    wl = workload(key, steps=3)
    ours = pw.run_ours(wl, CMConfig(), pw.our_counter(wl))
    theirs = peers.run_diffusers(wl)
    assert fidelity(theirs.latents, ours.latents, wl.noise)["rel_l2"] <= 1e-5
    assert ours.per_call == theirs.per_call == [float(BLOCKS)] * 6  # 3 steps x (cond, uncond)
    assert ours.fraction == theirs.fraction == 1.0


def test_counting_sees_reused_calls_on_both_sides():
    wl = workload("wan", steps=4)
    # Threshold far above any change: every call after a branch's first reuses.
    ours = pw.run_ours(wl, CMConfig(fbcache=FBCacheConfig(
        threshold=1e9, metric="residual_tensor_rel_l1"), warmup=1, last_steps=0),
        pw.our_counter(wl))
    # ours: the first step computes; later calls run the probe's block 0 only
    assert ours.per_call == [3.0, 3.0] + [1.0] * 6
    assert ours.fraction == pytest.approx(12 / 24)

    from diffusers.hooks import FirstBlockCacheConfig

    theirs = peers.run_diffusers(wl, peers.diffusers_hook(
        lambda: FirstBlockCacheConfig(threshold=1e9)))
    # FBC replaces the other blocks' forward: a hook on a block would still fire, the sub-layer
    # hooks do not
    assert theirs.per_call == [3.0, 3.0] + [1.0] * 6


@pytest.mark.skipif(importlib.util.find_spec("cache_dit") is None,
                    reason="cache-dit is in requirements-bench.txt, not requirements-dev.txt")
def test_counting_sees_cache_dit_reuse():
    wl = workload("wan", steps=10)
    run = peers.run_diffusers(wl, peers.cachedit_setup(wl, fn=1, bn=0, rdt=0.99, taylorseer=False))
    # cache-dit's 8 warm-up steps compute (16 calls), then the F1 block alone runs
    assert run.per_call == [3.0] * 16 + [1.0] * 4
    assert run.trace["cached_steps"] == [8, 9]


def test_front_and_goal():
    assert report.front([(0.5, 60.0), (0.4, 61.0), (0.3, 50.0), (0.6, 70.0)]) == [
        (0.3, 50.0), (0.4, 61.0), (0.6, 70.0)]
    # ours: the same PSNR at 0.4 that the peer needs 0.6 for -> 1.5x; +5 dB at 0.6
    (point, gain, ratio), = report.compare([(0.4, 70.0), (0.6, 75.0)], [(0.6, 70.0, "peer")], 0.0)
    assert point == (0.6, 70.0, "peer") and (gain, ratio) == (5.0, pytest.approx(1.5))
    assert report.goal_met(gain, ratio) and not report.goal_met(2.0, 1.2)
    assert report.both_met(gain, ratio) and report.goal_met(5.0, 1.0)
    assert not report.both_met(5.0, 1.0) and not report.both_met(None, 2.0)


def test_trained_regime_pools_held_out_prompts_and_reads_them():
    """Trained weights (assets/tiny-wan-ti2v through the real-checkpoint loader): ours and
    diffusers agree uncached; a setting runs on several held-out prompts pooled on the batch
    axis, and the analyser's reading of each decoded video is kept per prompt."""
    family = pw.trained_families()["wan"]
    assert family.trained and family.config.num_layers == 6
    wl = pw.build_workload(family, steps=4)
    seeds = pw.FOLLOW_SEEDS[:2]
    prompts = [pw.held_out_clip(s).prompt for s in seeds]
    assert len(set(prompts)) == 2  # two different held-out combinations
    ours = pw.over_prompts(wl, lambda w: pw.run_ours(w, CMConfig(), pw.our_counter(w)),
                               seeds)
    theirs = pw.over_prompts(wl, peers.run_diffusers, seeds)
    assert ours.latents.shape == (2, *wl.shape[1:])
    # fp32 rounding of two implementations; a trained model's trajectory amplifies it more
    # than a random one's (1.4e-5 here)
    assert fidelity(theirs.latents, ours.latents)["rel_l2"] <= 1e-4
    assert ours.fraction == 1.0 and len(ours.per_call) == 2 * 4 * 2  # prompts x steps x CFG
    assert set(ours.follow) == {"foreground", "background", "direction", "shape", "hits"}
    assert len(ours.follow["hits"]) == 2
    # the pooled run of one prompt is that prompt's own run
    one = pw.run_ours(wl.reseeded(seeds[1]), CMConfig(), pw.our_counter(wl))
    assert torch.equal(one.latents[0], ours.latents[1])


def _row(method, impl, fraction, psnr, setting="s", mean=None, rel_l2=1e-3):
    r = dict.fromkeys(report.COLUMNS)
    r.update(family="wan", method=method, impl=impl, setting=setting, status="ok",
             computed_fraction=fraction, psnr_db=psnr, psnr_db_mean=psnr if mean is None else mean,
             rel_l2=rel_l2, cpu_s=fraction)
    return r


def test_behind_and_the_runs_that_skipped_nothing():
    """Issue 39: a run of ours that computed every block is the uncached run, not a point; a
    best-peer point is behind where ours loses more than 0.5 dB or computes over 1/0.95 as much."""
    assert report.behind(-0.6, 1.2) and report.behind(1.0, 0.9) and report.behind(None, 2.0)
    assert not report.behind(-0.5, 0.95) and not report.behind(4.0, 1.3)
    rows = [_row("ours budgeted", "ours", 1.0, 200.0), _row("ours X", "ours", 0.3, 40.0, mean=45.0),
            _row("peer", "diffusers", 0.5, 50.0, mean=44.0)]
    assert [p[2] for p in report.points(rows, "wan", True)] == ["ours X"]
    lines, summary = report.standing(rows, "wan")  # pooled: ours 40 dB < the peer's 50 dB
    assert "behind at 1" in summary and "BEHIND" in "\n".join(lines)
    lines, summary = report.standing(rows, "wan", "psnr_db_mean")  # mean: +1 dB at 0.6x the cost
    assert "mean over draws" in summary and "behind at 0" in summary
    assert "ours X, s" in "\n".join(lines)  # the point of ours each comparison used is named


def test_an_exact_tie_with_a_peer_is_level_not_behind():
    """Issue 60: where ours runs the peer's very computation, float noise leaves it 1e-5 dB
    lower; the rule must not then fall to ours' next, costlier point and call it behind."""
    ours = [(0.36, 40.0 - 1e-5, "ours X", "every 3rd"), (0.40, 41.0, "ours Y", "s")]
    (point, gain, ratio), = report.compare(ours, [(0.36, 40.0, "SeaCache")], 0.01)
    assert ratio == pytest.approx(1.0) and not report.behind(gain, ratio)
    rows = [_row("ours X", "ours", 0.36, 40.0 - 1e-5), _row("ours Y", "ours", 0.40, 41.0),
            _row("peer", "diffusers", 0.36, 40.0)]
    _, summary = report.standing(rows, "wan")
    assert "behind at 0, level (within 0.05 dB) at 1" in summary
    # 0.1 dB short is no tie: ours' next point is 0.36 / 0.40 = 0.90x, behind
    rows[0]["psnr_db"] = 39.9
    assert "behind at 1, level (within 0.05 dB) at 0" in report.standing(rows, "wan")[1]
    assert report.verdict(-1e-5, 1.0) == "level" and report.verdict(0.3, 1.1) == "ahead"
    assert report.verdict(None, 2.0) == "no peer on one side"
    assert report.verdict(None, 0.9) == "BEHIND" and report.verdict(-0.6, None) == "BEHIND"
    assert report.verdict(3.5, 1.1) == "goal" and report.verdict(3.5, 1.3) == "both"


def test_one_flag_counts_and_promises_a_reader_can_trust():
    """Issue 60: budgeted mode and the presets against the best peer (goal and both only where
    a peer point exists on each side; a tie level); error budgets that chose caching counted
    against the budget and against their promised bound; uncached choices apart; speedup
    targets by the speedup they achieved, not as kept."""
    rows = [_row("ours budgeted", "ours", 1.0, math.inf,
                 "rel L2 budget 0.01: uncached: no calibrated configuration promises it"),
            _row("ours budgeted", "ours", 0.5, 55.0, "rel L2 budget 0.03: static z", rel_l2=0.02),
            _row("ours budgeted speedup", "ours", 0.2, 30.0, "speedup 4: static x"),
            _row("ours budgeted speedup", "ours", 0.4, 60.0, "speedup 2.5: static y"),
            _row("ours presets", "ours", 0.6, 50.0, "turbo"),
            _row("ours X", "ours", 0.5, 55.5),
            _row("peer", "diffusers", 0.38, 50.0), _row("peer", "diffusers", 0.6, 61.0)]
    rows[3]["speedup"] = 2.3  # the point's measured CPU speedup
    unseen = [{"kind": "speedup", "target": 4.0, "rel_l2": 0.1, "computed": 0.2},
              {"kind": "speedup", "target": 2.5, "rel_l2": 0.1, "computed": 0.44},
              {"kind": "rel_err", "target": 0.03, "rel_l2": 0.025, "computed": 0.5,
               "bound": 0.015},
              {"kind": "rel_err", "target": 0.03, "rel_l2": 0.01, "computed": 0.5,
               "bound": 0.015}]
    lines, summary = report.budget_standing(rows, "wan", unseen)
    text = "\n".join(lines)
    assert "uncached: no calibrated configuration promises it" in text
    # speedup 4: no peer is as cheap (no goal counted, not behind); speedup 2.5: +10 dB and
    # 1.5x (both); budget 0.03: +5 dB over the 0.38 point, the peer needs 0.6 for 55 dB (1.2x):
    # goal; preset turbo at 0.6: -11 dB, behind
    assert ("one flag (4 points of budgeted mode and the presets): behind the best peer at 1, "
            "goal at 2 and both forms at 1 of the 3 with a peer point on each side, level at 0, "
            "within 1 dB of our front at 3") in summary
    assert "| preset turbo | - | 0.600 | 50.0 |" in text and "| BEHIND |" in text
    # the 0.03 budget: kept on its 3 draws, its promised bound 0.015 on 1 of them
    assert "error budgets: 1 of 2 chose caching and kept the budget on 3 of 3 unseen draws, " \
           "their promised bound on 1; 1 ran uncached (rel L2 budget 0.01)" in summary
    assert "| rel L2 budget 0.03 | static z | 1.50e-02 | 2.50e-02 | 3/3 | 1/3 |" in text
    # speedup targets by what they achieved: 2.5 asked, 1/0.44 = 2.27x on one draw
    assert "| 2.5 | static y | 2.27x | 2.30x |" in text
    assert "speedup targets: 2 of 2 chose caching, block speedup achieved over asked 0.91 to " \
           "1.25; 0 ran uncached" in summary
    assert "kept" not in summary.split("speedup targets")[1]
    assert report.kept("rel_err", 0.01, 0.009, 1.0) and not report.kept("speedup", 2.0, 0.0, 0.51)
    assert "screened" not in text
    screened = "\n".join(report.budget_standing(rows, "wan", unseen, tuple(range(34, 64)))[0])
    assert "calibrated on draws 1, 2, 3, each configuration a target chooses screened on " \
           "draws 34-63 (30 draws" in screened and "confirmed" not in screened
    confirmed = "\n".join(report.budget_standing(rows, "wan", unseen, tuple(range(34, 64)),
                                                 tuple(range(84, 114)))[0])
    assert "(30 draws; sampling/budget.py), each one an error budget chooses confirmed on draws " \
           "84-113 (30 draws)" in confirmed and "chaotic" not in confirmed
    # the draws screening set aside as chaotic are named (sampling/budget.py screen)
    aside = [r for r in rows if "uncached" not in r["setting"]]
    for chaotic, named in (((63,), "draw 63"), ((123, 142), "draws 123, 142")):
        lines, summary = report.budget_standing(aside, "wan", unseen, tuple(range(34, 64)),
                                                tuple(range(84, 144)), chaotic)
        assert f"bf16-rounded weights: {named})" in "\n".join(lines)
        assert "0 ran uncached;" in summary


def test_mean_over_draws_is_each_draws_own_psnr_averaged():
    base = torch.arange(8.0).reshape(2, 1, 2, 2)
    run = base.clone()
    run[0] += 0.1  # draw 0 off, draw 1 exact (inf: left out of the mean)
    noise = torch.ones(2, 1, 2, 2)
    one = fidelity(run[:1], base[:1], noise[:1])["psnr_db"]
    assert report.mean_psnr(run, base, noise) == pytest.approx(one)
    run[1] += 0.2
    two = fidelity(run[1:], base[1:], noise[1:])["psnr_db"]
    assert report.mean_psnr(run, base, noise) == pytest.approx((one + two) / 2)
    assert report.mean_psnr(base, base, noise) == math.inf


@pytest.mark.parametrize("count", [30, 60, 200])
def test_budget_draws_never_meet_an_evaluated_draw(count):
    # budgeted mode's calibration, screen and confirm draws (python -m bench.pareto --confirm_draws)
    # stay apart from every draw a page or python -m bench.studies.fragile_prompts --more (at most
    # 20) evaluates it on
    tuned = set(pw.BUDGET_SEEDS) | set(pw.SCREEN_SEEDS) | set(pw.confirm_seeds(count))
    evaluated = (set(pw.UNSEEN_SEEDS) | set(pw.FOLLOW_SEEDS)
                 | set(range(pw.SCREEN_SEEDS[-1] + 1, pw.CONFIRM_FIRST)))
    assert not tuned & evaluated
    assert len(pw.confirm_seeds(count)) == count and pw.CONFIRM_SEEDS == pw.confirm_seeds(60)


def test_a_pages_calibration_resumes_from_its_runs_file(tmp_path, monkeypatch):
    # bench.pareto keeps its calibration's finished runs beside the page until the page is
    # written, so a page killed after hours of calibration resumes (sampling/calibration_runs.py)
    from bench.pareto import budget as pareto_budget
    from commands import calibrate
    from sampling import budget_space
    from tests.test_calibrate import SMALL_SPACE

    monkeypatch.setattr(budget_space, "space", lambda *_: SMALL_SPACE[:2])
    wl = workload("wan", steps=3)
    runs = pareto_budget.runs_path(str(tmp_path), "wan")
    first = pareto_budget.budget_profile(wl, str(tmp_path / "profile.json"), runs=runs)
    with open(runs) as f:
        assert len(f.read().splitlines()) == 1 + 2 * len(pw.BUDGET_SEEDS)
    def sampled_again(*_, **__):
        pytest.fail("a run the runs file holds was sampled again")
    monkeypatch.setattr(calibrate, "runner", lambda *_, **__: sampled_again)
    assert pareto_budget.budget_profile(wl, str(tmp_path / "again.json"), runs=runs) == first


def test_a_quick_page_says_it_is_no_result_and_shows_what_one_flag_gives(tmp_path):
    """The whole bench in quick mode on a 2-block random model (about 20 s): the page says it is
    not a result, carries the presets as a curve and the one-flag standing in both aggregations,
    and the promises of budgeted mode with their bounds."""
    from bench.pareto import budget as pareto_budget
    from bench.pareto import run as pareto
    assert pareto_budget.SPEEDUPS["trained"] == pareto_budget.SPEEDUPS["random"]  # one grid
    assert pareto.main(["--quick", "--families", "wan", "--steps", "6", "--blocks", "2",
                        "--out", str(tmp_path)]) == 0
    page = (tmp_path / "README.md").read_text()
    assert "**QUICK MODE: NOT A RESULT.**" in page
    # the presets through the diffusers adapter, on diffusers' model, are ours (issue 61)
    assert ("The presets through the diffusers adapter (our gate inside diffusers' model, run by "
            "the peers' loop): the same per-call block schedule as ours at 4 of 4") in page
    assert "PSNR pooled: one flag (" in page and "PSNR mean over draws: one flag (" in page
    assert "| preset turbo |" in page and "| ours presets | turbo |" in page
    assert "| target | chosen | promised bound |" in page
    with open(tmp_path / "results.csv") as f:
        assert sum(",ours presets," in line for line in f) == 4  # safe, balanced, hybrid, turbo


def test_a_committed_page_reads_again_from_its_rows_under_todays_rules(tmp_path):
    """bench/pareto/restand.py: results.csv back into rows reads as the page did (the same
    standing where no rule changed), and the dropped speedup-2.75 row is no longer a point."""
    from bench.pareto import restand
    path = os.path.join(restand.ROOT, "bench", "results", "pareto", "trained", "results.csv")
    rows = restand.read_rows(path)
    assert any(r["setting"].startswith("speedup 2.75:") for r in rows)
    assert all(isinstance(r["computed_fraction"], float) for r in rows if r["status"] == "ok")
    goal, n, both, behind, level = restand.counts(report.standing(rows, "wan")[1])
    assert (n, goal, both, behind) == (8, 7, 4, 0)  # the page's own pooled standing
    assert restand.main(["--out", str(tmp_path / "restanding.md")]) == 0
    page = (tmp_path / "restanding.md").read_text()
    ran = [folder for folder in restand.PAGES if any(
        r["setting"].startswith("speedup 2.75:") for r in restand.read_rows(os.path.join(
            restand.ROOT, "bench", "results", "pareto", folder, "results.csv")))]
    assert "trained" in ran  # pages run before the fixed grid ran it
    assert page.count("(2.75 dropped)") == 2 * len(ran)  # pooled and mean

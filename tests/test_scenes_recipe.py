"""The second training recipe (issue 60, bench/fixtures/scenes.py): its clips, prompts and
scoring, a trainer run of a few steps exported and read back by the pareto bench with the clip
size and sampling its training.json fixes."""

import json

import numpy as np
import pytest
import torch

from bench.fixtures import recipes, train
from bench.fixtures import scenes as S
from bench.pareto import workload as pw
from cache import CMConfig


def test_split_is_fixed_disjoint_and_covers_every_value():
    tr, te = S.split(0)
    assert (tr, te) == S.split(0) and not set(tr) & set(te)
    assert len(te) == round(0.125 * len(S.all_combos()))
    for k, values in enumerate((S.COLORS, S.COLORS, S.SHAPES, S.MOTIONS)):
        assert {c[k] for c in tr} == set(values)


def test_scenes_are_deterministic_and_every_prompt_fits_the_word_table():
    tr, _ = S.split(0)
    a, sa = S.Sampler(tr, 5).batch(64)
    b, sb = S.Sampler(tr, 5).batch(64)
    assert np.array_equal(a, b) and [s.prompt for s in sa] == [s.prompt for s in sb]
    assert a.shape == (64, S.FRAMES, S.SIZE, S.SIZE, 3) and 0 <= a.min() and a.max() <= 1
    enc = S.text_encoder(0)
    assert all(enc.problem(s.prompt) is None for s in sa)
    # the recipe draws what the docstring promises: two objects, size and color changes, textures
    things = [t for s in sa for t in s.things]
    assert any(len(s.things) == 2 for s in sa) and any(s.texture != "plain" for s in sa)
    assert {t.change for t in things} == {"", "grows", "shrinks"} and any(t.turning for t in things)
    # "stays" replaces "moves"
    still = S.Scene((S.Thing("red", "cross", "stays"),), "blue", "white", "checks")
    assert still.prompt == "red cross stays on blue white checks"


def test_growing_objects_grow_and_sub_token_motion_moves():
    scene = S.Scene((S.Thing("red", "square", "right", "grows"),), "black")
    video = S.render(scene, ((7.0, 3.5),))  # the whole track in view (centre_for's extreme)
    red = (video[..., 0] > 0.5).reshape(S.FRAMES, -1).sum(1)
    assert list(red) == sorted(red) and red[0] == S.SMALL ** 2 and red[-1] == S.LARGE ** 2
    cols = [np.nonzero(video[f, ..., 0] > 0.5)[1].mean() for f in range(S.FRAMES)]
    assert np.allclose(np.diff(cols), S.SPEED, atol=0.5)  # boxes round to whole pixels


@pytest.mark.parametrize("motion", S.MOTIONS)
def test_the_analyser_reads_clean_held_out_scenes(motion):
    scene = S.Scene((S.Thing("yellow", "circle", motion),), "blue")
    video = S.render(scene, (S.centre_for(np.random.default_rng(0), motion),))
    assert S.score(video, scene) == {"foreground": True, "background": True, "direction": True}
    wrong = S.Scene((S.Thing("red", "circle", motion),), "green")
    assert S.score(video, wrong) == {"foreground": False, "background": False, "direction": True}


def test_the_recipe_of_a_checkpoint_without_one_is_the_procedural_one(tmp_path):
    assert recipes.of_checkpoint(None) is recipes.PROCEDURAL
    assert recipes.of_checkpoint(str(tmp_path)) is recipes.PROCEDURAL
    (tmp_path / "training.json").write_text(json.dumps({"recipe": "other"}))
    with pytest.raises(ValueError, match="recipe 'other'; expected one of"):
        recipes.of_checkpoint(str(tmp_path))


def test_a_scenes_model_trains_exports_and_runs_in_the_pareto_bench(tmp_path):
    """A few trainer steps (logit-normal sigma), exported with the recipe's training.json; the
    bench then samples it with that clip size and sampler, prompts it with the recipe's
    held-out scenes through the checkpoint's own word table, and scores it with the recipe."""
    run, out = tmp_path / "run", tmp_path / "export"
    train.main(["--model", "tiny-wan-scenes", "--run_dir", str(run), "--batch", "2",
                "--wall_limit", "0.5", "--eval_every", "1e9", "--log_every", "1"])
    train.main(["--model", "tiny-wan-scenes", "--run_dir", str(run), "--export", str(out)])
    info = json.loads((out / "training.json").read_text())
    assert info["recipe"] == "scenes" and info["sampling"]["solver"] == "euler"
    assert "scenes.py" in (out / "MODEL_CARD.md").read_text()
    from bench.fixtures import evaluate
    evaluate.main([str(out), "--card", "--n", "2"])  # the card's figures, the recipe's analyser
    card = (out / "MODEL_CARD.md").read_text()
    assert "## At this export" in card and "| image to video (true first frame) |" in card
    assert (out / "heldout_strip.png").is_file()
    with pytest.raises(SystemExit, match="no --start, --trail or --latent"):
        train.main(["--model", "tiny-wan-scenes", "--run_dir", str(run), "--start", "edge"])

    family = pw.trained_families(str(out))["wan"]
    assert family.size == (S.SIZE, S.SIZE, S.FRAMES) and family.prompts.name == "scenes"
    wl = pw.build_workload(family, steps=3)
    assert wl.shape == (1, 3, S.FRAMES, S.SIZE, S.SIZE)
    assert (wl.pipe.solver, wl.pipe.shift, wl.guidance, wl.pipe.latent) == ("euler", 3.0, 4.0,
                                                                            "pixels")
    assert pw.build_workload(family).steps == 40  # the recipe's sampler, not the pipeline's 50
    prompt = pw.held_out_clip(10, family.prompts).prompt
    assert prompt != pw.held_out_clip(10).prompt and prompt.split()[0] in S.COLORS
    ours = pw.over_prompts(wl, lambda w: pw.run_ours(w, CMConfig(), pw.our_counter(w)), (10, 11))
    assert set(ours.follow) == {"foreground", "background", "direction", "hits"}
    from bench.pareto import peers
    from sampling.fidelity import fidelity
    theirs = peers.run_diffusers(wl)  # diffusers' Wan with 1x3x3 patches and 20 text positions
    mine = pw.run_ours(wl, CMConfig(), pw.our_counter(wl))
    assert fidelity(theirs.latents, mine.latents)["rel_l2"] <= 1e-4
    assert torch.isfinite(ours.latents).all()

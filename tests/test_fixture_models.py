"""The committed tiny trained models load with the real-checkpoint loader and follow prompts
(issue 28). Nothing trains here: the weights come from assets/ (bench/fixtures/train.py)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.fixtures import videos as V
from bench.fixtures.evaluate import evaluate
from bench.fixtures.models import MODELS
from bench.fixtures.recipes import SPLIT_SEED
from modules.checkpoint import load_model

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def _trained(name):
    path = ASSETS / name
    assert (path / "config.json").is_file(), f"{path}: the committed weights are missing"
    return path


@pytest.mark.parametrize("name", ["tiny-wan-ti2v", "tiny-hunyuanvideo15"])
def test_trained_model_loads_as_an_official_checkpoint(name):
    path = _trained(name)
    model, info = load_model(path)
    assert info["layout"] == "official" and model.config == MODELS[name]["config"]
    assert (path / "MODEL_CARD.md").is_file()
    assert json.loads((path / "training.json").read_text())["step"] > 0
    enc = V.TextEncoder.load(path / "text_encoder")
    assert np.array_equal(enc.encode("red circle moves right on blue"),
                          V.TextEncoder(0).encode("red circle moves right on blue"))


# the direction each committed model follows at least (of 16 held-out prompts; chance is 1/4;
# on all 84: 100% for both, their cards)
DIRECTION = {"tiny-wan-ti2v": 14 / 16, "tiny-hunyuanvideo15": 14 / 16}


@pytest.mark.parametrize("name", sorted(DIRECTION))
def test_trained_model_draws_the_prompted_colors_and_direction_on_held_out_prompts(name):
    torch.manual_seed(0)
    model, _ = load_model(_trained(name))
    spec = MODELS[name]
    _, test = V.split(SPLIT_SEED)
    info = json.loads((_trained(name) / "training.json").read_text())
    res = evaluate(model, V.TextEncoder.load(_trained(name) / "text_encoder"), test, n=16,
                   steps=spec["steps"], solver=spec["solver"], shift=spec["shift"],
                   guidance=spec["guidance"], seed=7, batch=16, latent=info["latent"])
    assert res["foreground"] >= 15 / 16 and res["background"] >= 15 / 16, res
    assert res["direction"] >= DIRECTION[name], res

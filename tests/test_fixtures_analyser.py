"""The procedural clips and the prompt-following analyser agree on clean clips (no training here)."""

import numpy as np
import pytest
import torch

from bench.fixtures import analyser
from bench.fixtures import videos as V
from modules.vae import PixelLatents


def test_split_is_fixed_disjoint_and_covers_every_attribute():
    train, test = V.split(0)
    assert V.split(0) == (train, test)
    assert not set(train) & set(test)
    assert len(train) + len(test) == len(V.all_combos())
    for k in range(4):
        assert {c[k] for c in train} == {c[k] for c in V.all_combos()}


def test_generator_is_deterministic_from_its_seed():
    train, _ = V.split(0)
    a, ca = V.Sampler(train, 7, p_two=0.5).batch(8)
    b, cb = V.Sampler(train, 7, p_two=0.5).batch(8)
    assert np.array_equal(a, b) and ca == cb
    assert a.shape == (8, V.FRAMES, V.SIZE, V.SIZE, 3) and a.dtype == np.float32


@pytest.mark.parametrize("dtype", ["float", "uint8"])
def test_analyser_recovers_every_attribute_of_clean_clips(dtype):
    videos, clips = V.Sampler(V.all_combos(), 3).batch(200)
    if dtype == "uint8":
        videos = (videos * 255).round().astype(np.uint8)
    acc = analyser.accuracies(videos, clips)
    assert acc == {"foreground": 1.0, "background": 1.0, "direction": 1.0, "shape": 1.0}


def test_analyser_tolerates_noise_and_sees_a_still_object():
    videos, clips = V.Sampler(V.all_combos(), 4).batch(100)
    noisy = np.clip(videos + np.random.default_rng(0).normal(0, 0.1, videos.shape), 0, 1)
    acc = analyser.accuracies(noisy, clips)
    assert min(acc["foreground"], acc["background"], acc["direction"]) == 1.0
    still = np.repeat(videos[:1, :1], V.FRAMES, axis=1)[0]
    assert analyser.analyse(still)["direction"] == "still"
    blank = np.zeros_like(videos[0])
    assert analyser.analyse(blank)["foreground"] is None


def test_prompts_latents_and_text_encoder_round_trip(tmp_path):
    clip = V.Clip((V.Obj("red", "circle", "right"),), "blue")
    assert clip.prompt == "red circle moves right on blue"
    two = V.Clip((V.Obj("red", "circle", "right"), V.Obj("green", "square", "up")), "blue")
    assert two.prompt == "red circle moves right and green square moves up on blue"
    video = V.render(two, (2, 6))
    assert np.allclose(V.from_latent(V.to_latent(video)), video)
    deltas = V.to_latent(video, "deltas")  # causal: frame 0, then halved changes
    assert np.allclose(deltas[:, 0], V.to_latent(video)[:, 0]) and np.abs(deltas).max() <= 1.0
    assert np.allclose(deltas[:, 1:], (V.to_latent(video)[:, 1:] - V.to_latent(video)[:, :-1]) / 2)
    assert np.allclose(V.from_latent(deltas, "deltas"), video, atol=1e-6)
    vae = PixelLatents(3, deltas=True)  # the product's decode of the same mapping
    z = torch.from_numpy(deltas)[None]
    assert torch.allclose(vae.encode(vae.decode(z)[0]), z, atol=1e-6)
    enc = V.TextEncoder(0)
    e = enc.encode(two.prompt)
    assert e.shape == (V.TEXT_LEN, V.TEXT_DIM) and not e[11:].any()
    assert not enc.encode("").any()
    assert np.array_equal(V.TextEncoder(0).encode(clip.prompt), enc.encode(clip.prompt))
    enc.save(tmp_path)
    assert np.array_equal(V.TextEncoder.load(tmp_path).encode(two.prompt), e)
    with pytest.raises(ValueError, match="unknown word"):
        enc.encode("purple circle")

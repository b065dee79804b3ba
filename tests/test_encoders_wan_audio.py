"""S2V stage 1 (encoders/wan_audio.py): audio_embeds against the official encode_audio re-derived
from the reference (stage1_encoders.md section 2: all 25 states with the last one after the final
LayerNorm as transformers 4.51.3 gives it, int(T / 50 * 30) rows by align_corners linear
interpolation, frame k takes row round(k * 30 / 16), int(T30 / (F * 30 / 16)) + 1 clips), the
official sizes and crop of the reference image, stage 2's checks of the outputs, and each
refusal as one line before any model work. diffusers has no S2V pipeline to compare with."""

from __future__ import annotations

import json
import math
import shutil
from fractions import Fraction

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from encoders import EncoderInputError, Request, wan_audio
from modules.vae import VAES, build_tiny
from sampling.pipelines import get_pipeline
from sampling.stage_io import check_tensors

PIPE = get_pipeline("wan-tiny-s2v")
RATE = wan_audio.SAMPLE_RATE


def tone(seconds, rate=RATE, freq=220.0, amplitude=0.3):
    t = np.arange(int(round(seconds * rate))) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t)))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("s2v")
    sf.write(d / "speech.wav", tone(2.5).astype(np.float32), RATE)  # float WAV, 16 kHz mono
    Image.fromarray(np.random.RandomState(0).randint(0, 256, (60, 100, 3), dtype=np.uint8)).save(
        d / "face.png")
    weights = wan_audio.write_tiny_weights(PIPE, d / "weights")
    return {"dir": d, "audio": str(d / "speech.wav"), "image": str(d / "face.png"),
            "weights": weights}


def request(files, **kw):
    return Request("a person talks", image=kw.pop("image", files["image"]),
                   audio=kw.pop("audio", files["audio"]), **kw)


# --- the oracle: official encode_audio, re-derived -------------------------------------------------

def official_states(folder, audio):
    """[25, T, D]: the processor's normalisation in numpy, then Wav2Vec2ForCTC (the official
    class) run module by module as transformers 4.51.3 collects hidden states: the input of
    every layer, and the final LayerNorm's output last."""
    from transformers import Wav2Vec2ForCTC

    x = audio.astype(np.float32)
    x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
    model = Wav2Vec2ForCTC.from_pretrained(folder).eval().wav2vec2
    with torch.no_grad():
        h, _ = model.feature_projection(model.feature_extractor(torch.from_numpy(x)[None]).transpose(1, 2))
        h = h + model.encoder.pos_conv_embed(h)
        states = []
        for layer in model.encoder.layers:
            states.append(h)
            out = layer(h)
            h = out[0] if isinstance(out, tuple) else out
        states.append(model.encoder.layer_norm(h))
    return torch.cat(states).numpy().astype(np.float64)


def official_bucket(states, frames_per_clip):
    """[1, L, D, clips * F] and clips, from the reference's formula with exact arithmetic."""
    layers, t, dim = states.shape
    rows = int(Fraction(t, 50) * 30)  # int(T / 50 * 30)
    pos = np.array([j * (t - 1) / (rows - 1) if rows > 1 else 0.0 for j in range(rows)])
    lo = np.floor(pos).astype(int)
    hi = np.minimum(lo + 1, t - 1)
    frac = (pos - lo)[None, :, None]
    at30 = states[:, lo] * (1 - frac) + states[:, hi] * frac  # align_corners linear
    clips = math.floor(Fraction(rows) / Fraction(frames_per_clip * 30, 16)) + 1
    n = clips * frames_per_clip
    out = np.zeros((1, layers, dim, n))
    for k in range(n):
        row = round(Fraction(k * 30, 16))  # Python rounds halves to even, as np.round does
        if row < rows:
            out[0, :, :, k] = at30[:, row]
    return out, clips, rows


def test_audio_embeds_equal_official_encode_audio(files):
    tensors, config = wan_audio.encode(PIPE, request(files), None)
    audio = wan_audio.read_audio(files["audio"])
    assert audio.shape == (40000,)
    states = official_states(files["weights"] / wan_audio.WAV2VEC_DIR, audio)
    assert states.shape == (25, (40000 - 400) // 320 + 1, 16)  # T = floor((N - 400) / 320) + 1
    want, clips, rows = official_bucket(states, 16)
    assert (rows, clips) == (74, 3)  # int(124 * 0.6); int(74 / 30) + 1
    got = tensors["audio_embeds"]
    assert got.dtype == torch.bfloat16 and tuple(got.shape) == (1, 25, 16, 48)
    # F.interpolate places rows in fp32 (position error ~1e-5 rows at T 124): atol 5e-5 on
    # values up to ~3; a wrong row, weight or state is off by 1e-1 or more
    atol = 5e-5
    # bf16 as official encode_audio returns it: within half a bf16 step of the oracle
    np.testing.assert_allclose(got.float().numpy(), want, rtol=2 ** -8, atol=atol)
    # and the fp32 path before the cast, tightly
    folder = files["weights"] / wan_audio.WAV2VEC_DIR
    model, extractor = wan_audio.load_wav2vec(folder)
    mine = wan_audio.hidden_states(model, extractor, audio)
    np.testing.assert_allclose(mine.numpy(), states, rtol=1e-6, atol=1e-6)
    fp32, _ = wan_audio.bucket(wan_audio.to_30fps(mine), 16)
    np.testing.assert_allclose(fp32.numpy(), want, rtol=0, atol=atol)
    # frames past the audio are silent: k with round(k * 1.875) >= 74, i.e. k >= 40
    silent = [k for k in range(48) if not want[0, :, :, k].any()]
    assert silent == list(range(40, 48)) and not got[..., 40:].float().any()
    assert config["num_clips"] == 3 and config["video_length"] == 16 and config["fps"] == 16


def test_transformers_hidden_states_trap_is_avoided(files):
    """transformers 5.24 returns the last layer before the final LayerNorm as hidden_states[24];
    the official pin returned it after. This test fails if the encoder takes hidden_states as is."""
    from transformers import Wav2Vec2Model

    folder = files["weights"] / wan_audio.WAV2VEC_DIR
    audio = wan_audio.read_audio(files["audio"])
    model, extractor = wan_audio.load_wav2vec(folder)
    mine = wan_audio.hidden_states(model, extractor, audio)
    values = extractor(audio, sampling_rate=RATE, return_tensors="pt").input_values
    with torch.no_grad():
        raw = Wav2Vec2Model.from_pretrained(folder).eval()(values, output_hidden_states=True)
    assert torch.equal(mine[:24], torch.cat(raw.hidden_states[:24]))
    assert torch.equal(mine[24], raw.last_hidden_state[0])
    assert (mine[24] - raw.hidden_states[24][0]).abs().max() > 0.1  # the trap is real here


def test_clip_counts_follow_official_rounding():
    """The reference's worked cases for 80-frame clips: 1 s -> 1 clip with 64 silent frames;
    5.3 s -> 2; 10.0 s -> T30 299 -> 2; T30 an exact multiple of 150 -> one more silent clip."""
    def held(seconds):
        t = wan_audio.feature_frames(int(seconds * RATE), (10, 3, 3, 3, 3, 2, 2), (5, 2, 2, 2, 2, 2, 2))
        return wan_audio.frames_at_30fps(t), wan_audio.clips_for(wan_audio.frames_at_30fps(t), 80)

    assert held(1.0) == (29, 1) and held(5.3)[1] == 2 and held(10.0) == (299, 2)
    assert wan_audio.clips_for(150, 80) == 2 and wan_audio.clips_for(149, 80) == 1
    embeds, clips = wan_audio.bucket(torch.ones(25, 29, 4), 80)
    assert clips == 1 and embeds.shape == (1, 25, 4, 80)
    assert int((embeds[0, 0, 0] == 0).sum()) == 64  # frames 16..79 past the audio
    # ties round to even: frame 12 sits at 22.5 rows and takes row 22, frame 4 (7.5) row 8
    ramp = torch.arange(29.0)[None, :, None].expand(1, 29, 1)
    idx, _ = wan_audio.bucket(ramp, 80)
    assert idx[0, 0, 0, 12] == 22 and idx[0, 0, 0, 4] == 8


def test_read_audio_mixes_down_and_resamples_to_16k(files):
    """Stereo 44.1 kHz: the channel mean, soxr-resampled to ceil(N * 16000 / 44100) samples,
    equals the analytic 16 kHz tone away from the edges; 16-bit PCM reads as x / 32768."""
    n = 44100
    t = np.arange(n) / 44100
    left, right = 0.5 * np.sin(2 * np.pi * 440 * t), 0.1 * np.sin(2 * np.pi * 440 * t)
    path = files["dir"] / "stereo.wav"
    sf.write(path, np.stack([left, right], axis=1).astype(np.float32), 44100)
    audio = wan_audio.read_audio(str(path))
    assert audio.dtype == np.float32 and audio.shape == (math.ceil(n * 16000 / 44100),)
    want = 0.3 * np.sin(2 * np.pi * 440 * np.arange(audio.shape[0]) / 16000)
    assert np.abs(audio[200:-200] - want[200:-200]).max() < 2e-3
    pcm = (np.arange(-2000, 2000) * 8).astype(np.int16)
    sf.write(files["dir"] / "pcm.wav", pcm, RATE, subtype="PCM_16")
    assert np.array_equal(wan_audio.read_audio(str(files["dir"] / "pcm.wav")), pcm / 32768.0)


# --- the reference image -----------------------------------------------------------------------

def test_reference_image_size_and_crop_are_official():
    # reference section 2: 1080x1920 at --size 1280*720 -> 704x1280, ~14 px black bars
    assert wan_audio.size_less_than_area(1080, 1920, 1280 * 720) == (704, 1280)
    white = Image.new("RGB", (1920, 1080), (255, 255, 255))
    pixels = wan_audio.reference_pixels(white, 704, 1280)
    assert pixels.shape == (1, 3, 1, 704, 1280)
    # shorter side 1080 -> 704, width int(704 * 1920 / 1080) = 1251: 29 px of padding, 14 + 15
    columns = pixels[0, :, 0].amin(dim=(0, 1))
    assert (columns[:14] == -1).all() and (columns[1265:] == -1).all()
    assert (pixels[0, :, 0, :, 14:1265] == 1).all()
    # a portrait image into a square: shorter side (width) to 64, centre 64 of the 128 rows
    stripes = np.zeros((200, 100, 3), np.uint8)
    stripes[:, :, 0] = (np.arange(200) * 255 // 199)[:, None]
    pixels = wan_audio.reference_pixels(Image.fromarray(stripes), 64, 64)
    rows = (pixels[0, 0, 0, :, 0] + 1) * 127.5
    full = np.asarray(Image.fromarray(stripes).resize((64, 128), Image.BILINEAR), np.float64)[:, 0, 0]
    np.testing.assert_allclose(rows.numpy(), full[32:96], atol=1e-3)


def test_ref_latents_are_the_stage3_tiny_vae_encode(files):
    """Tiny weights: the reference latent is the mean of the same tiny Wan2.1 VAE stage 3 decodes
    with (seed 0), after its save/load round trip, of the official preprocessing (64 x 128 for a
    60 x 100 image within 64 x 128)."""
    from modules.vae import TINY_VAE_SEED

    assert wan_audio.TINY_VAE_SEED == TINY_VAE_SEED
    tensors, config = wan_audio.encode(PIPE, request(files, height=64, width=128), None)
    assert (config["height"], config["width"]) == (64, 128)
    image = Image.open(files["image"]).convert("RGB")
    vae = build_tiny(VAES["wan2.1-vae"], 16, seed=TINY_VAE_SEED)
    with torch.no_grad():
        want = vae.encode(wan_audio.reference_pixels(image, 64, 128)).latent_dist.mode()
    assert tensors["ref_latents"].shape == (1, 16, 1, 8, 16)
    torch.testing.assert_close(tensors["ref_latents"], want, rtol=1e-5, atol=1e-6)


def test_outputs_pass_stage2_checks(files):
    tensors, config = wan_audio.encode(PIPE, request(files, clips=2), None)
    shape = PIPE.latent_shape(config["height"], config["width"], config["video_length"])
    speech = {k: v for k, v in PIPE.stage1_specs(shape, False, False).items() if "prompt" not in k}
    check_tensors(tensors, speech, "wan_audio")
    assert PIPE.clip_count(tensors, shape) == 3 and config["num_clips"] == 2
    # merged with text keys, the whole stage-1 set passes
    text = {k: v for k, v in PIPE.synthesize(shape, True, False, 0).items() if "prompt" in k}
    check_tensors({**text, **tensors}, PIPE.stage1_specs(shape, True, False), "stage 1")


def test_tiny_weights_are_deterministic(files, tmp_path):
    again = wan_audio.write_tiny_weights(PIPE, tmp_path / "w")
    for name in (f"{wan_audio.WAV2VEC_DIR}/model.safetensors",
                 f"{wan_audio.VAE_DIR}/diffusion_pytorch_model.safetensors"):
        assert (again / name).read_bytes() == (files["weights"] / name).read_bytes()


# --- refusals: one line, before any model work ------------------------------------------------------

def broken_weights(files, tmp_path, change):
    root = tmp_path / "w"
    shutil.copytree(files["weights"], root)
    change(root / wan_audio.WAV2VEC_DIR, root)
    return root


def edit_json(path, **values):
    data = json.loads(path.read_text())
    data.update(values)
    path.write_text(json.dumps(data))


def other_wav2vec(w2v, root):
    """A config.json of the expected model beside another wav2vec2's weights (hidden 8)."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    cfg = {**wan_audio.tiny_wav2vec_config(PIPE), "hidden_size": 8, "intermediate_size": 16}
    Wav2Vec2ForCTC(Wav2Vec2Config(**cfg)).save_pretrained(root / "other")
    shutil.copy(root / "other" / "model.safetensors", w2v / "model.safetensors")


def wan22_vae(w2v, root):
    shutil.rmtree(root / wan_audio.VAE_DIR)
    build_tiny(VAES["wan2.2-vae"], 48).save_pretrained(root / wan_audio.VAE_DIR)


def write_audio(files, name, samples, rate=RATE):
    path = files["dir"] / name
    sf.write(path, np.asarray(samples, np.float32), rate)
    return str(path)


INPUTS = {
    "missing audio": (lambda f: dict(audio=str(f["dir"] / "nope.wav")), "no such file"),
    "unreadable audio": (lambda f: dict(audio=str(_garbage(f, "bad.wav"))), "cannot be decoded"),
    "silent audio": (lambda f: dict(audio=write_audio(f, "zeros.wav", np.zeros(32000))), "silent"),
    "near-silent audio": (lambda f: dict(audio=write_audio(
        f, "hiss.wav", 3e-5 * np.random.RandomState(1).randn(32000))), "silent"),
    "too short audio": (lambda f: dict(audio=write_audio(f, "blip.wav", tone(0.03))),
                        "too short for a clip"),
    "more clips than the audio": (lambda f: dict(clips=4), "--num_clips: 4"),
    "missing image": (lambda f: dict(image=str(f["dir"] / "nope.png")), "no such file"),
    "unreadable image": (lambda f: dict(image=str(_garbage(f, "bad.png"))), "cannot be decoded"),
    "no image": (lambda f: dict(image=None), "--image: not given"),
    "no audio": (lambda f: dict(audio=None), "--audio: not given"),
    "clip length": (lambda f: dict(frames=18), "--video_length: 18"),
    "area below one 64 x 64 tile": (lambda f: dict(height=32, width=32), "--height/--width"),
}

WEIGHTS = {
    "no config.json": (lambda w, r: (w / "config.json").unlink(), "lacks config.json"),
    "no preprocessor": (lambda w, r: (w / "preprocessor_config.json").unlink(),
                        "lacks preprocessor_config.json"),
    "no model weights": (lambda w, r: (w / "model.safetensors").unlink(),
                         "lacks model.safetensors or pytorch_model.bin"),
    "a hubert config": (lambda w, r: edit_json(w / "config.json", model_type="hubert"),
                        "describes a 'hubert' model"),
    "wav2vec2-base": (lambda w, r: edit_json(w / "config.json", hidden_size=768, num_hidden_layers=12,
                                             do_stable_layer_norm=False, feat_extract_norm="group"),
                      "hidden_size 768"),
    "another wav2vec2's weights": (other_wav2vec, "holds other weights than its config.json"),
    "truncated weights": (lambda w, r: _truncate(w / "model.safetensors"),
                          "model.safetensors: truncated: tensor"),
    "no vae": (lambda w, r: shutil.rmtree(r / wan_audio.VAE_DIR), "has neither Wan2.1_VAE.pth"),
    "the Wan2.2 VAE": (wan22_vae, "VAE of 12 input and 48 latent channels"),
}


def _garbage(files, name):
    path = files["dir"] / name
    path.write_bytes(b"RIFF\x00\x01not audio or image at all" * 3)
    return path


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def refused_before_model_work(monkeypatch, pipeline, req, weights, *needles):
    """check() refuses in one line naming the problem and what is expected; encode() refuses
    the same way without loading a model."""
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(wan_audio, "load_wav2vec", no_model)
    monkeypatch.setattr(wan_audio, "encode_reference", no_model)
    monkeypatch.setattr(wan_audio, "write_tiny_weights", no_model)
    messages = []
    for call in (wan_audio.check, wan_audio.encode):
        with pytest.raises(EncoderInputError) as info:
            call(pipeline, req, weights)
        text = str(info.value)
        assert "\n" not in text and info.value.expected and "; expected " in text, text
        for needle in needles:
            assert needle in text, text
        messages.append(text)
    assert messages[0] == messages[1]


@pytest.mark.parametrize("case", INPUTS)
def test_bad_input_is_refused_in_one_line(case, files, monkeypatch):
    make, needle = INPUTS[case]
    refused_before_model_work(monkeypatch, PIPE, request(files, **make(files)), files["weights"],
                              needle)


@pytest.mark.parametrize("case", WEIGHTS)
def test_bad_weights_are_refused_in_one_line(case, files, tmp_path, monkeypatch):
    change, needle = WEIGHTS[case]
    root = broken_weights(files, tmp_path, change)
    refused_before_model_work(monkeypatch, PIPE, request(files), root, needle)


def test_real_pipeline_needs_real_weights(files, monkeypatch):
    refused_before_model_work(monkeypatch, get_pipeline("wan2.2-s2v-14b"), request(files), None,
                              "tiny random encoders are built only for the tiny pipelines")


def test_pickled_checkpoints_are_checked_by_their_index(files, tmp_path, monkeypatch):
    """pytorch_model.bin and Wan2.1_VAE.pth (pickles) are read with mmap for names and shapes
    only: the right ones pass, another model's are refused."""
    from safetensors.torch import load_file

    def to_pickles(w2v, root):
        torch.save(load_file(w2v / "model.safetensors"), w2v / "pytorch_model.bin")
        (w2v / "model.safetensors").unlink()
        vae = root / wan_audio.VAE_DIR
        torch.save(load_file(vae / "diffusion_pytorch_model.safetensors"), root / wan_audio.VAE_FILE)
        shutil.rmtree(vae)

    root = broken_weights(files, tmp_path, to_pickles)
    wan_audio.check(PIPE, request(files), root)
    audio = wan_audio.read_audio(files["audio"])
    states = [wan_audio.hidden_states(*wan_audio.load_wav2vec(r / wan_audio.WAV2VEC_DIR), audio)
              for r in (root, files["weights"])]
    assert torch.equal(*states)  # transformers reads the .bin as the .safetensors
    torch.save(build_tiny(VAES["wan2.2-vae"], 48).state_dict(), root / wan_audio.VAE_FILE)
    refused_before_model_work(monkeypatch, PIPE, request(files), root,
                              "Wan2.1_VAE.pth: holds a VAE of 12 input and 48 latent channels")


def test_good_input_passes_check(files):
    wan_audio.check(PIPE, request(files), files["weights"])
    wan_audio.check(PIPE, request(files, clips=3), None)

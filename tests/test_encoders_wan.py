"""Stage 1 for Wan (encoders.wan, encoders.umt5): tiny random encoders in the official and diffusers
layouts against diffusers 0.42.1's encode functions on the same weights and tokenizer, the
official behaviour where it differs from diffusers, the stage-1 specs, and one-line refusals."""

from __future__ import annotations

import hashlib
import math
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from PIL import Image

import encoders
from encoders import EncoderInputError, Request, umt5, wan
from sampling.pipelines import get_pipeline
from sampling.stage_io import check_tensors

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

TI2V, I2V, S2V = (get_pipeline(n) for n in ("wan-tiny-ti2v", "wan-tiny-i2v", "wan-tiny-s2v"))
PROMPTS = ["a red circle moves left", "", "  a  &amp;amp; blue\tsquare \n", "色调艳丽，过曝 “quoted”",
           "a blue square moves right, a green triangle moves up and a yellow star moves down"]


# --- oracles ------------------------------------------------------------------------------------

def diffusers_text(root: Path, dtype=torch.float32):
    """The tokenizer and text encoder as diffusers loads them from a pipeline folder."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(root / "tokenizer"))
    encoder = transformers.UMT5EncoderModel.from_pretrained(str(root / "text_encoder"), dtype=dtype)
    return types.SimpleNamespace(tokenizer=tokenizer, text_encoder=encoder.eval(),
                                 _execution_device=torch.device("cpu"))


def diffusers_prompt_embeds(components, prompt: str, text_len: int) -> torch.Tensor:
    """WanPipeline._get_t5_prompt_embeds: [1, text_len, D], zero rows past the real tokens."""
    with torch.no_grad():
        return diffusers.WanPipeline._get_t5_prompt_embeds(
            components, prompt, max_sequence_length=text_len, device=torch.device("cpu"))


def diffusers_i2v(root: Path, expand_timesteps: bool):
    vae = diffusers.AutoencoderKLWan.from_pretrained(str(root / "vae")).eval()
    text = diffusers_text(root)
    return diffusers.WanImageToVideoPipeline(
        tokenizer=text.tokenizer, text_encoder=text.text_encoder, vae=vae,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), expand_timesteps=expand_timesteps)


def official_t5(state: dict, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """wan/modules/t5.py T5Encoder.forward (umt5_xxl: shared_pos=False, eval, fp32) on its own
    key names, over all positions with the padding mask, as the release runs it."""
    layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
    buckets, heads = state["blocks.0.pos_embedding.embedding.weight"].shape
    length = ids.shape[1]

    def norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6))

    rel = torch.arange(length)[None] - torch.arange(length)[:, None]
    half = buckets // 2  # bidirectional
    bucket = (rel > 0).long() * half
    rel = rel.abs()
    exact = half // 2
    large = exact + (torch.log(rel.float() / exact) / math.log(128 / exact) * (half - exact)).long()
    bucket = bucket + torch.where(rel < exact, rel, large.clamp(max=half - 1))
    bias_mask = torch.zeros(1, 1, 1, length).masked_fill(mask.view(1, 1, 1, -1) == 0,
                                                         torch.finfo(torch.float32).min)
    x = state["token_embedding.weight"][ids]
    for i in range(layers):
        w = {k[len(f"blocks.{i}."):]: v for k, v in state.items() if k.startswith(f"blocks.{i}.")}
        h = norm(x, w["norm1.weight"])
        q, k, v = (h @ w[f"attn.{n}.weight"].T for n in "qkv")
        q, k, v = (t.view(1, length, heads, -1) for t in (q, k, v))
        pos = w["pos_embedding.embedding.weight"][bucket].permute(2, 0, 1)[None]
        attn = torch.einsum("binc,bjnc->bnij", q, k) + pos + bias_mask  # no 1/sqrt(d) scaling
        out = torch.einsum("bnij,bjnc->binc", attn.softmax(dim=-1), v).reshape(1, length, -1)
        x = x + out @ w["attn.o.weight"].T
        h = norm(x, w["norm2.weight"])
        gate = torch.nn.functional.gelu(h @ w["ffn.gate.0.weight"].T, approximate="tanh")
        x = x + ((h @ w["ffn.fc1.weight"].T) * gate) @ w["ffn.fc2.weight"].T
    return norm(x, state["norm.weight"])[:, : int(mask.sum())]


# official wan/modules/t5.py names of the transformers UMT5EncoderModel weights (stage1_encoders.md
# section 4), to write an official-layout checkpoint from the tiny diffusers one
def official_state(hf: dict) -> dict:
    out = {"token_embedding.weight": hf["shared.weight"],
           "norm.weight": hf["encoder.final_layer_norm.weight"]}
    layers = 1 + max(int(k.split(".")[2]) for k in hf if k.startswith("encoder.block."))
    for i in range(layers):
        attn, ffn = f"encoder.block.{i}.layer.0.", f"encoder.block.{i}.layer.1."
        out.update({f"blocks.{i}.norm1.weight": hf[attn + "layer_norm.weight"],
                    f"blocks.{i}.norm2.weight": hf[ffn + "layer_norm.weight"],
                    f"blocks.{i}.pos_embedding.embedding.weight":
                        hf[attn + "SelfAttention.relative_attention_bias.weight"],
                    f"blocks.{i}.ffn.gate.0.weight": hf[ffn + "DenseReluDense.wi_0.weight"],
                    f"blocks.{i}.ffn.fc1.weight": hf[ffn + "DenseReluDense.wi_1.weight"],
                    f"blocks.{i}.ffn.fc2.weight": hf[ffn + "DenseReluDense.wo.weight"]})
        out.update({f"blocks.{i}.attn.{n}.weight": hf[attn + f"SelfAttention.{n}.weight"]
                    for n in "qkvo"})
    return out


# --- fixtures -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ti2v_root():
    return wan.tiny_weights(TI2V, image=True)


@pytest.fixture(scope="module")
def i2v_root():
    return wan.tiny_weights(I2V, image=True)


@pytest.fixture(scope="module")
def official_root(ti2v_root, tmp_path_factory):
    """The tiny text encoder in the release layout: the .pth (fp32 here) and google/umt5-xxl/."""
    root = tmp_path_factory.mktemp("official")
    hf = transformers.UMT5EncoderModel.from_pretrained(str(ti2v_root / "text_encoder")).state_dict()
    torch.save(official_state(hf), root / "models_t5_umt5-xxl-enc-bf16.pth")
    shutil.copytree(ti2v_root / "tokenizer", root / "google" / "umt5-xxl")
    return root


def image_file(path: Path, width: int, height: int, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(path)
    return str(path)


def specs(pipeline, config, image):
    height, width, frames = (config.get(k, d) for k, d in
                             zip(("height", "width", "video_length"), pipeline.size, strict=True))
    return pipeline.stage1_specs(pipeline.latent_shape(height, width, frames), True, image)


def refused(call, *needles) -> EncoderInputError:
    with pytest.raises(EncoderInputError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return info.value


# --- text -----------------------------------------------------------------------------------------

def test_text_matches_diffusers_in_fp32(ti2v_root):
    """Cleaning, text_len padding/truncation (</s> kept) and the real-length rows equal
    diffusers' on the same tiny weights; diffusers' rows past them are zero padding."""
    theirs = diffusers_text(ti2v_root)
    files = umt5.locate(ti2v_root)
    tokenizer = umt5.load_tokenizer(files.tokenizer)
    model = umt5.load_encoder(files, 16, torch.float32)
    lengths = set()
    for prompt in PROMPTS:
        ours = umt5.encode(tokenizer, model, prompt, TI2V.config.text_len)
        ref = diffusers_prompt_embeds(theirs, prompt, TI2V.config.text_len)
        n = ours.shape[1]
        lengths.add(n)
        assert ours.dtype == torch.float32 and ref.shape == (1, 16, 16)
        torch.testing.assert_close(ours, ref[:, :n], rtol=1e-5, atol=1e-6)
        assert not ref[:, n:].any()
    assert 1 in lengths and 16 in lengths and len(lengths) >= 3  # "" -> </s>; truncated; between


def test_encode_text_to_video_bf16(ti2v_root):
    """The public path (bf16, the official t5_dtype): the tensors stage 2 reads, as near the
    fp32 encode as diffusers' bf16 encode is (diffusers runs the padding too, so the two bf16
    encodes round differently: on a CPU with bf16 instructions one element of the negative
    prompt's differs by 8 of its bf16 steps); no image -> no config fields."""
    tensors, config = wan.encode(TI2V, Request(PROMPTS[0], negative_prompt="blurry"), None)
    assert config == {}
    check_tensors(tensors, specs(TI2V, config, image=False), "stage 1")
    assert set(tensors) == {"prompt_embeds", "negative_prompt_embeds"}
    theirs = diffusers_text(ti2v_root, torch.bfloat16)
    exact = diffusers_text(ti2v_root)
    for key, prompt in (("prompt_embeds", PROMPTS[0]), ("negative_prompt_embeds", "blurry")):
        ours = tensors[key]
        assert ours.dtype == torch.bfloat16
        n = ours.shape[1]
        ref = diffusers_prompt_embeds(theirs, prompt, 16)[:, :n].float()
        fp32 = diffusers_prompt_embeds(exact, prompt, 16)[:, :n]
        err, their_err = (ours.float() - fp32), (ref - fp32)
        assert err.pow(2).mean().sqrt() <= 1.25 * their_err.pow(2).mean().sqrt() + 1e-4, key
        assert err.abs().max() <= 2 * their_err.abs().max() + 1e-4, key
        torch.testing.assert_close(ours.float(), ref, rtol=1.6e-2, atol=3e-2)


def test_negative_defaults_are_the_official_ones():
    """diffusers' default negative prompt is ""; the official one is the config's list (S2V has
    its own), also for an explicit "" (`if n_prompt == ""`). Hashes of the strings in
    Wan2.2@42bf4cf wan/configs/shared_config.py and wan_s2v_14B.py."""
    digest = {p.name: hashlib.sha256(wan.default_negative_prompt(p).encode()).hexdigest()
              for p in (TI2V, I2V, S2V, get_pipeline("wan2.2-i2v-a14b"))}
    shared = "ce96e0324e4b54ce4b6e867f669ca520952e1a34cc116543516b1897f0d3c47e"
    assert digest == {"wan-tiny-ti2v": shared, "wan-tiny-i2v": shared, "wan2.2-i2v-a14b": shared,
                      "wan-tiny-s2v": "98afffdba82fbb1f87767b2e0d022cb2e4960f400d98c617f9b82bc707d09218"}
    default = wan.encode(TI2V, Request("x"), None)[0]["negative_prompt_embeds"]
    empty = wan.encode(TI2V, Request("x", negative_prompt=""), None)[0]["negative_prompt_embeds"]
    as_prompt = wan.encode(TI2V, Request(wan.default_negative_prompt(TI2V)), None)[0]["prompt_embeds"]
    assert torch.equal(default, empty) and torch.equal(default, as_prompt)
    assert default.shape[1] == 16  # the long list is truncated to the tiny text_len, </s> kept


def test_official_layout_is_the_official_encoder(official_root, ti2v_root):
    """The release layout (.pth in wan/modules/t5.py names + google/umt5-xxl/) loads to the same
    encoder as the diffusers layout, and equals the official T5Encoder's math run as the release
    runs it: all text_len positions with the mask, then the real rows."""
    prompt = PROMPTS[4]
    tensors, _ = wan.encode(TI2V, Request(prompt), official_root)
    same, _ = wan.encode(TI2V, Request(prompt), ti2v_root)
    assert torch.equal(tensors["prompt_embeds"], same["prompt_embeds"])
    files = umt5.locate(official_root)
    assert files.layout == umt5.OFFICIAL
    tokenizer = umt5.load_tokenizer(files.tokenizer)
    ours = umt5.encode(tokenizer, umt5.load_encoder(files, 16, torch.float32), prompt, 16)
    tokens = tokenizer([prompt], padding="max_length", max_length=16, truncation=True,
                       return_tensors="pt")
    state = torch.load(files.encoder, weights_only=True)
    with torch.no_grad():
        ref = official_t5(state, tokens.input_ids, tokens.attention_mask)
    assert ours.shape == ref.shape == (1, 16, 16)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    short = umt5.encode(tokenizer, umt5.load_encoder(files, 16, torch.float32), "a cat", 16)
    tokens = tokenizer(["a cat"], padding="max_length", max_length=16, truncation=True,
                       return_tensors="pt")
    assert int(tokens.attention_mask.sum()) < 16  # padded: the masked run
    torch.testing.assert_close(short, official_t5(state, tokens.input_ids, tokens.attention_mask),
                               rtol=1e-5, atol=1e-5)


def test_tiny_weights_are_deterministic(tmp_path):
    """Built twice, the tiny tokenizer and encoder files are byte-identical."""
    for name in ("a", "b"):
        umt5.write_tiny(tmp_path / name, 16, ("one corpus line",))
    for part in ("tokenizer/tokenizer.json", "text_encoder/model.safetensors"):
        assert (tmp_path / "a" / part).read_bytes() == (tmp_path / "b" / part).read_bytes()


# --- images ---------------------------------------------------------------------------------------

def test_ti2v_image_latents_match_diffusers(ti2v_root, tmp_path):
    """An image already at the output size (no resize either way): the normalised Wan2.2-VAE
    latent equals WanImageToVideoPipeline(expand_timesteps=True).prepare_latents'; the image
    decides the config's size."""
    path = image_file(tmp_path / "frame.png", 192, 128)
    tensors, config = wan.encode(TI2V, Request("a cat", image=path), None)
    assert config == {"height": 128, "width": 192, "video_length": 9}
    check_tensors(tensors, specs(TI2V, config, image=True), "stage 1")
    pipe = diffusers_i2v(ti2v_root, expand_timesteps=True)
    pixels = pipe.video_processor.preprocess(Image.open(path).convert("RGB"), height=128, width=192)
    with torch.no_grad():
        _, latent, _ = pipe.prepare_latents(pixels, 1, 4, 128, 192, 9, torch.float32,
                                            torch.device("cpu"), torch.Generator().manual_seed(0))
    assert tensors["image_latents"].shape == latent.shape == (1, 4, 1, 8, 12)
    torch.testing.assert_close(tensors["image_latents"], latent, rtol=1e-5, atol=1e-6)


def test_i2v_condition_matches_diffusers(i2v_root, tmp_path):
    """[mask 4 | Wan2.1 latent of image + F-1 zero frames] equals
    WanImageToVideoPipeline.prepare_latents' condition (image at the output size)."""
    path = image_file(tmp_path / "frame.png", 96, 64, seed=1)
    tensors, config = wan.encode(I2V, Request("a cat", image=path), None)
    assert config == {"height": 64, "width": 96, "video_length": 9}
    check_tensors(tensors, specs(I2V, config, image=True), "stage 1")
    pipe = diffusers_i2v(i2v_root, expand_timesteps=False)
    pixels = pipe.video_processor.preprocess(Image.open(path).convert("RGB"), height=64, width=96)
    with torch.no_grad():
        _, condition = pipe.prepare_latents(pixels, 1, 4, 64, 96, 9, torch.float32,
                                            torch.device("cpu"), torch.Generator().manual_seed(0))
    ours = tensors["condition"]
    assert ours.shape == condition.shape == (1, 8, 3, 8, 12)
    torch.testing.assert_close(ours, condition, rtol=1e-5, atol=1e-6)
    assert ours[:, :4, 0].eq(1).all() and not ours[:, :4, 1:].any()
    # trap 10: frames 1.. are the latents of the zeros after the image, not of a zero video
    assert ours[:, 4:, 1:].abs().max() > 1e-3


def test_image_sizes_are_the_official_ones():
    """Where the image decides the size: TI2V best_output_size in 32-px steps (a 16:9 image
    gives 704 x 1248, not 1280), I2V the area at the image's aspect floored to 16 px (numbers
    worked by hand from textimage2video.py / utils.py and image2video.py)."""
    ti2v, i2v = get_pipeline("wan2.2-ti2v-5b"), get_pipeline("wan2.2-i2v-a14b")
    req = Request("x")
    assert wan.output_size(ti2v, req, 1920, 1080) == (704, 1248)
    assert wan.output_size(ti2v, req, 1280, 704) == (704, 1280)
    assert wan.output_size(ti2v, Request("x", height=1280, width=704), 704, 1280) == (1280, 704)
    assert wan.output_size(i2v, req, 1920, 1080) == (720, 1280)
    assert wan.output_size(i2v, req, 1024, 768) == (816, 1104)
    # the official float floor: sqrt(480 * 832 * (480 / 832)) = 479.99999999999994 -> 464 rows
    # for an 832 x 480 image at --size 832*480 (diffusers' example would keep 480)
    assert wan.output_size(i2v, Request("x", height=480, width=832), 832, 480) == (464, 832)
    assert wan.output_size(TI2V, req, 320, 180) == (128, 192)
    assert wan.output_size(I2V, req, 320, 180) == (48, 96)


def test_ti2v_crops_and_i2v_stretches(tmp_path):
    """Official preprocessing, where diffusers differs: TI2V resizes to cover and centre-crops
    (red bands at the far left and right are cut off), I2V stretches the whole image by bicubic
    interpolation on the tensor, without antialiasing: the border columns stay pure red (a
    LANCZOS resize, as diffusers does for both without crop, would blend in the gray)."""
    pixels = torch.full((180, 320, 3), 128, dtype=torch.uint8)
    pixels[:, :10] = pixels[:, -10:] = torch.tensor([255, 0, 0], dtype=torch.uint8)
    image = Image.fromarray(pixels.numpy())
    gray, red = torch.tensor([128 / 127.5 - 1] * 3), torch.tensor([1.0, -1.0, -1.0])
    frame = wan.ti2v_frame(image, 128, 192)
    assert frame.shape == (1, 3, 1, 128, 192)
    for column in (0, -1):
        torch.testing.assert_close(frame[0, :, 0, :, column].mean(1), gray, atol=1 / 255, rtol=0)
    video = wan.i2v_video(image, 48, 96, 9)
    assert video.shape == (1, 3, 9, 48, 96) and not video[:, :, 1:].any()
    for column in (0, -1):
        torch.testing.assert_close(video[0, :, 0, :, column].mean(1), red, atol=1e-6, rtol=0)


# --- speech-to-video ------------------------------------------------------------------------------

def test_s2v_merges_wan_audio(monkeypatch, tmp_path):
    """S2V: text from here (with the S2V default negative prompt), audio and reference latent
    and their config from encoders.wan_audio, whose check runs from check."""
    calls = []
    cfg = S2V.config
    audio = {"audio_embeds": torch.zeros(1, cfg.audio_layers, cfg.audio_dim, 48),
             "ref_latents": torch.zeros(1, S2V.latent_channels, 1, 8, 8)}
    fake = types.SimpleNamespace(
        check=lambda *args: calls.append(("check", args)),
        encode=lambda *args: calls.append(("encode", args)) or (dict(audio), {"num_clips": 3}))
    monkeypatch.setitem(sys.modules, "encoders.wan_audio", fake)
    monkeypatch.setattr(encoders, "wan_audio", fake, raising=False)
    request = Request("a person speaks", audio=str(tmp_path / "speech.wav"))
    wan.check(S2V, request, None)
    assert calls == [("check", (S2V, request, None))]
    tensors, config = wan.encode(S2V, request, None)
    assert calls[1] == ("encode", (S2V, request, None, "cpu"))
    assert config == {"num_clips": 3}
    check_tensors(tensors, S2V.stage1_specs(S2V.latent_shape(64, 64, 16), True, False), "stage 1")
    as_prompt = wan.encode(S2V, Request(wan.S2V_NEGATIVE_PROMPT), None)[0]["prompt_embeds"]
    assert torch.equal(tensors["negative_prompt_embeds"], as_prompt)
    assert not torch.equal(tensors["negative_prompt_embeds"],
                           wan.encode(TI2V, Request("a person speaks"), None)[0]["negative_prompt_embeds"])


# --- refusals -------------------------------------------------------------------------------------

def test_image_refusals(tmp_path):
    refused(lambda: wan.check(TI2V, Request("x", image=str(tmp_path / "none.png")), None),
            "--image", "none.png does not exist")
    (tmp_path / "text.png").write_bytes(b"not an image at all")
    refused(lambda: wan.check(TI2V, Request("x", image=str(tmp_path / "text.png")), None),
            "--image", "cannot be decoded")
    whole = Path(image_file(tmp_path / "whole.png", 64, 64)).read_bytes()
    (tmp_path / "cut.png").write_bytes(whole[: len(whole) // 2])
    refused(lambda: wan.check(TI2V, Request("x", image=str(tmp_path / "cut.png")), None),
            "--image", "cut.png cannot be decoded")
    refused(lambda: wan.check(I2V, Request("x"), None), "--image: is missing",
            "expected the first frame")
    good = image_file(tmp_path / "good.png", 96, 64)
    refused(lambda: wan.check(TI2V, Request("x", image=good, frames=8), None),
            "--video_length", "video_length 8", "4k + 1")
    refused(lambda: wan.check(TI2V, Request("x", image=good, height=128), None),
            "--height: given without --width")
    thin = image_file(tmp_path / "thin.png", 1000, 4)
    refused(lambda: wan.check(TI2V, Request("x", image=thin), None),
            "--image", "1000x4 image has no size")
    refused(lambda: wan.check(TI2V, Request("x", audio=good), None), "--audio: given to wan-tiny-ti2v")


def copy_weights(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_tokenizer_folder_missing_a_file(ti2v_root, official_root, tmp_path):
    root = copy_weights(ti2v_root, tmp_path / "diffusers")
    (root / "tokenizer" / "tokenizer.json").unlink()
    refused(lambda: wan.check(TI2V, Request("x"), root), "tokenizer: lacks tokenizer.json",
            "expected a tokenizer folder")
    root = copy_weights(official_root, tmp_path / "official")
    (root / "google" / "umt5-xxl" / "tokenizer_config.json").unlink()
    refused(lambda: wan.check(TI2V, Request("x"), root), "umt5-xxl: lacks tokenizer_config.json")
    shutil.rmtree(root / "google")
    refused(lambda: wan.check(TI2V, Request("x"), root), "umt5-xxl: is missing")


def test_encoder_of_another_model_is_refused_from_headers(official_root, ti2v_root, tmp_path,
                                                          monkeypatch):
    pth = "models_t5_umt5-xxl-enc-bf16.pth"
    state = torch.load(official_root / pth, weights_only=True)
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: loads.append(kw) or real_load(*a, **kw))

    def official_with(tensors, name):
        root = copy_weights(official_root, tmp_path / name)
        torch.save(tensors, root / pth)
        return root

    dit = official_with({"blocks.0.self_attn.q.weight": torch.zeros(4, 4)}, "dit")
    refused(lambda: wan.check(TI2V, Request("x"), dit), pth, "no tensor 'token_embedding.weight'")
    # a T5 with one position bias shared by all blocks (not umT5): block 1 lacks its own
    t5 = official_with({k: v for k, v in state.items() if k != "blocks.1.pos_embedding.embedding.weight"},
                       "t5")
    refused(lambda: wan.check(TI2V, Request("x"), t5), "missing (1): encoder.block.1.layer.0."
            "SelfAttention.relative_attention_bias.weight", "expected the umT5 encoder's keys")
    wide = official_with({k: torch.zeros([32 if n == 16 else n for n in v.shape])
                          for k, v in state.items()}, "wide")
    refused(lambda: wan.check(TI2V, Request("x"), wide), "umT5 encoder of width 32",
            "expected width 16")
    garbage = copy_weights(official_root, tmp_path / "garbage")
    (garbage / pth).write_bytes(b"\x00" * 64)
    refused(lambda: wan.check(TI2V, Request("x"), garbage), "not a readable PyTorch checkpoint")
    assert loads and all(kw.get("map_location") == "meta" for kw in loads)  # headers only

    t5_folder = copy_weights(ti2v_root, tmp_path / "t5-diffusers")
    shutil.rmtree(t5_folder / "text_encoder")
    transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
        is_encoder_decoder=False)).save_pretrained(str(t5_folder / "text_encoder"))
    refused(lambda: wan.check(TI2V, Request("x"), t5_folder), "model_type 't5'",
            "expected a UMT5EncoderModel")
    from safetensors.torch import load_file, save_file
    bent = copy_weights(ti2v_root, tmp_path / "bent")
    weights = load_file(bent / "text_encoder" / "model.safetensors")
    weights["encoder.block.0.layer.1.DenseReluDense.wo.weight"] = torch.zeros(32, 16)
    save_file(weights, bent / "text_encoder" / "model.safetensors")
    refused(lambda: wan.check(TI2V, Request("x"), bent), "mis-shaped (1): "
            "encoder.block.0.layer.1.DenseReluDense.wo.weight: checkpoint [32, 16], model [16, 32]")


def test_weights_folder_refusals(official_root, ti2v_root, tmp_path):
    refused(lambda: wan.check(TI2V, Request("x"), tmp_path), "holds no umT5 text encoder",
            "models_t5_umt5-xxl-enc-bf16.pth", "text_encoder/")
    image = image_file(tmp_path / "frame.png", 192, 128)
    refused(lambda: wan.check(TI2V, Request("x", image=image), official_root),
            "Wan2.2_VAE.pth: is missing", "expected the wan2.2-vae weights")
    root = copy_weights(ti2v_root, tmp_path / "z8")
    config = (root / "vae" / "config.json").read_text().replace('"z_dim": 4', '"z_dim": 8')
    (root / "vae" / "config.json").write_text(config)
    refused(lambda: wan.check(TI2V, Request("x", image=image), root),
            "holds a VAE (class, z_dim) ('AutoencoderKLWan', 8)", "4 latent channels")

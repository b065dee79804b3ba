"""Stage 1 for HunyuanVideo-1.5 (encoders/hunyuan.py): tiny random encoders in the official and
diffusers layouts against diffusers 0.42.1's HunyuanVideo-1.5 pipelines as the oracle, the
official behaviour where diffusers differs, and the up-front refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from encoders import EncoderInputError, Request, hunyuan
from sampling.pipelines import get_pipeline
from sampling.stage_io import check_tensors

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

T2V = get_pipeline("hunyuanvideo-tiny")  # guidance 6: negatives encoded
I2V = get_pipeline("hunyuanvideo-tiny-meanflow")  # guidance 1: no negatives
# the tiny text length is 10 tokens: SHORT leaves one padded row, PROMPT is truncated
SHORT, NEGATIVE = 'A "hi"', '"wm"'  # negative quotes: the official negative glyph states are zeros
PROMPT = 'A neon sign reads "OPEN" and “café” above a shop, then "OPEN" again'


# --- tiny weights in both layouts ----------------------------------------------------------------

@pytest.fixture(scope="module")
def t2v_diffusers(tmp_path_factory):
    return hunyuan.write_tiny(tmp_path_factory.mktemp("t2v") / "diffusers", T2V)


@pytest.fixture(scope="module")
def i2v_diffusers(tmp_path_factory):
    return hunyuan.write_tiny(tmp_path_factory.mktemp("i2v") / "diffusers", I2V)


def write_official(diffusers_root, root):
    """The same weights in the official release layout: the whole Qwen2.5-VL folder (text decoder
    + a vision tower + lm_head, saved by transformers as the release is), byt5-small's config and
    tokenizer, Glyph-SDXL-v2's assets and byt5_model.pt (T5 encoder keys under
    module.text_tower.encoder.), vision_encoder/siglip/{image_encoder, feature_extractor}."""
    from transformers import (
        ByT5Tokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLTextModel,
        T5Config,
        T5EncoderModel,
    )

    text = Qwen2_5_VLTextModel.from_pretrained(diffusers_root / "text_encoder")
    vision = dict(depth=1, hidden_size=8, intermediate_size=16, num_heads=2, patch_size=2,
                  out_hidden_size=text.config.hidden_size, spatial_merge_size=1,
                  temporal_patch_size=1, fullatt_block_indexes=[0])
    whole = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(text_config=text.config.to_dict(), vision_config=vision))
    whole.model.language_model.load_state_dict(text.state_dict())
    llm = root / "text_encoder" / "llm"
    whole.save_pretrained(llm)
    # the release's config.json is the flat pre-4.52 form: text fields at the top level
    config = json.loads((llm / "config.json").read_text())
    text_fields = {k: v for k, v in config.pop("text_config").items()
                   if k not in ("architectures", "model_type", "rope_parameters", "layer_types")}
    rope = text.config.rope_parameters
    (llm / "config.json").write_text(json.dumps(
        {**config, **text_fields, "rope_theta": rope["rope_theta"],
         "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}))
    for f in (diffusers_root / "tokenizer").iterdir():
        shutil.copy(f, llm / f.name)

    glyph = T5EncoderModel.from_pretrained(diffusers_root / "text_encoder_2")
    small = root / "text_encoder" / "byt5-small"
    T5Config(**{**glyph.config.to_dict(), "vocab_size": 384, "is_encoder_decoder": True,
                "num_decoder_layers": 1}).save_pretrained(small)
    ByT5Tokenizer().save_pretrained(small)
    glyph_root = root / "text_encoder" / "Glyph-SDXL-v2"
    (glyph_root / "assets").mkdir(parents=True)
    (glyph_root / "checkpoints").mkdir()
    (glyph_root / "assets" / "color_idx.json").write_text(json.dumps(hunyuan.TINY_GLYPH_COLORS))
    (glyph_root / "assets" / "multilingual_10-lang_idx.json").write_text(
        json.dumps(hunyuan.TINY_GLYPH_FONTS))
    torch.save({"state_dict": {f"module.text_tower.encoder.{k}": v
                               for k, v in glyph.encoder.state_dict().items()}},
               glyph_root / "checkpoints" / "byt5_model.pt")

    if (diffusers_root / "image_encoder").is_dir():
        siglip = root / "vision_encoder" / "siglip"
        shutil.copytree(diffusers_root / "image_encoder", siglip / "image_encoder")
        shutil.copytree(diffusers_root / "feature_extractor", siglip / "feature_extractor")
        # the VAE folder is modules/vae.py's to read (its official layout is tested there)
        shutil.copytree(diffusers_root / "vae", root / "vae")
    return root


@pytest.fixture(scope="module")
def t2v_official(t2v_diffusers):
    return write_official(t2v_diffusers, t2v_diffusers.parent / "official")


@pytest.fixture(scope="module")
def i2v_official(i2v_diffusers):
    return write_official(i2v_diffusers, i2v_diffusers.parent / "official")


# --- the oracle: diffusers' pipelines on the same weights ------------------------------------------

def diffusers_pipeline(root, pipe, crop):
    """diffusers' HunyuanVideo-1.5 pipeline (t2v or i2v) holding the tiny encoders, with the tiny
    DiT's lengths. crop: diffusers hard-codes 108 (Qwen2.5-VL's); the tiny tokenizer's is given."""
    from transformers import (
        AutoTokenizer,
        ByT5Tokenizer,
        Qwen2_5_VLTextModel,
        SiglipImageProcessor,
        SiglipVisionModel,
        T5EncoderModel,
    )

    from modules.vae import VAES, build_tiny

    parts = dict(text_encoder=Qwen2_5_VLTextModel.from_pretrained(root / "text_encoder"),
                 tokenizer=AutoTokenizer.from_pretrained(root / "tokenizer"),
                 text_encoder_2=T5EncoderModel.from_pretrained(root / "text_encoder_2"),
                 tokenizer_2=ByT5Tokenizer.from_pretrained(root / "tokenizer_2"),
                 transformer=None, scheduler=None, guider=None)
    if pipe.task == "i2v":
        ref = diffusers.HunyuanVideo15ImageToVideoPipeline(
            **parts, vae=diffusers.AutoencoderKLHunyuanVideo15.from_pretrained(root / "vae"),
            image_encoder=SiglipVisionModel.from_pretrained(root / "image_encoder"),
            feature_extractor=SiglipImageProcessor.from_pretrained(root / "feature_extractor"))
    else:  # the t2v pipeline needs a VAE object to construct; the prompt path never uses it
        ref = diffusers.HunyuanVideo15Pipeline(
            **parts, vae=build_tiny(VAES["hunyuanvideo-1.5-vae"], pipe.latent_channels))
    cfg = pipe.config
    ref.tokenizer_max_length, ref.tokenizer_2_max_length = cfg.text_len, cfg.byt5_len
    ref.prompt_template_encode_start_idx = crop
    return ref


def assert_text_matches(tensors, prefix, theirs, *, padded):
    """Equal masks; equal real rows; padded rows zero in ours (Qwen runs on the real tokens only,
    see test_padded_rows_do_not_reach_the_dit) where diffusers keeps what Qwen gave there."""
    embeds, mask = tensors[f"{prefix}prompt_embeds"], tensors[f"{prefix}prompt_embeds_mask"]
    assert torch.equal(mask, theirs[1].long())
    real = mask[0].bool()
    assert real.any() and bool((~real).any()) == padded  # the case covers what it should
    torch.testing.assert_close(embeds[:, real], theirs[0][:, real].float(), rtol=1e-5, atol=1e-6)
    assert not embeds[:, ~real].any()


@pytest.mark.parametrize("layout", ["official", "diffusers"])
def test_text_matches_diffusers(layout, request):
    """Prompt and negative: Qwen states, masks and glyph states equal diffusers' encode_prompt on
    the same weights, for a padded and a truncated prompt."""
    root = request.getfixturevalue(f"t2v_{layout}")
    tokenizer = root / ("tokenizer" if layout == "diffusers" else "text_encoder/llm")
    crop = hunyuan.crop_start(transformers.AutoTokenizer.from_pretrained(tokenizer))
    ref = diffusers_pipeline(request.getfixturevalue("t2v_diffusers"), T2V, crop)
    specs = T2V.stage1_specs(T2V.latent_shape(*T2V.size), True, False)
    for prompt, negative, padded in [(SHORT, NEGATIVE, True), (PROMPT, None, False)]:
        tensors, config = hunyuan.encode(T2V, Request(prompt, negative_prompt=negative), str(root),
                                         dtype=torch.float32)
        assert config == {}
        check_tensors(tensors, specs, "stage 1")
        with torch.no_grad():
            pos = ref.encode_prompt(prompt, device="cpu", dtype=torch.float32)
            neg = ref.encode_prompt(negative or "", device="cpu", dtype=torch.float32)
        assert_text_matches(tensors, "", pos, padded=padded)
        assert_text_matches(tensors, "negative_", neg, padded=True)
        assert tensors["prompt_embeds_mask_2"].any()
        torch.testing.assert_close(tensors["prompt_embeds_2"], pos[2], rtol=1e-5, atol=1e-6)
        assert torch.equal(tensors["prompt_embeds_mask_2"], pos[3].long())
        # official: the negative glyph input is "" whatever the negative prompt quotes (where
        # diffusers encodes the quote: the quoted negative is the case where they differ)
        assert not tensors["negative_prompt_embeds_2"].any()
        assert not tensors["negative_prompt_embeds_mask_2"].any()
        assert bool(neg[3].any()) == (negative is not None)


def test_no_quotes_gives_zero_glyph_states(t2v_diffusers):
    tensors, _ = hunyuan.encode(T2V, Request("A cat walks on the grass."), str(t2v_diffusers))
    assert not tensors["prompt_embeds_2"].any() and not tensors["prompt_embeds_mask_2"].any()
    assert tensors["negative_prompt_embeds_mask"].any()  # "" -> " " still keeps its template tail


def test_glyph_text_as_diffusers_formats_it():
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import extract_glyph_texts

    for prompt in [PROMPT, "no quotes", 'one "a"', '"a" and "a" and “b”', 'empty ""', "“x” only"]:
        assert hunyuan.glyph_text(prompt) == extract_glyph_texts(prompt), prompt


def test_template_and_crop_start(t2v_diffusers):
    """The system message is the official one byte for byte (diffusers copies it), and the crop
    keeps the prompt and the assistant header: crop_start is right after `<|im_start|>user\\n`."""
    ref = diffusers_pipeline(t2v_diffusers, T2V, 0)
    assert hunyuan.SYSTEM_MESSAGE == ref.system_message
    tokenizer = transformers.AutoTokenizer.from_pretrained(t2v_diffusers / "tokenizer")
    crop = hunyuan.crop_start(tokenizer)
    ids = tokenizer.apply_chat_template(hunyuan.conversation("A cat"), add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    assert tokenizer.decode(ids[:crop]).endswith("<|im_end|>\n<|im_start|>user\n")
    assert tokenizer.decode(ids[crop:]) == "A cat<|im_end|>\n<|im_start|>assistant\n"
    tensors, _ = hunyuan.encode(T2V, Request("A cat"), str(t2v_diffusers))
    assert int(tensors["prompt_embeds_mask"].sum()) == len(ids) - crop


def test_padded_rows_do_not_reach_the_dit(t2v_diffusers):
    """Why the padded Qwen rows may be zeros: the DiT's output is the same with diffusers' rows."""
    from tests.model_inputs import random_model

    tensors, _ = hunyuan.encode(T2V, Request(SHORT), str(t2v_diffusers), dtype=torch.float32)
    ref = diffusers_pipeline(t2v_diffusers, T2V, hunyuan.crop_start(
        transformers.AutoTokenizer.from_pretrained(t2v_diffusers / "tokenizer")))
    with torch.no_grad():
        theirs = ref.encode_prompt(SHORT, device="cpu", dtype=torch.float32)[0]
    assert not torch.equal(theirs, tensors["prompt_embeds"])
    model = random_model("hunyuanvideo-tiny").eval()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 3, 4, 5, generator=gen)
    kw = dict(t=torch.tensor([500.0]), text_mask=tensors["prompt_embeds_mask"],
              byt5=tensors["prompt_embeds_2"], byt5_mask=tensors["prompt_embeds_mask_2"], i2v=False)
    with torch.no_grad():
        assert torch.equal(model(x, text=tensors["prompt_embeds"], **kw), model(x, text=theirs, **kw))


# --- image to video -----------------------------------------------------------------------------------

def save_image(path, width, height, seed=0):
    from PIL import Image
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(path)
    return str(path)


@pytest.mark.parametrize("layout", ["official", "diffusers"])
def test_image_matches_diffusers(layout, request, tmp_path):
    """A 5:4 image: official and diffusers agree on its bucket (64 x 80) and crop."""
    from PIL import Image

    root = request.getfixturevalue(f"i2v_{layout}")
    image = save_image(tmp_path / "first.png", 160, 128)
    tensors, config = hunyuan.encode(I2V, Request("A cat", image=image), str(root),
                                     dtype=torch.float32)
    assert config == {"height": 64, "width": 80, "video_length": I2V.size[2]}
    assert not any(k.startswith("negative_") for k in tensors)  # guidance 1
    ref = diffusers_pipeline(request.getfixturevalue("i2v_diffusers"), I2V, 0)
    pil = Image.open(image).convert("RGB")
    height, width = ref.video_processor.calculate_default_height_width(
        pil.height, pil.width, target_size=hunyuan.bucket_base(I2V))
    assert (height, width) == (64, 80)
    pil = ref.video_processor.resize(pil, height=height, width=width, resize_mode="crop")
    with torch.no_grad():
        embeds = ref.encode_image(pil, batch_size=1, device="cpu", dtype=torch.float32)
        latents = ref._get_image_latents(ref.vae, ref.video_processor, pil, height, width, "cpu")
    torch.testing.assert_close(tensors["image_embeds"], embeds, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tensors["image_latents"], latents, rtol=1e-5, atol=1e-6)
    latent_shape = I2V.latent_shape(config["height"], config["width"], config["video_length"])
    check_tensors(tensors, I2V.stage1_specs(latent_shape, False, True), "stage 1")


def test_image_bucket_and_crop_are_official(i2v_diffusers, tmp_path):
    """A 100 x 67 image (h/w 0.67): the official nearest-ratio bucket is 48 x 80 (ratio 0.6);
    diffusers looks only at ratios >= 0.67 and would take 64 x 80. The official crop: LANCZOS to
    80 x 53.6 rounded to 80 x 54 (diffusers floors to 53), then rows 3..51 (top round(3.0))."""
    from PIL import Image

    image = save_image(tmp_path / "wide.png", 100, 67)
    tensors, config = hunyuan.encode(I2V, Request("A cat", image=image), str(i2v_diffusers),
                                     dtype=torch.float32)
    assert (config["height"], config["width"]) == (48, 80)
    ref = diffusers_pipeline(i2v_diffusers, I2V, 0)
    assert ref.video_processor.calculate_default_height_width(67, 100, 72) == (64, 80)
    original = Image.open(image).convert("RGB")
    crop = original.resize((80, 54), Image.LANCZOS).crop((0, 3, 80, 51))
    theirs = ref.video_processor.resize(original, height=48, width=80, resize_mode="crop")
    assert theirs.tobytes() != crop.tobytes()  # the crops differ: the case checks which one we take
    with torch.no_grad():
        latents = ref._get_image_latents(ref.vae, ref.video_processor, crop, 48, 80, "cpu")
        embeds = ref.encode_image(crop, batch_size=1, device="cpu", dtype=torch.float32)
    torch.testing.assert_close(tensors["image_latents"], latents, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tensors["image_embeds"], embeds, rtol=1e-5, atol=1e-6)


def test_real_bucket_bases():
    """480p and 720p buckets come from base 640 and 960 (official target_size_config), and the
    16:9 bucket of each is the pipeline's default size."""
    for name, base, size in [("hunyuanvideo-1.5-480p_i2v", 640, (480, 848)),
                             ("hunyuanvideo-1.5-720p_i2v", 960, (720, 1280))]:
        pipe = get_pipeline(name)
        assert hunyuan.bucket_base(pipe) == base
        assert hunyuan.image_size(1920, 1080, base) == size == pipe.size[:2]


# --- the tiny default ----------------------------------------------------------------------------------

def test_tiny_default_is_deterministic(t2v_diffusers, tmp_path):
    """weights=None: the same files every build, loaded as any folder; stage 2 accepts them."""
    again = hunyuan.write_tiny(tmp_path / "again", T2V)
    for f in sorted(p for p in t2v_diffusers.rglob("*") if p.is_file()):
        assert (again / f.relative_to(t2v_diffusers)).read_bytes() == f.read_bytes(), f
    ours, _ = hunyuan.encode(T2V, Request(PROMPT), None)
    # a folder runs in the official dtypes unless told (bf16 on a CPU); the tiny default in fp32
    theirs, _ = hunyuan.encode(T2V, Request(PROMPT), str(t2v_diffusers), dtype=torch.float32)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


# --- refusals: before any model work, one line naming what and what was expected --------------------

def _break_tokenizer(root):
    (root / "tokenizer" / "tokenizer.json").unlink()


def _break_tokenizer_2(root):
    (root / "tokenizer_2" / "tokenizer_config.json").unlink()


def _t5_as_qwen(root):
    shutil.rmtree(root / "text_encoder")
    shutil.copytree(root / "text_encoder_2", root / "text_encoder")


def _qwen_too_narrow(root):
    path = root / "text_encoder" / "config.json"
    config = json.loads(path.read_text())
    config["hidden_size"] = 32
    path.write_text(json.dumps(config))


def _qwen_shards_of_another(root):  # config says Qwen, the weights are the T5's
    for f in (root / "text_encoder").glob("*.safetensors"):
        f.unlink()
    shutil.copy(next((root / "text_encoder_2").glob("*.safetensors")), root / "text_encoder")


def _glyph_of_another(root):
    path = root / "text_encoder" / "Glyph-SDXL-v2" / "checkpoints" / "byt5_model.pt"
    torch.save({"state_dict": {"module.text_tower.encoder.embed_tokens.weight": torch.zeros(9, 8)}},
               path)


def _siglip_other_tokens(root):
    path = root / "image_encoder" / "config.json"
    config = json.loads(path.read_text())
    config["image_size"] = 42  # 9 tokens
    path.write_text(json.dumps(config))


def _vae_other(root):
    path = root / "vae" / "config.json"
    config = json.loads(path.read_text())
    config["latent_channels"] = 32
    path.write_text(json.dumps(config))


CASES = [  # (pipeline, layout, break, request, needles)
    (T2V, "diffusers", _break_tokenizer, {}, ["tokenizer/vocab.json", "is missing",
                                              "expected the Qwen2.5-VL tokenizer folder"]),
    (T2V, "diffusers", _break_tokenizer_2, {}, ["tokenizer_2/tokenizer_config.json", "is missing"]),
    (T2V, "diffusers", _t5_as_qwen, {}, ["describes a 't5' model", "expected Qwen2.5-VL"]),
    (T2V, "diffusers", _qwen_too_narrow, {}, ["hidden size 32", "expected hidden size 16"]),
    (T2V, "diffusers", _qwen_shards_of_another, {}, ["does not fit its config", "missing"]),
    (T2V, "official", _glyph_of_another, {}, ["byt5_model.pt", "does not fit its config",
                                              "encoder.embed_tokens.weight [9, 8] (model [389, 8])"]),
    (I2V, "diffusers", _siglip_other_tokens, {}, ["giving 9 tokens", "expected width 12 and 4 tokens"]),
    (I2V, "diffusers", _vae_other, {}, ["vae/config.json", "32 latent channels", "of 4 latent"]),
    (I2V, "diffusers", None, {"image": "missing.png"}, ["--image", "does not exist"]),
    (I2V, "diffusers", None, {"image": "garbage.png"}, ["--image", "cannot be decoded"]),
    (I2V, "diffusers", None, {}, ["--image: missing for the image-to-video"]),
    (T2V, "diffusers", None, {"image": "ok.png"}, ["--image: given for the text-to-video"]),
    (T2V, "diffusers", None, {"audio": "speech.wav"}, ["--audio", "only S2V"]),
    (T2V, "diffusers", None, {"height": 70}, ["--height: 70", "multiple of 16"]),
    (T2V, "diffusers", None, {"frames": 6}, ["--video_length: 6", "4k + 1 frames"]),
    (T2V, "nowhere", None, {}, ["does not exist", "official layout"]),
    (get_pipeline("hunyuanvideo-1.5-480p_t2v"), None, None, {},
     ["encoder weights: not given for hunyuanvideo-1.5-480p_t2v", "tiny random encoders exist only"]),
]


def _no_model(*args, **kwargs):
    pytest.fail("a model was loaded before the refusal")


@pytest.mark.parametrize("pipe, layout, breaks, fields, needles", CASES,
                         ids=[f"{i}-{c[2].__name__ if c[2] else list(c[3]) or c[1]}"
                              for i, c in enumerate(CASES)])
def test_refusals(pipe, layout, breaks, fields, needles, request, tmp_path, monkeypatch):
    weights = None
    if layout in ("official", "diffusers"):
        source = request.getfixturevalue(f"{'i2v' if pipe is I2V else 't2v'}_{layout}")
        weights = tmp_path / "weights"
        shutil.copytree(source, weights)
        if breaks is not None:
            breaks(weights)
    elif layout == "nowhere":
        weights = tmp_path / "nowhere"
    save_image(tmp_path / "ok.png", 160, 128)
    (tmp_path / "garbage.png").write_bytes(b"not an image at all")
    fields = {k: str(tmp_path / v) if k in ("image", "audio") else v for k, v in fields.items()}
    if pipe is I2V and "image" not in fields and breaks is not None:
        fields["image"] = str(tmp_path / "ok.png")
    for loader in ("load_mllm", "load_byt5", "load_siglip", "load_vae"):
        monkeypatch.setattr(hunyuan, loader, _no_model)  # refused before any model loads
    with pytest.raises(EncoderInputError) as exc:
        hunyuan.encode(pipe, Request("A cat", **fields), None if weights is None else str(weights))
    message = str(exc.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message

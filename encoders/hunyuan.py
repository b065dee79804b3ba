"""HunyuanVideo-1.5 stage 1: the Qwen2.5-VL prompt states, the ByT5 glyph states of the prompt's
quoted text, and for i2v the SigLIP image states and the first-frame VAE latent, computed as the
official pipeline does (Tencent-Hunyuan/HunyuanVideo-1.5@60783e7, `hyvideo/pipelines/
hunyuan_video_pipeline.py` and `hyvideo/models/{text_encoders,vision_encoder}/`).

    prompt_embeds [1, text_len, text_dim], _mask   Qwen2.5-VL hidden_states[-3] of the chat template
                                                   (system message + prompt), template rows cropped
    prompt_embeds_2 [1, byt5_len, byt5_dim], _mask_2   ByT5 on `Text "<quoted>". ...`; zeros if none
    negative_ twins                                only when the pipeline uses CFG (guidance != 1);
                                                   negative glyph states are always zeros (official)
    image_embeds [1, vision_len, vision_dim]       i2v: SigLIP last_hidden_state
    image_latents [1, C, 1, H/16, W/16]            i2v: HY VAE mode() x scaling_factor

Layouts of `weights` (the folder holding the encoders):
    official   text_encoder/llm/ (the whole Qwen2.5-VL-7B-Instruct: config, shards, tokenizer),
               text_encoder/byt5-small/ (config + tokenizer), text_encoder/Glyph-SDXL-v2/
               {assets/color_idx.json, assets/multilingual_10-lang_idx.json,
               checkpoints/byt5_model.pt}, vision_encoder/siglip/{image_encoder, feature_extractor}/,
               vae/
    diffusers  text_encoder/ (Qwen2_5_VLTextModel), tokenizer/, text_encoder_2/ (T5EncoderModel with
               the glyph weights), tokenizer_2/ (ByT5 + colour and font tokens), image_encoder/,
               feature_extractor/, vae/ (hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-*)

Where diffusers 0.42.1 differs from the official code, this module does what the official code
does: `crop_start` is computed from the tokenizer (diffusers hard-codes 108); the negative glyph
states are zeros (diffusers encodes the negative prompt's quotes); the i2v size is the bucket of
nearest aspect ratio (diffusers only looks on one side of the image's ratio); the image is resized
to cover the bucket with rounded sizes and centre-cropped (diffusers floors).

One deliberate saving: Qwen runs on the real tokens only and the padded rows are zeros. Qwen is
causal with right padding, so the real rows are exactly what the padded run gives, and the DiT
masks the padded rows out (its output does not change with them); a short prompt then costs about
a tenth of the official 1108-token run on a CPU.
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .request import EncoderInputError, Request

# --- the official preprocessing constants ---------------------------------------------------------

# PROMPT_TEMPLATE_ENCODE_VIDEO_JSON's system message (data_type "video", t2v and i2v). The official
# source writes it with backslash continuations, so each numbered item follows 8 spaces: kept byte
# for byte (another spelling tokenises differently and shifts the crop).
SYSTEM_MESSAGE = (
    "You are a helpful assistant. Describe the video by detailing the following aspects: "
    "        1. The main content and theme of the video. "
    "        2. The color, shape, size, texture, quantity, text, and spatial relationships of the "
    "objects. "
    "        3. Actions, events, behaviors temporal relationships, physical movement changes of the "
    "objects. "
    "        4. background environment, light, style and atmosphere. "
    "        5. camera angles, movements, and transitions used in the video.")
USER_MARKER = "<|im_start|>user\n"  # the prompt starts after it (official calculate_crop_start)
CROP_PROBE = "a photo of a cat"  # the dummy prompt the official encoder computes crop_start with
CROP_PROBE_TOKENS = 256  # ... truncated at this many tokens
HIDDEN_STATE_SKIP = 2  # hidden_states[-(2 + 1)], no final norm
DEFAULT_NEGATIVE_PROMPT = ""  # official encode_prompt; the template turns "" into " "
GLYPH_QUOTES = re.compile(r"\"(.*?)\"|“(.*?)”")
GLYPH_COLOR_ASSET = "color_idx.json"
GLYPH_FONT_ASSET = "multilingual_10-lang_idx.json"
GLYPH_PREFIX = "module.text_tower.encoder."  # keys of Glyph-SDXL-v2's byt5_model.pt
BUCKET_STRIDE = 16
# target_size_config: bucket base size per resolution (480p: 640, 720p: 960)
BUCKET_BASE = {(480, 848): 640, (720, 1280): 960}

# Official dtypes (stage1_encoders.md trap 13): Qwen and SigLIP fp16, ByT5 fp32, VAE under fp16
# autocast. On a CPU fp16 matmuls are slow: bf16 there, and the VAE in fp32.
_OFFICIAL_DTYPES = {"mllm": torch.float16, "byt5": torch.float32, "siglip": torch.float16,
                    "vae": torch.float16}
_CPU_DTYPES = {"mllm": torch.bfloat16, "byt5": torch.float32, "siglip": torch.bfloat16,
               "vae": torch.float32}


@dataclass(frozen=True)
class _Layout:
    """Where each part of the encoders lives, relative to the weights folder."""

    name: str
    mllm: str  # Qwen config + weights
    mllm_tokenizer: str
    byt5: str  # diffusers: the T5EncoderModel folder; official: Glyph-SDXL-v2's checkpoint file
    byt5_config: str  # the folder of the T5 config.json
    byt5_tokenizer: str
    glyph_assets: str | None  # official: the colour and font lists added to the ByT5 tokenizer
    image_encoder: str
    feature_extractor: str
    vae: str


OFFICIAL = _Layout("official", "text_encoder/llm", "text_encoder/llm",
                   "text_encoder/Glyph-SDXL-v2/checkpoints/byt5_model.pt", "text_encoder/byt5-small",
                   "text_encoder/byt5-small", "text_encoder/Glyph-SDXL-v2/assets",
                   "vision_encoder/siglip/image_encoder", "vision_encoder/siglip/feature_extractor",
                   "vae")
DIFFUSERS = _Layout("diffusers", "text_encoder", "tokenizer", "text_encoder_2", "text_encoder_2",
                    "tokenizer_2", None, "image_encoder", "feature_extractor", "vae")


# --- prompt pieces (no model) ---------------------------------------------------------------------

def conversation(prompt: str) -> list[dict]:
    """The official chat: system message, then the prompt (" " when empty)."""
    return [{"role": "system", "content": SYSTEM_MESSAGE},
            {"role": "user", "content": prompt if prompt else " "}]


def glyph_text(prompt: str) -> str | None:
    """The ByT5 input: every quoted span as `Text "<span>". `, de-duplicated in order when there
    are several (official _extract_glyph_texts + MultilingualPromptFormat with no styles); None
    when the prompt quotes nothing."""
    spans = [a or b for a, b in GLYPH_QUOTES.findall(prompt)]
    if len(spans) > 1:
        spans = list(dict.fromkeys(spans))
    return "".join(f'Text "{span}". ' for span in spans) if spans else None


def crop_start(tokenizer) -> int:
    """Index of the first prompt token in the templated input: just after `<|im_start|>user\\n`
    in the probe prompt's tokens (official `calculate_crop_start`; 108 for Qwen2.5-VL). The
    official code silently falls back to 0 when the marker is not found (stage1_encoders.md
    trap 4): refused here."""
    ids = tokenizer.apply_chat_template(
        conversation(CROP_PROBE), add_generation_prompt=True, tokenize=True, return_dict=True,
        truncation=True, max_length=CROP_PROBE_TOKENS, padding="max_length")["input_ids"]
    marker = tokenizer(USER_MARKER, add_special_tokens=False)["input_ids"]
    for i in range(len(ids) - len(marker) + 1):
        if ids[i: i + len(marker)] == marker:
            return i + len(marker)
    raise ValueError(f"the chat template's {USER_MARKER!r} is not within the first "
                     f"{CROP_PROBE_TOKENS} tokens of the templated prompt")


# --- image geometry (no model) ----------------------------------------------------------------------

def bucket_base(pipeline) -> int:
    """The bucket base size of a pipeline's resolution (official target_size_config); for other
    sizes sqrt(H x W) rounded to a multiple of 8, which gives 640 and 960 for 480p and 720p too."""
    height, width = pipeline.size[:2]
    return BUCKET_BASE.get((height, width), round(math.sqrt(height * width) / 8) * 8)


def crop_size_list(base: int, stride: int = BUCKET_STRIDE, max_ratio: float = 4.0):
    """(height, width) buckets of about base^2 pixels (official generate_crop_size_list)."""
    patches = round((base / stride) ** 2)
    sizes, wp, hp = [], patches, 1
    while wp > 0:
        if max(wp, hp) / min(wp, hp) <= max_ratio:
            sizes.append((wp * stride, hp * stride))
        if (hp + 1) * wp <= patches:
            hp += 1
        else:
            wp -= 1
    return sizes


def image_size(width: int, height: int, base: int) -> tuple[int, int]:
    """(H, W) of the bucket whose h/w ratio is nearest the image's, the first on a tie (official
    get_closest_ratio; diffusers only considers one side of the ratio)."""
    buckets = crop_size_list(base)
    ratios = [round(h / w, 5) for h, w in buckets]
    aspect = height / width
    best = min(range(len(buckets)), key=lambda i: abs(ratios[i] - aspect))
    return buckets[best]


def cover_crop(image, height: int, width: int):
    """The image LANCZOS-resized to cover (height, width) with rounded sizes, centre-cropped
    (official resize_and_center_crop for SigLIP and the Resize + CenterCrop of the VAE input:
    both crop the same box)."""
    from PIL import Image

    if image.size == (width, height):
        return image
    scale = max(width / image.width, height / image.height)
    size = (int(round(image.width * scale)), int(round(image.height * scale)))
    resized = image.resize(size, Image.LANCZOS)
    left, top = int(round((size[0] - width) / 2.0)), int(round((size[1] - height) / 2.0))
    return resized.crop((left, top, left + width, top + height))


def open_image(path: str):
    """The request's image as RGB, decoded in full; EncoderInputError when it cannot be."""
    from PIL import Image, UnidentifiedImageError

    if not os.path.isfile(path):
        raise EncoderInputError("--image", f"{path} does not exist" if not os.path.exists(path)
                                else f"{path} is not a file", "an image file (PNG, JPEG, WebP, ...)")
    try:
        with Image.open(path) as img:
            img.load()
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise EncoderInputError("--image", f"{path} cannot be decoded ({type(exc).__name__}: "
                                f"{' '.join(str(exc).split())})",
                                "an image file PIL can read (PNG, JPEG, WebP, ...)") from None


# --- checks before any model work ---------------------------------------------------------------------

def layout_of(weights) -> _Layout:
    root = Path(weights)
    if not root.is_dir():
        raise EncoderInputError(str(weights), "is not a folder" if root.exists() else
                                "does not exist", "a folder of HunyuanVideo-1.5 encoders in the "
                                "official layout (text_encoder/llm/, ...) or diffusers layout "
                                "(text_encoder/, tokenizer/, ...)")
    if (root / OFFICIAL.mllm).is_dir():
        return OFFICIAL
    if (root / DIFFUSERS.mllm / "config.json").is_file():
        return DIFFUSERS
    raise EncoderInputError(str(weights), "holds neither text_encoder/llm/ nor text_encoder/"
                            "config.json", "the official layout (text_encoder/llm/, "
                            "text_encoder/byt5-small/, text_encoder/Glyph-SDXL-v2/, ...) or the "
                            "diffusers layout (text_encoder/, tokenizer/, text_encoder_2/, ...)")


def _read_json(path: Path, expected: str) -> dict:
    if not path.is_file():
        raise EncoderInputError(str(path), "is missing", expected)
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise EncoderInputError(str(path), f"is not readable JSON ({type(exc).__name__}: "
                                f"{' '.join(str(exc).split())})", expected) from None
    if not isinstance(value, dict):
        raise EncoderInputError(str(path), f"holds a {type(value).__name__}", expected)
    return value


def _tokenizer_files(folder: Path, what: str, *, chat: bool) -> None:
    """The files a tokenizer folder needs: tokenizer_config.json, and for Qwen the vocabulary
    (tokenizer.json, or vocab.json + merges.txt) and a chat template."""
    expected = f"the {what} tokenizer folder"
    if not folder.is_dir():
        raise EncoderInputError(str(folder), "does not exist", expected)
    config = _read_json(folder / "tokenizer_config.json", f"{expected}'s tokenizer_config.json")
    if not chat:
        return
    if not (folder / "tokenizer.json").is_file():
        for name in ("vocab.json", "merges.txt"):
            if not (folder / name).is_file():
                raise EncoderInputError(str(folder / name), "is missing (and there is no "
                                        "tokenizer.json)", f"{expected} with tokenizer.json, or "
                                        "vocab.json and merges.txt")
    if not (isinstance(config.get("chat_template"), str | list)
            or any((folder / n).is_file() for n in ("chat_template.jinja", "chat_template.json"))):
        raise EncoderInputError(str(folder), "has no chat template (no chat_template.jinja, "
                                "chat_template.json or tokenizer_config.json chat_template)",
                                f"{expected} with the Qwen2.5-VL chat template")


def _load_pickle(path: Path, what: str) -> dict[str, torch.Tensor]:
    """A .pt/.pth/.bin state dict, memory-mapped (tensor data is read only when used), unwrapped
    from a training checkpoint's "state_dict"."""
    expected = f"the {what} checkpoint"
    if not path.is_file():
        raise EncoderInputError(str(path), "is missing", expected)
    try:
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError as exc:  # a pre-1.6 (non-zip) file cannot be memory-mapped
            if "mmap" not in str(exc):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable pickle is the same user error
        raise EncoderInputError(str(path), f"is not a readable checkpoint ({type(exc).__name__}: "
                                f"{' '.join(str(exc).split())[:200]})", expected) from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise EncoderInputError(str(path), "holds no state dict of tensors", expected)
    return state


def _stored_shapes(path: Path, what: str) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from safetensors headers or a pickle's index, without reading
    tensor data."""
    from modules.checkpoint import CheckpointError, checkpoint_files, read_header

    if path.suffix in (".pt", ".pth", ".bin"):
        return {k: tuple(v.shape) for k, v in _load_pickle(path, what).items()}
    try:
        shapes = {}
        for file in checkpoint_files(path):
            shapes.update({k: info.shape for k, info in read_header(file).items()})
        return shapes
    except CheckpointError as exc:
        raise EncoderInputError(str(path), str(exc), f"the {what} checkpoint (safetensors)") from None


def _compare(where: str, what: str, expected: dict, stored: dict) -> None:
    """Refuse a checkpoint whose tensors do not match the model built from its config."""
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    misshaped = sorted(f"{k} {list(stored[k])} (model {list(expected[k])})"
                       for k in set(expected) & set(stored) if tuple(stored[k]) != tuple(expected[k]))
    if missing or unexpected or misshaped:
        parts = [f"{title} {len(items)}: {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}"
                 for title, items in (("missing", missing), ("unexpected", unexpected),
                                      ("mis-shaped", misshaped)) if items]
        raise EncoderInputError(where, f"does not fit its config ({'; '.join(parts)})",
                                f"the {what} checkpoint its config.json describes")


def _hf_load(load, path: Path, expected: str):
    """`load(str(path))` (a transformers from_pretrained of a config or tokenizer), any failure
    refused as one line."""
    try:
        return load(str(path))
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad file
        raise EncoderInputError(str(path), f"cannot be loaded ({type(exc).__name__}: "
                                f"{' '.join(str(exc).split())[:200]})", expected) from None


def _meta_shapes(model_cls, config) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = model_cls(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _strip(key: str, prefixes) -> str:
    for prefix in prefixes:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


# Qwen text-decoder keys as stored: the release (model.layers.*, visual.*, lm_head.*), newer
# composite saves (model.language_model.*), the diffusers text_encoder (layers.*).
_QWEN_PREFIXES = ("model.language_model.", "language_model.", "model.")
_QWEN_OTHER = ("visual.", "model.visual.", "lm_head.")


def _mllm_config(folder: Path, pipeline):
    """The Qwen2.5-VL text config of a folder, refused unless it is one of the pipeline's width."""
    raw = _read_json(folder / "config.json", "the Qwen2.5-VL-7B-Instruct config.json")
    kind = raw.get("model_type")
    if kind not in ("qwen2_5_vl", "qwen2_5_vl_text"):
        raise EncoderInputError(str(folder / "config.json"), f"describes a {kind!r} model",
                                "Qwen2.5-VL (model_type qwen2_5_vl or qwen2_5_vl_text)")
    from transformers import AutoConfig
    config = _hf_load(AutoConfig.from_pretrained, folder, "a Qwen2.5-VL config.json")
    text = getattr(config, "text_config", config)
    want = pipeline.config.text_dim
    if text.hidden_size != want or text.num_hidden_layers <= HIDDEN_STATE_SKIP:
        raise EncoderInputError(str(folder / "config.json"), f"describes a Qwen of hidden size "
                                f"{text.hidden_size} with {text.num_hidden_layers} layers",
                                f"hidden size {want} (the {pipeline.name} DiT reads {want}-wide text "
                                f"states) and more than {HIDDEN_STATE_SKIP} layers")
    return text


def _check_mllm(folder: Path, pipeline, tokenizer) -> None:
    from transformers import Qwen2_5_VLTextModel

    text = _mllm_config(folder, pipeline)
    stored = {_strip(k, _QWEN_PREFIXES): v for k, v in _stored_shapes(folder, "Qwen2.5-VL").items()
              if not k.startswith(_QWEN_OTHER)}
    _compare(str(folder), "Qwen2.5-VL text", _meta_shapes(Qwen2_5_VLTextModel, text), stored)
    if len(tokenizer) > text.vocab_size:
        raise EncoderInputError(str(folder), f"embeds {text.vocab_size} tokens but its tokenizer "
                                f"has {len(tokenizer)}", "a tokenizer of the same Qwen")


def _byt5_config(layout: _Layout, root: Path, pipeline=None):
    """byt5-small's T5 config (refused unless a T5 of the pipeline's glyph width, if given)."""
    folder = root / layout.byt5_config
    raw = _read_json(folder / "config.json", "the byt5-small (T5) config.json")
    if raw.get("model_type") != "t5":
        raise EncoderInputError(str(folder / "config.json"), f"describes a "
                                f"{raw.get('model_type')!r} model", "a T5 (byt5-small) config")
    from transformers import T5Config
    config = _hf_load(T5Config.from_pretrained, folder, "a T5 (byt5-small) config.json")
    want = config.d_model if pipeline is None else pipeline.config.byt5_dim
    if config.d_model != want:
        raise EncoderInputError(str(folder / "config.json"), f"describes a T5 of width "
                                f"{config.d_model}", f"width {want} (the {pipeline.name} DiT reads "
                                f"{want}-wide glyph states)")
    return config


def _glyph_tokens(assets: Path) -> list[str]:
    """The colour and font tokens Glyph-SDXL-v2 adds to the ByT5 tokenizer (official
    add_special_token, multilingual): <color-i> for each colour, <xx-font-i> for each font."""
    colors = _read_json(assets / GLYPH_COLOR_ASSET, "Glyph-SDXL-v2's colour index")
    fonts = _read_json(assets / GLYPH_FONT_ASSET, "Glyph-SDXL-v2's multilingual font index")
    return ([f"<color-{i}>" for i in range(len(colors))]
            + [f"<{code[:2]}-font-{fonts[code]}>" for code in fonts])


def glyph_to_t5(state: dict) -> dict:
    """Glyph-SDXL-v2's byt5_model.pt entries (T5 encoder-stack keys under GLYPH_PREFIX, or already
    stripped as the official loader strips them) in T5EncoderModel names, the embedding shared."""
    glyph = {k[len(GLYPH_PREFIX):]: v for k, v in state.items() if k.startswith(GLYPH_PREFIX)}
    out = {"encoder." + k: v for k, v in (glyph or state).items()}
    if "encoder.embed_tokens.weight" in out:
        out["shared.weight"] = out["encoder.embed_tokens.weight"]
    return out


def _byt5_stored(layout: _Layout, root: Path) -> dict[str, tuple[int, ...]]:
    """ByT5 encoder tensor shapes in T5EncoderModel names."""
    shapes = _stored_shapes(root / layout.byt5, "ByT5 glyph encoder")
    return shapes if layout is DIFFUSERS else glyph_to_t5(shapes)


def _check_byt5(layout: _Layout, root: Path, pipeline, tokenizer) -> None:
    from transformers import T5EncoderModel

    config = _byt5_config(layout, root, pipeline)
    stored = _byt5_stored(layout, root)
    config.vocab_size = len(tokenizer)  # official: embedding resized to the glyph tokenizer
    expected = _meta_shapes(T5EncoderModel, config)
    if "shared.weight" in stored or "encoder.embed_tokens.weight" in stored:  # tied: one may be saved
        tied = stored.get("shared.weight", stored.get("encoder.embed_tokens.weight"))
        stored = {**stored, "shared.weight": tied, "encoder.embed_tokens.weight": tied}
    _compare(str(root / layout.byt5), "ByT5 glyph", expected, stored)


def _check_siglip(layout: _Layout, root: Path, pipeline) -> None:
    from transformers import SiglipVisionConfig, SiglipVisionModel

    folder = root / layout.image_encoder
    raw = _read_json(folder / "config.json", "the SigLIP image encoder's config.json")
    if raw.get("model_type") != "siglip_vision_model":
        raise EncoderInputError(str(folder / "config.json"), f"describes a "
                                f"{raw.get('model_type')!r} model", "a SigLIP vision model "
                                "(model_type siglip_vision_model)")
    config = _hf_load(SiglipVisionConfig.from_pretrained, folder, "a SigLIP vision config.json")
    cfg = pipeline.config
    tokens = (config.image_size // config.patch_size) ** 2
    if config.hidden_size != cfg.vision_dim or tokens != cfg.vision_len:
        raise EncoderInputError(str(folder / "config.json"), f"describes a SigLIP of width "
                                f"{config.hidden_size} giving {tokens} tokens",
                                f"width {cfg.vision_dim} and {cfg.vision_len} tokens (what the "
                                f"{pipeline.name} DiT reads)")
    stored = {_strip(k, ("vision_model.",)): v for k, v in _stored_shapes(folder, "SigLIP").items()}
    expected = {_strip(k, ("vision_model.",)): v
                for k, v in _meta_shapes(SiglipVisionModel, config).items()}
    _compare(str(folder), "SigLIP", expected, stored)
    _read_json(root / layout.feature_extractor / "preprocessor_config.json",
               "the SigLIP feature extractor's preprocessor_config.json")


def _check_vae(layout: _Layout, root: Path, pipeline) -> None:
    folder = root / layout.vae
    config = _read_json(folder / "config.json", "the HunyuanVideo-1.5 VAE's config.json")
    channels = config.get("latent_channels")
    if channels != pipeline.latent_channels:
        raise EncoderInputError(str(folder / "config.json"), f"describes a VAE of "
                                f"{channels} latent channels", f"the HunyuanVideo-1.5 VAE of "
                                f"{pipeline.latent_channels} latent channels")


def check(pipeline, request: Request, weights) -> None:
    """Refuse bad input before any model work (see encoders/__init__.py)."""
    _check_request(pipeline, request)
    if weights is None:
        _tiny_dims(pipeline)
        return
    root, layout = Path(weights), layout_of(weights)
    _tokenizer_files(root / layout.mllm_tokenizer, "Qwen2.5-VL", chat=True)
    tokenizer = _load_tokenizer(root / layout.mllm_tokenizer)
    try:
        crop_start(tokenizer)
    except ValueError as exc:
        raise EncoderInputError(str(root / layout.mllm_tokenizer), str(exc),
                                "the Qwen2.5-VL tokenizer and chat template") from None
    _check_mllm(root / layout.mllm, pipeline, tokenizer)
    _tokenizer_files(root / layout.byt5_tokenizer, "ByT5", chat=False)
    _check_byt5(layout, root, pipeline, _byt5_tokenizer(layout, root))
    if pipeline.task == "i2v":
        _check_siglip(layout, root, pipeline)
        _check_vae(layout, root, pipeline)


def _check_request(pipeline, request: Request) -> None:
    from sampling.pipelines import SizeError

    if pipeline.family != "hunyuan_video15":
        raise EncoderInputError("--model", f"{pipeline.name} is a {pipeline.family} pipeline",
                                "a HunyuanVideo-1.5 pipeline for encoders.hunyuan")
    if not isinstance(request.prompt, str):
        raise EncoderInputError("--prompt", f"is {type(request.prompt).__name__}", "a string")
    if request.audio is not None:
        raise EncoderInputError("--audio", f"given for {pipeline.name}", "no audio (only S2V "
                                "pipelines take speech)")
    if request.clips is not None:
        raise EncoderInputError("--clips", f"given for {pipeline.name}", "no clip count (only S2V "
                                "pipelines sample clips)")
    if pipeline.task == "i2v" and request.image is None:
        raise EncoderInputError("--image", f"missing for the image-to-video {pipeline.name}",
                                "the first frame's image file")
    if pipeline.task != "i2v" and request.image is not None:
        raise EncoderInputError("--image", f"given for the text-to-video {pipeline.name}",
                                "no image (or an i2v pipeline)")
    if (request.height is None) != (request.width is None) and pipeline.task == "i2v":
        raise EncoderInputError("--height" if request.width is None else "--width", "given alone",
                                "both --height and --width, or neither (the image's bucket)")
    size = [default if value is None else value
            for value, default in zip((request.height, request.width, request.frames), pipeline.size,
                                      strict=True)]
    try:
        pipeline.latent_shape(*size)
    except SizeError as exc:
        raise EncoderInputError(f"--{exc.name}", str(exc.value), exc.expected) from None
    if request.image is not None:
        open_image(request.image)


# --- loading (the same code for a real folder and the tiny one) ----------------------------------

def _quiet():
    from transformers.utils import logging
    logging.disable_progress_bar()
    logging.set_verbosity_error()


def _load_tokenizer(folder: Path):
    from transformers import AutoTokenizer
    _quiet()
    tokenizer = _hf_load(lambda path: AutoTokenizer.from_pretrained(path, padding_side="right"),
                         folder, "a tokenizer folder transformers can load")
    template = folder / "chat_template.json"  # a processor's file: tokenizers may not read it
    if getattr(tokenizer, "chat_template", None) is None and template.is_file():
        tokenizer.chat_template = _read_json(template, "a chat template").get("chat_template")
    return tokenizer


def _byt5_tokenizer(layout: _Layout, root: Path):
    """ByT5 tokenizer with the glyph colour and font tokens (official: added from the Glyph
    assets; diffusers: already in tokenizer_2/)."""
    tokenizer = _load_tokenizer(root / layout.byt5_tokenizer)
    if layout.glyph_assets is not None:
        tokenizer.add_tokens(_glyph_tokens(root / layout.glyph_assets), special_tokens=True)
    return tokenizer


def _finite(model, where: str):
    from modules.checkpoint import all_finite
    for name, value in model.state_dict().items():
        if not all_finite(value):
            raise EncoderInputError(where, f"tensor {name!r} holds NaN or Inf (as {value.dtype})",
                                    "finite weights")
    return model


def _load_mllm(root: Path, layout: _Layout, dtype, device):
    from transformers import Qwen2_5_VLTextModel
    _quiet()
    folder = root / layout.mllm
    # from_pretrained takes the text decoder out of the whole release (skipping visual.* and
    # lm_head) as well as the diffusers text_encoder/; the headers were checked against it
    model = Qwen2_5_VLTextModel.from_pretrained(str(folder), dtype=dtype)
    return _finite(model, str(folder)).to(device).eval()


def _load_byt5(root: Path, layout: _Layout, vocab: int, dtype, device):
    from transformers import T5EncoderModel
    _quiet()
    if layout is DIFFUSERS:
        model = T5EncoderModel.from_pretrained(str(root / layout.byt5), dtype=dtype)
    else:  # byt5-small's architecture, Glyph-SDXL-v2's weights (official create_byt5)
        config = _byt5_config(layout, root)
        config.vocab_size = vocab
        with torch.device("meta"):
            model = T5EncoderModel(config)
        state = glyph_to_t5(_load_pickle(root / layout.byt5, "ByT5 glyph encoder"))
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return _finite(model, str(root / layout.byt5)).to(device).eval()


def _load_siglip(root: Path, layout: _Layout, dtype, device):
    # the PIL processor, as the official transformers 4.57.1 runs it (5.x picks a torchvision
    # backend when torchvision is installed: another resize)
    from transformers import SiglipImageProcessorPil, SiglipVisionModel
    _quiet()
    folder = root / layout.image_encoder
    model = SiglipVisionModel.from_pretrained(str(folder), dtype=dtype)
    processor = SiglipImageProcessorPil.from_pretrained(str(root / layout.feature_extractor))
    return _finite(model, str(folder)).to(device).eval(), processor


def _load_vae(root: Path, layout: _Layout, pipeline, dtype, device):
    from diffusers.utils import logging

    from modules.vae import VaeError, load_vae, spec_for

    logging.set_verbosity_error()  # from_pretrained's advice to install accelerate
    try:
        vae = load_vae(spec_for(pipeline), str(root / layout.vae), dtype=dtype)
    except VaeError as exc:
        raise EncoderInputError(str(root / layout.vae), str(exc).removeprefix("--vae_path "),
                                "the HunyuanVideo-1.5 VAE (diffusers or official layout)") from None
    return vae.to(device)


# --- encoding ---------------------------------------------------------------------------------------

@torch.no_grad()
def mllm_states(model, tokenizer, prompt: str, text_len: int, crop: int, device="cpu"):
    """([1, text_len, D] float32, [1, text_len] int64): hidden_states[-3] of the templated prompt
    padded to text_len + crop tokens, template rows cropped. Only the real tokens are run: with
    right padding and a causal model their rows are the padded run's; padded rows are zeros."""
    enc = tokenizer.apply_chat_template(
        conversation(prompt), add_generation_prompt=True, tokenize=True, return_dict=True,
        padding="max_length", max_length=text_len + crop, truncation=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"].long()
    real = int(mask.sum())
    out = model(input_ids=ids[:, :real].to(device), attention_mask=mask[:, :real].to(device),
                output_hidden_states=True)
    states = torch.zeros(1, ids.shape[1], model.config.hidden_size)
    states[:, :real] = out.hidden_states[-(HIDDEN_STATE_SKIP + 1)].float().cpu()
    return states[:, crop:].contiguous(), mask[:, crop:].contiguous()


@torch.no_grad()
def glyph_states(model, tokenizer, prompt: str | None, length: int, width: int, device="cpu"):
    """([1, length, width] float32, [1, length] int64): the ByT5 encoder on the prompt's quoted
    text, zeros and an all-zero mask when it quotes nothing (or the prompt is None)."""
    text = None if prompt is None else glyph_text(prompt)
    if text is None:
        return torch.zeros(1, length, width), torch.zeros(1, length, dtype=torch.int64)
    tok = tokenizer(text, padding="max_length", max_length=length, truncation=True,
                    add_special_tokens=True, return_tensors="pt")
    mask = tok["attention_mask"].long()
    states = model(input_ids=tok["input_ids"].to(device), attention_mask=mask.float().to(device))[0]
    return states.float().cpu(), mask


@torch.no_grad()
def siglip_states(model, processor, image, device="cpu"):
    """[1, tokens, width] float32: SigLIP last_hidden_state of the cropped image."""
    import numpy as np
    pixels = processor.preprocess(images=np.array(image), return_tensors="pt")["pixel_values"]
    return model(pixel_values=pixels.to(device, model.dtype)).last_hidden_state.float().cpu()


@torch.no_grad()
def first_frame_latent(vae, image, device="cpu"):
    """[1, C, 1, H/16, W/16] float32: the VAE latent mode of the cropped image in [-1, 1],
    times scaling_factor (official get_image_condition_latents)."""
    import numpy as np
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).float().div(255)
    pixels = ((pixels - 0.5) / 0.5)[None, :, None]  # ToTensor + Normalize([0.5], [0.5])
    latent = vae.encode(pixels.to(device, vae.dtype)).latent_dist.mode()
    return (latent * vae.config.scaling_factor).float().cpu()


def cfg_on(pipeline) -> bool:
    """Whether stage 2 runs an unconditional branch (some expert's guidance != 1)."""
    return any(pipeline.guidance_for(expert) != 1.0 for expert, _ in pipeline.experts)


BIG_MODEL = 10 ** 8  # parameters: a model this large is collected before the next one loads


def _collect(params: int) -> None:
    """Free a large encoder's memory before the next loads; a full collection costs ~0.5 s in
    a process holding torch and transformers, so tiny encoders are left to reference counting."""
    if params >= BIG_MODEL:
        gc.collect()


def _size(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _dtype(part: str, weights, device, dtype):
    if dtype is not None:
        return dtype
    if weights is None:
        return torch.float32  # the tiny random encoders
    return (_CPU_DTYPES if torch.device(device).type == "cpu" else _OFFICIAL_DTYPES)[part]


def _encode_text(root, layout, prompts: dict, cfg, dtype, device):
    tokenizer = _load_tokenizer(root / layout.mllm_tokenizer)
    crop = crop_start(tokenizer)
    model = _load_mllm(root, layout, dtype, device)
    out = {}
    for p, text in prompts.items():
        out[f"{p}prompt_embeds"], out[f"{p}prompt_embeds_mask"] = mllm_states(
            model, tokenizer, text, cfg.text_len, crop, device)
    return out, _size(model)


def _encode_glyphs(root, layout, prompts: dict, cfg, dtype, device):
    model = tokenizer = None
    if any(text is not None and glyph_text(text) is not None for text in prompts.values()):
        tokenizer = _byt5_tokenizer(layout, root)
        model = _load_byt5(root, layout, len(tokenizer), dtype, device)
    out = {}
    for p, text in prompts.items():
        out[f"{p}prompt_embeds_2"], out[f"{p}prompt_embeds_mask_2"] = glyph_states(
            model, tokenizer, text, cfg.byt5_len, cfg.byt5_dim, device)
    return out, 0 if model is None else _size(model)


def _encode_image_states(root, layout, image, dtype, device):
    model, processor = _load_siglip(root, layout, dtype, device)
    return {"image_embeds": siglip_states(model, processor, image, device)}, _size(model)


def _encode_first_frame(root, layout, pipeline, image, dtype, device):
    vae = _load_vae(root, layout, pipeline, dtype, device)
    return {"image_latents": first_frame_latent(vae, image, device)}, _size(vae)


def encode(pipeline, request: Request, weights, device="cpu", dtype=None):
    """(stage-1 tensors, config fields) for one request (see encoders/__init__.py). `dtype`
    overrides every encoder's dtype (default: the official ones, bf16 for fp16 on a CPU; fp32
    for the tiny encoders). Each encoder is freed before the next loads."""
    check(pipeline, request, weights)  # again (headers and tokenizers only): a direct call refuses too
    root = Path(weights) if weights is not None else tiny_weights(pipeline)
    layout = layout_of(root)
    cfg = pipeline.config
    negative = DEFAULT_NEGATIVE_PROMPT if request.negative_prompt is None else request.negative_prompt
    prompts = {"": request.prompt, **({"negative_": negative} if cfg_on(pipeline) else {})}
    # official: the negative glyph input is always "" (zeros), whatever the negative prompt says
    glyph_prompts = {p: (text if p == "" else None) for p, text in prompts.items()}

    def dt(part):
        return _dtype(part, weights, device, dtype)

    steps = [lambda: _encode_text(root, layout, prompts, cfg, dt("mllm"), device),
             lambda: _encode_glyphs(root, layout, glyph_prompts, cfg, dt("byt5"), device)]
    config = {}
    if pipeline.task == "i2v":
        image = open_image(request.image)
        if request.height is not None:
            height, width = request.height, request.width
        else:
            height, width = image_size(image.width, image.height, bucket_base(pipeline))
        image = cover_crop(image, height, width)
        steps += [lambda: _encode_image_states(root, layout, image, dt("siglip"), device),
                  lambda: _encode_first_frame(root, layout, pipeline, image, dt("vae"), device)]
        frames = pipeline.size[2] if request.frames is None else request.frames
        config = {"height": height, "width": width, "video_length": frames}
    tensors = {}
    for step in steps:
        out, params = step()
        tensors.update(out)
        _collect(params)
    return tensors, config


# --- tiny random encoders (weights=None) -----------------------------------------------------------

TINY_SEED = 0
TINY_LIMIT = 64  # widest text state a tiny pipeline may ask for; real ones need real weights
# Glyph-SDXL-v2's asset files, in small: the official loader adds one token per entry
TINY_GLYPH_COLORS = {"white": 0, "black": 1, "red": 2}
TINY_GLYPH_FONTS = {"en-TinySans": 0, "zh-TinyKai": 1}
_TINY_CORPUS = [SYSTEM_MESSAGE, "system\nuser\nassistant\n", "A cat walks on the grass.",
                "A red ball rolls to the left on a white table.",
                'A neon sign reads "OPEN" above a small shop at night.']
_TINY_CHAT_TEMPLATE = (  # the Qwen2.5 template for plain-text messages
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_tiny_folders: dict[str, tempfile.TemporaryDirectory] = {}


def _tiny_dims(pipeline):
    cfg = pipeline.config
    if max(cfg.text_dim, cfg.byt5_dim, cfg.vision_dim) > TINY_LIMIT:
        raise EncoderInputError("encoder weights", f"not given for {pipeline.name}, whose text "
                                f"states are {cfg.text_dim} wide (Qwen2.5-VL-7B)",
                                "the folder of its encoders (official or diffusers layout); tiny "
                                "random encoders exist only for the tiny pipelines")
    if cfg.text_dim % 8 or math.isqrt(cfg.vision_len) ** 2 != cfg.vision_len:
        raise EncoderInputError("--model", f"{pipeline.name} has text width {cfg.text_dim} and "
                                f"{cfg.vision_len} vision tokens", "a text width divisible by 8 "
                                "and a square number of vision tokens (a SigLIP's)")
    return cfg


def tiny_tokenizers():
    """(Qwen-style chat tokenizer, ByT5 tokenizer with the tiny glyph tokens), built locally:
    a byte-level BPE trained on the system message and a few sentences (no hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import ByT5Tokenizer, Qwen2TokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(_TINY_CORPUS, trainer=trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    qwen = Qwen2TokenizerFast(tokenizer_object=bpe, pad_token="<|endoftext|>",
                              eos_token="<|im_end|>", unk_token=None, bos_token=None,
                              padding_side="right")
    qwen.chat_template = _TINY_CHAT_TEMPLATE
    byt5 = ByT5Tokenizer()
    byt5.add_tokens([f"<color-{i}>" for i in TINY_GLYPH_COLORS.values()]
                    + [f"<{code[:2]}-font-{i}>" for code, i in TINY_GLYPH_FONTS.items()],
                    special_tokens=True)
    return qwen, byt5


def tiny_models(pipeline, qwen_vocab: int, byt5_vocab: int):
    """(Qwen2_5_VLTextModel, T5EncoderModel, SiglipVisionModel or None, VAE or None) with the
    tiny pipeline's widths, random weights from TINY_SEED; the VAE is stage 3's tiny one."""
    from transformers import (
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        SiglipVisionConfig,
        SiglipVisionModel,
        T5Config,
        T5EncoderModel,
    )

    cfg = _tiny_dims(pipeline)
    half = cfg.text_dim // 4  # head_dim / 2 with 2 heads: the mrope sections must sum to it
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        qwen = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
            vocab_size=qwen_vocab, hidden_size=cfg.text_dim, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=1, intermediate_size=2 * cfg.text_dim,
            rope_scaling={"type": "mrope", "mrope_section": [half // 4, half // 4,
                                                            half - 2 * (half // 4)]},
            bos_token_id=None, eos_token_id=None, pad_token_id=None))
        byt5 = T5EncoderModel(T5Config(
            vocab_size=byt5_vocab, d_model=cfg.byt5_dim, d_kv=4, d_ff=2 * cfg.byt5_dim,
            num_layers=2, num_heads=2, feed_forward_proj="gated-gelu", is_encoder_decoder=False))
        siglip = vae = None
        if pipeline.task == "i2v":
            patch = 14
            siglip = SiglipVisionModel(SiglipVisionConfig(
                hidden_size=cfg.vision_dim, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=2 * cfg.vision_dim, patch_size=patch,
                image_size=patch * math.isqrt(cfg.vision_len)))
    if pipeline.task == "i2v":
        from modules.vae import build_tiny, spec_for
        vae = build_tiny(spec_for(pipeline), pipeline.latent_channels)  # stage 3's default seed
    return qwen.eval(), byt5.eval(), None if siglip is None else siglip.eval(), vae


def write_tiny(folder, pipeline) -> Path:
    """Tiny random encoders and tokenizers of a tiny pipeline, saved in the diffusers layout."""
    root = Path(folder)
    qwen_tok, byt5_tok = tiny_tokenizers()
    qwen, byt5, siglip, vae = tiny_models(pipeline, len(qwen_tok), len(byt5_tok))
    _quiet()
    qwen_tok.save_pretrained(root / DIFFUSERS.mllm_tokenizer)
    qwen.save_pretrained(root / DIFFUSERS.mllm)
    byt5_tok.save_pretrained(root / DIFFUSERS.byt5_tokenizer)
    byt5.save_pretrained(root / DIFFUSERS.byt5)
    if siglip is not None:
        from transformers import SiglipImageProcessorPil
        siglip.save_pretrained(root / DIFFUSERS.image_encoder)
        size = siglip.config.image_size  # the square input SigLIP takes (384 for the real one)
        SiglipImageProcessorPil(size={"height": size, "width": size}, image_mean=[0.5] * 3,
                                image_std=[0.5] * 3).save_pretrained(root / DIFFUSERS.feature_extractor)
        vae.save_pretrained(root / DIFFUSERS.vae)
    return root


def tiny_weights(pipeline) -> Path:
    """The tiny encoders' folder for this process (built on first use, removed at exit)."""
    if pipeline.name not in _tiny_folders:
        folder = tempfile.TemporaryDirectory(prefix=f"tiny-encoders-{pipeline.name}-")
        write_tiny(folder.name, pipeline)
        _tiny_folders[pipeline.name] = folder
    return Path(_tiny_folders[pipeline.name].name)

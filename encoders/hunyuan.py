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

The family's entry (`check`, `encode`); each concern lives in its own module, and the names callers
use are re-exported here: `hunyuan_text` (Qwen2.5-VL prompt and crop), `hunyuan_glyph` (ByT5 glyph
text), `hunyuan_image` (i2v bucket, SigLIP, first-frame latent), `hunyuan_weights` (layouts and
shared file checks), `hunyuan_tiny` (tiny random encoders).
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from .hunyuan_glyph import (
    GLYPH_COLOR_ASSET,
    GLYPH_FONT_ASSET,
    GLYPH_PREFIX,
    GLYPH_QUOTES,
    byt5_tokenizer,
    check_byt5,
    glyph_states,
    glyph_text,
    glyph_to_t5,
    load_byt5,
)
from .hunyuan_image import (
    BUCKET_BASE,
    BUCKET_STRIDE,
    bucket_base,
    check_siglip,
    check_vae,
    cover_crop,
    crop_size_list,
    first_frame_latent,
    image_size,
    load_siglip,
    load_vae,
    open_image,
    siglip_states,
)
from .hunyuan_text import (
    CROP_PROBE,
    CROP_PROBE_TOKENS,
    DEFAULT_NEGATIVE_PROMPT,
    HIDDEN_STATE_SKIP,
    SYSTEM_MESSAGE,
    USER_MARKER,
    check_mllm,
    conversation,
    crop_start,
    load_mllm,
    mllm_states,
)
from .hunyuan_tiny import (
    TINY_GLYPH_COLORS,
    TINY_GLYPH_FONTS,
    TINY_LIMIT,
    TINY_SEED,
    tiny_dims,
    tiny_models,
    tiny_tokenizers,
    tiny_weights,
    write_tiny,
)
from .hunyuan_weights import DIFFUSERS, OFFICIAL, layout_of, load_tokenizer, tokenizer_files
from .request import EncoderInputError, Request

__all__ = [
    "BIG_MODEL", "BUCKET_BASE", "BUCKET_STRIDE", "CROP_PROBE", "CROP_PROBE_TOKENS",
    "DEFAULT_NEGATIVE_PROMPT", "DIFFUSERS", "GLYPH_COLOR_ASSET", "GLYPH_FONT_ASSET", "GLYPH_PREFIX",
    "GLYPH_QUOTES", "HIDDEN_STATE_SKIP", "OFFICIAL", "SYSTEM_MESSAGE", "TINY_GLYPH_COLORS",
    "TINY_GLYPH_FONTS", "TINY_LIMIT", "TINY_SEED", "USER_MARKER", "bucket_base", "cfg_on", "check",
    "conversation", "cover_crop", "crop_size_list", "crop_start", "encode", "first_frame_latent",
    "glyph_states", "glyph_text", "glyph_to_t5", "image_size", "layout_of", "mllm_states",
    "open_image", "siglip_states", "tiny_models", "tiny_tokenizers", "tiny_weights", "write_tiny",
]

# Official dtypes (stage1_encoders.md trap 13): Qwen and SigLIP fp16, ByT5 fp32, VAE under fp16
# autocast. On a CPU fp16 matmuls are slow: bf16 there, and the VAE in fp32.
_OFFICIAL_DTYPES = {"mllm": torch.float16, "byt5": torch.float32, "siglip": torch.float16,
                    "vae": torch.float16}
_CPU_DTYPES = {"mllm": torch.bfloat16, "byt5": torch.float32, "siglip": torch.bfloat16,
               "vae": torch.float32}


def check(pipeline, request: Request, weights) -> None:
    """Refuse bad input before any model work (see encoders/__init__.py)."""
    _check_request(pipeline, request)
    if weights is None:
        tiny_dims(pipeline)
        return
    root, layout = Path(weights), layout_of(weights)
    tokenizer_files(root / layout.mllm_tokenizer, "Qwen2.5-VL", chat=True)
    tokenizer = load_tokenizer(root / layout.mllm_tokenizer)
    try:
        crop_start(tokenizer)
    except ValueError as exc:
        raise EncoderInputError(str(root / layout.mllm_tokenizer), str(exc),
                                "the Qwen2.5-VL tokenizer and chat template") from None
    check_mllm(root / layout.mllm, pipeline, tokenizer)
    tokenizer_files(root / layout.byt5_tokenizer, "ByT5", chat=False)
    check_byt5(layout, root, pipeline, byt5_tokenizer(layout, root))
    if pipeline.task == "i2v":
        check_siglip(layout, root, pipeline)
        check_vae(layout, root, pipeline)


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


# The loaders are looked up in this module when a step runs: a test stubs them all here to show
# that a refusal comes before any load.
def _encode_text(root, layout, prompts: dict, cfg, dtype, device):
    tokenizer = load_tokenizer(root / layout.mllm_tokenizer)
    crop = crop_start(tokenizer)
    model = load_mllm(root, layout, dtype, device)
    out = {}
    for p, text in prompts.items():
        out[f"{p}prompt_embeds"], out[f"{p}prompt_embeds_mask"] = mllm_states(
            model, tokenizer, text, cfg.text_len, crop, device)
    return out, _size(model)


def _encode_glyphs(root, layout, prompts: dict, cfg, dtype, device):
    model = tokenizer = None
    if any(text is not None and glyph_text(text) is not None for text in prompts.values()):
        tokenizer = byt5_tokenizer(layout, root)
        model = load_byt5(root, layout, len(tokenizer), dtype, device)
    out = {}
    for p, text in prompts.items():
        out[f"{p}prompt_embeds_2"], out[f"{p}prompt_embeds_mask_2"] = glyph_states(
            model, tokenizer, text, cfg.byt5_len, cfg.byt5_dim, device)
    return out, 0 if model is None else _size(model)


def _encode_image_states(root, layout, image, dtype, device):
    model, processor = load_siglip(root, layout, dtype, device)
    return {"image_embeds": siglip_states(model, processor, image, device)}, _size(model)


def _encode_first_frame(root, layout, pipeline, image, dtype, device):
    vae = load_vae(root, layout, pipeline, dtype, device)
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

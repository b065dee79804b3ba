"""HunyuanVideo-1.5 stage 1, the prompt: the Qwen2.5-VL chat template with the official system
message, its crop, the checks of a Qwen folder, and the hidden states DiT reads."""

from __future__ import annotations

from pathlib import Path

import torch

from .hunyuan_weights import (
    Layout,
    compare_shapes,
    finite,
    hf_load,
    meta_shapes,
    quiet,
    read_json,
    stored_shapes,
    strip_prefix,
)
from .request import EncoderInputError

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


def conversation(prompt: str) -> list[dict]:
    """The official chat: system message, then the prompt (" " when empty)."""
    return [{"role": "system", "content": SYSTEM_MESSAGE},
            {"role": "user", "content": prompt if prompt else " "}]


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


# Qwen text-decoder keys as stored: the release (model.layers.*, visual.*, lm_head.*), newer
# composite saves (model.language_model.*), the diffusers text_encoder (layers.*).
_QWEN_PREFIXES = ("model.language_model.", "language_model.", "model.")
_QWEN_OTHER = ("visual.", "model.visual.", "lm_head.")


def _mllm_config(folder: Path, pipeline):
    """The Qwen2.5-VL text config of a folder, refused unless it is one of the pipeline's width."""
    raw = read_json(folder / "config.json", "the Qwen2.5-VL-7B-Instruct config.json")
    kind = raw.get("model_type")
    if kind not in ("qwen2_5_vl", "qwen2_5_vl_text"):
        raise EncoderInputError(str(folder / "config.json"), f"describes a {kind!r} model",
                                "Qwen2.5-VL (model_type qwen2_5_vl or qwen2_5_vl_text)")
    from transformers import AutoConfig
    config = hf_load(AutoConfig.from_pretrained, folder, "a Qwen2.5-VL config.json")
    text = getattr(config, "text_config", config)
    want = pipeline.config.text_dim
    if text.hidden_size != want or text.num_hidden_layers <= HIDDEN_STATE_SKIP:
        raise EncoderInputError(str(folder / "config.json"), f"describes a Qwen of hidden size "
                                f"{text.hidden_size} with {text.num_hidden_layers} layers",
                                f"hidden size {want} (the {pipeline.name} DiT reads {want}-wide text "
                                f"states) and more than {HIDDEN_STATE_SKIP} layers")
    return text


def check_mllm(folder: Path, pipeline, tokenizer) -> None:
    from transformers import Qwen2_5_VLTextModel

    text = _mllm_config(folder, pipeline)
    stored = {strip_prefix(k, _QWEN_PREFIXES): v for k, v in stored_shapes(folder, "Qwen2.5-VL").items()
              if not k.startswith(_QWEN_OTHER)}
    compare_shapes(str(folder), "Qwen2.5-VL text", meta_shapes(Qwen2_5_VLTextModel, text), stored)
    if len(tokenizer) > text.vocab_size:
        raise EncoderInputError(str(folder), f"embeds {text.vocab_size} tokens but its tokenizer "
                                f"has {len(tokenizer)}", "a tokenizer of the same Qwen")


def load_mllm(root: Path, layout: Layout, dtype, device):
    from transformers import Qwen2_5_VLTextModel
    quiet()
    folder = root / layout.mllm
    # from_pretrained takes the text decoder out of the whole release (skipping visual.* and
    # lm_head) as well as the diffusers text_encoder/; the headers were checked against it
    model = Qwen2_5_VLTextModel.from_pretrained(str(folder), dtype=dtype)
    return finite(model, str(folder)).to(device).eval()


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

"""HunyuanVideo-1.5 stage 1, the weights folder: where each encoder lives in the official and
diffusers layouts, and the file readers and checks the text, glyph and image encoders share
(JSON, tokenizer folders, checkpoint headers against a model's shapes, finite weights)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .request import EncoderInputError


@dataclass(frozen=True)
class Layout:
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


OFFICIAL = Layout("official", "text_encoder/llm", "text_encoder/llm",
                   "text_encoder/Glyph-SDXL-v2/checkpoints/byt5_model.pt", "text_encoder/byt5-small",
                   "text_encoder/byt5-small", "text_encoder/Glyph-SDXL-v2/assets",
                   "vision_encoder/siglip/image_encoder", "vision_encoder/siglip/feature_extractor",
                   "vae")
DIFFUSERS = Layout("diffusers", "text_encoder", "tokenizer", "text_encoder_2", "text_encoder_2",
                    "tokenizer_2", None, "image_encoder", "feature_extractor", "vae")


def layout_of(weights) -> Layout:
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


def read_json(path: Path, expected: str) -> dict:
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


def tokenizer_files(folder: Path, what: str, *, chat: bool) -> None:
    """The files a tokenizer folder needs: tokenizer_config.json, and for Qwen the vocabulary
    (tokenizer.json, or vocab.json + merges.txt) and a chat template."""
    expected = f"the {what} tokenizer folder"
    if not folder.is_dir():
        raise EncoderInputError(str(folder), "does not exist", expected)
    config = read_json(folder / "tokenizer_config.json", f"{expected}'s tokenizer_config.json")
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


def load_pickle(path: Path, what: str) -> dict[str, torch.Tensor]:
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


def stored_shapes(path: Path, what: str) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from safetensors headers or a pickle's index, without reading
    tensor data."""
    from modules.layouts import CheckpointError
    from modules.safetensors_reader import checkpoint_files, read_header

    if path.suffix in (".pt", ".pth", ".bin"):
        return {k: tuple(v.shape) for k, v in load_pickle(path, what).items()}
    try:
        shapes = {}
        for file in checkpoint_files(path):
            shapes.update({k: info.shape for k, info in read_header(file).items()})
        return shapes
    except CheckpointError as exc:
        raise EncoderInputError(str(path), str(exc), f"the {what} checkpoint (safetensors)") from None


def compare_shapes(where: str, what: str, expected: dict, stored: dict) -> None:
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


def hf_load(load, path: Path, expected: str):
    """`load(str(path))` (a transformers from_pretrained of a config or tokenizer), any failure
    refused as one line."""
    try:
        return load(str(path))
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad file
        raise EncoderInputError(str(path), f"cannot be loaded ({type(exc).__name__}: "
                                f"{' '.join(str(exc).split())[:200]})", expected) from None


def meta_shapes(model_cls, config) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = model_cls(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def strip_prefix(key: str, prefixes) -> str:
    for prefix in prefixes:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def quiet():
    from transformers.utils import logging
    logging.disable_progress_bar()
    logging.set_verbosity_error()


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer
    quiet()
    tokenizer = hf_load(lambda path: AutoTokenizer.from_pretrained(path, padding_side="right"),
                         folder, "a tokenizer folder transformers can load")
    template = folder / "chat_template.json"  # a processor's file: tokenizers may not read it
    if getattr(tokenizer, "chat_template", None) is None and template.is_file():
        tokenizer.chat_template = read_json(template, "a chat template").get("chat_template")
    return tokenizer


def finite(model, where: str):
    from modules.checkpoint import all_finite
    for name, value in model.state_dict().items():
        if not all_finite(value):
            raise EncoderInputError(where, f"tensor {name!r} holds NaN or Inf (as {value.dtype})",
                                    "finite weights")
    return model

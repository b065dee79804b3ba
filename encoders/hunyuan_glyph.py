"""HunyuanVideo-1.5 stage 1, the glyphs: the prompt's quoted text through ByT5 (byt5-small with
Glyph-SDXL-v2's weights and colour and font tokens), with the checks of its files."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .hunyuan_weights import (
    DIFFUSERS,
    Layout,
    compare_shapes,
    finite,
    hf_load,
    load_pickle,
    load_tokenizer,
    meta_shapes,
    quiet,
    read_json,
    stored_shapes,
)
from .request import EncoderInputError

GLYPH_QUOTES = re.compile(r"\"(.*?)\"|“(.*?)”")
GLYPH_COLOR_ASSET = "color_idx.json"
GLYPH_FONT_ASSET = "multilingual_10-lang_idx.json"
GLYPH_PREFIX = "module.text_tower.encoder."  # keys of Glyph-SDXL-v2's byt5_model.pt


def glyph_text(prompt: str) -> str | None:
    """The ByT5 input: every quoted span as `Text "<span>". `, de-duplicated in order when there
    are several (official _extract_glyph_texts + MultilingualPromptFormat with no styles); None
    when the prompt quotes nothing."""
    spans = [a or b for a, b in GLYPH_QUOTES.findall(prompt)]
    if len(spans) > 1:
        spans = list(dict.fromkeys(spans))
    return "".join(f'Text "{span}". ' for span in spans) if spans else None


def _byt5_config(layout: Layout, root: Path, pipeline=None):
    """byt5-small's T5 config (refused unless a T5 of the pipeline's glyph width, if given)."""
    folder = root / layout.byt5_config
    raw = read_json(folder / "config.json", "the byt5-small (T5) config.json")
    if raw.get("model_type") != "t5":
        raise EncoderInputError(str(folder / "config.json"), f"describes a "
                                f"{raw.get('model_type')!r} model", "a T5 (byt5-small) config")
    from transformers import T5Config
    config = hf_load(T5Config.from_pretrained, folder, "a T5 (byt5-small) config.json")
    want = config.d_model if pipeline is None else pipeline.config.byt5_dim
    if config.d_model != want:
        raise EncoderInputError(str(folder / "config.json"), f"describes a T5 of width "
                                f"{config.d_model}", f"width {want} (the {pipeline.name} DiT reads "
                                f"{want}-wide glyph states)")
    return config


def _glyph_tokens(assets: Path) -> list[str]:
    """The colour and font tokens Glyph-SDXL-v2 adds to the ByT5 tokenizer (official
    add_special_token, multilingual): <color-i> for each colour, <xx-font-i> for each font."""
    colors = read_json(assets / GLYPH_COLOR_ASSET, "Glyph-SDXL-v2's colour index")
    fonts = read_json(assets / GLYPH_FONT_ASSET, "Glyph-SDXL-v2's multilingual font index")
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


def _byt5_stored(layout: Layout, root: Path) -> dict[str, tuple[int, ...]]:
    """ByT5 encoder tensor shapes in T5EncoderModel names."""
    shapes = stored_shapes(root / layout.byt5, "ByT5 glyph encoder")
    return shapes if layout is DIFFUSERS else glyph_to_t5(shapes)


def check_byt5(layout: Layout, root: Path, pipeline, tokenizer) -> None:
    from transformers import T5EncoderModel

    config = _byt5_config(layout, root, pipeline)
    stored = _byt5_stored(layout, root)
    config.vocab_size = len(tokenizer)  # official: embedding resized to the glyph tokenizer
    expected = meta_shapes(T5EncoderModel, config)
    if "shared.weight" in stored or "encoder.embed_tokens.weight" in stored:  # tied: one may be saved
        tied = stored.get("shared.weight", stored.get("encoder.embed_tokens.weight"))
        stored = {**stored, "shared.weight": tied, "encoder.embed_tokens.weight": tied}
    compare_shapes(str(root / layout.byt5), "ByT5 glyph", expected, stored)


def byt5_tokenizer(layout: Layout, root: Path):
    """ByT5 tokenizer with the glyph colour and font tokens (official: added from the Glyph
    assets; diffusers: already in tokenizer_2/)."""
    tokenizer = load_tokenizer(root / layout.byt5_tokenizer)
    if layout.glyph_assets is not None:
        tokenizer.add_tokens(_glyph_tokens(root / layout.glyph_assets), special_tokens=True)
    return tokenizer


def load_byt5(root: Path, layout: Layout, vocab: int, dtype, device):
    from transformers import T5EncoderModel
    quiet()
    if layout is DIFFUSERS:
        model = T5EncoderModel.from_pretrained(str(root / layout.byt5), dtype=dtype)
    else:  # byt5-small's architecture, Glyph-SDXL-v2's weights (official create_byt5)
        config = _byt5_config(layout, root)
        config.vocab_size = vocab
        with torch.device("meta"):
            model = T5EncoderModel(config)
        state = glyph_to_t5(load_pickle(root / layout.byt5, "ByT5 glyph encoder"))
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return finite(model, str(root / layout.byt5)).to(device).eval()


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

"""HunyuanVideo-1.5 stage 1, tiny random encoders (weights=None): tokenizers and models with a
tiny pipeline's widths, built locally (no hub) and saved in the diffusers layout, so that they
run through the same loading code as real checkpoints."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch

from .hunyuan_text import SYSTEM_MESSAGE
from .hunyuan_weights import DIFFUSERS, quiet
from .request import EncoderInputError

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


def tiny_dims(pipeline):
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

    cfg = tiny_dims(pipeline)
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
    quiet()
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

"""The text encoder of the tiny models trained here (`wan-tiny-trained`, `hunyuanvideo-tiny-trained`,
issue 28): a frozen table.

A prompt's i-th word becomes that word's vector concatenated with position i's vector; rows past
the prompt are zero, and so is the whole empty prompt (CFG's negative: the trainer's prompt
dropout). The table and its vocabulary live in the checkpoint's `text_encoder/` folder
(`text_embedding.safetensors`: `words` [V, Dw], `positions` [L, Dp]; `text_vocab.json`: the V
words in order). Prompts are read forgivingly: case, punctuation and the articles "a", "an",
"the" are dropped ("A red circle moves right on blue." reads as "red circle moves right on
blue"); any other word outside the vocabulary is refused, naming the vocabulary.

Image mode (the model was trained on it, Wan2.2 TI2V style): the first frame is the image,
resized to the model's frame size (area average), in [-1, 1], channels first, taken to the
latent by the model's pixel-space mapping (`modules.vae.PixelLatents`: the image itself, or
plus the first frame's position anchor).
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import torch

from .request import EncoderInputError, Request

FOLDER = "text_encoder"
TABLE = "text_embedding.safetensors"
VOCAB = "text_vocab.json"
ARTICLES = frozenset({"a", "an", "the"})


def words_of(prompt: str) -> list[str]:
    """The prompt's words as the table reads them: lower case, no punctuation, no articles."""
    return [w for w in re.findall(r"[a-z]+", prompt.lower()) if w not in ARTICLES]


class WordTable:
    """Word vectors plus position vectors; `encode` gives [text_len, word_dim + pos_dim]."""

    def __init__(self, words: np.ndarray, positions: np.ndarray, vocab):
        self.words = np.asarray(words, np.float32)
        self.positions = np.asarray(positions, np.float32)
        self.vocab = {w: i for i, w in enumerate(vocab)}
        if self.words.shape[0] != len(self.vocab):
            raise ValueError(f"{self.words.shape[0]} word vectors for {len(self.vocab)} words")

    @property
    def text_len(self) -> int:
        return self.positions.shape[0]

    @property
    def dim(self) -> int:
        return self.words.shape[1] + self.positions.shape[1]

    def problem(self, prompt: str) -> tuple[str, str] | None:
        """(what is wrong, what is expected) when the table cannot encode `prompt`, else None."""
        tokens = words_of(prompt)
        unknown = sorted({w for w in tokens if w not in self.vocab})
        if unknown:
            import difflib
            near = [(w, difflib.get_close_matches(w, self.vocab, n=1, cutoff=0.75)) for w in unknown]
            hint = "; ".join(f"{w!r}: did you mean {m[0]!r}?" for w, m in near if m)
            return (f"unknown word{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"
                    + (f" ({hint})" if hint else ""),
                    f"words the model knows: {' '.join(self.vocab)}")
        if len(tokens) > self.text_len:
            return f"{len(tokens)} words", f"at most {self.text_len}"
        return None

    def encode(self, prompt: str) -> np.ndarray:
        """[text_len, dim] float32; unknown words or too many raise ValueError."""
        problem = self.problem(prompt)
        if problem is not None:
            raise ValueError("; expected ".join(problem))
        out = np.zeros((self.text_len, self.dim), np.float32)
        split = self.words.shape[1]
        for i, w in enumerate(words_of(prompt)):
            out[i, :split] = self.words[self.vocab[w]]
            out[i, split:] = self.positions[i]
        return out

    def save(self, directory) -> None:
        from safetensors.numpy import save_file
        os.makedirs(directory, exist_ok=True)
        save_file({"words": self.words, "positions": self.positions},
                  os.path.join(directory, TABLE))
        with open(os.path.join(directory, VOCAB), "w") as f:
            f.write(json.dumps(list(self.vocab), indent=0) + "\n")

    @classmethod
    def load(cls, directory) -> WordTable:
        from safetensors.numpy import load_file
        table = load_file(os.path.join(directory, TABLE))
        with open(os.path.join(directory, VOCAB)) as f:
            vocab = json.load(f)
        return cls(table["words"], table["positions"], vocab)


# --- the encoders room's contract ---------------------------------------------------------------

def _folder(pipeline, weights) -> str:
    root = weights if weights is not None else pipeline.builtin_path
    if root is None:
        raise EncoderInputError("--encoder_path", f"{pipeline.name} has no built-in text encoder",
                                f"a checkpoint folder holding {FOLDER}/{TABLE} and {FOLDER}/{VOCAB}")
    return os.path.join(root, FOLDER)


def _table(pipeline, weights) -> WordTable:
    folder = _folder(pipeline, weights)
    for name in (TABLE, VOCAB):
        if not os.path.isfile(os.path.join(folder, name)):
            raise EncoderInputError("--encoder_path", f"{os.path.join(folder, name)} is missing",
                                    f"the word table's {TABLE} and {VOCAB} in {folder}")
    try:
        table = WordTable.load(folder)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise EncoderInputError("--encoder_path", f"{folder} is not a word table ({exc})",
                                f"{TABLE} with `words` and `positions`, {VOCAB} a list of "
                                "words") from None
    cfg = pipeline.config
    if (table.text_len, table.dim) != (cfg.text_len, cfg.text_dim):
        raise EncoderInputError("--encoder_path", f"{folder} encodes [{table.text_len}, "
                                f"{table.dim}]", f"[{cfg.text_len}, {cfg.text_dim}] for "
                                f"{pipeline.name}")
    return table


def _size(pipeline, request: Request) -> tuple[int, int, int]:
    h, w, f = pipeline.size
    for name, value, default in (("--height", request.height, h), ("--width", request.width, w),
                                 ("--video_length", request.frames, f)):
        if value is not None and value != default:
            raise EncoderInputError(name, f"{value}", f"{default}: {pipeline.name} was trained "
                                    f"on {f} frames of {h}x{w} only")
    if request.audio is not None:
        raise EncoderInputError("--audio", f"{request.audio} given",
                                f"no audio: {pipeline.name} is text(-and-image)-to-video")
    return h, w, f


def _image(path: str, height: int, width: int) -> torch.Tensor:
    """[1, 3, 1, H, W] in [-1, 1]."""
    from PIL import Image, UnidentifiedImageError
    try:
        with Image.open(path) as im:
            rgb = im.convert("RGB").resize((width, height), Image.Resampling.BOX)
    except FileNotFoundError:
        raise EncoderInputError("--image", f"{path} does not exist", "an image file") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise EncoderInputError("--image", f"{path} cannot be read ({exc})",
                                "a PNG, JPEG or other image Pillow decodes") from None
    pixels = torch.from_numpy(np.asarray(rgb, np.float32) / 127.5 - 1.0)
    return pixels.permute(2, 0, 1)[None, :, None]


def check(pipeline, request: Request, weights) -> None:
    table = _table(pipeline, weights)
    for name, prompt in (("--prompt", request.prompt), ("--negative_prompt", request.negative_prompt)):
        problem = None if prompt is None else table.problem(prompt)
        if problem is not None:
            raise EncoderInputError(name, f"{prompt!r} has {problem[0]}", problem[1])
    h, w, _ = _size(pipeline, request)
    if request.image is not None:
        if pipeline.task != "ti2v":
            raise EncoderInputError("--image", f"{request.image} given",
                                    f"no image: {pipeline.name} is text-to-video")
        _image(request.image, h, w)


def _hunyuan_masks(pipeline, p: str, embeds) -> dict:
    """As the fixture trainer called HunyuanVideo-1.5 (bench/fixtures/families.py): the mask of
    the prompt's words with the first token always valid (the empty prompt pools to zero, not
    0/0), and no byT5 text (one all-masked token)."""
    mask = embeds.abs().sum(-1) > 0
    mask[:, 0] = True
    cfg = pipeline.config
    return {f"{p}prompt_embeds_mask": mask.to(torch.int64),
            f"{p}prompt_embeds_2": torch.zeros((1, cfg.byt5_len, cfg.byt5_dim)),
            f"{p}prompt_embeds_mask_2": torch.zeros((1, cfg.byt5_len), dtype=torch.int64)}


def _nothing(pipeline, p: str, embeds) -> dict:
    return {}


# family -> the tensors its model reads beside the prompt's embeddings (Wan2.2: none)
_TEXT_BESIDE = {"hunyuan_video15": _hunyuan_masks}


def encode(pipeline, request: Request, weights, device="cpu") -> tuple[dict, dict]:
    check(pipeline, request, weights)
    table = _table(pipeline, weights)
    negative = request.negative_prompt or ""  # trained with the empty prompt as CFG's negative
    tensors = {}
    for p, prompt in (("", request.prompt), ("negative_", negative)):
        embeds = torch.from_numpy(table.encode(prompt))[None]
        tensors[f"{p}prompt_embeds"] = embeds
        tensors.update(_TEXT_BESIDE.get(pipeline.family, _nothing)(pipeline, p, embeds))
    if request.image is not None:
        h, w, _ = pipeline.size
        tensors["image_latents"] = first_frame_latent(pipeline, _image(request.image, h, w))
    return tensors, {}


def first_frame_latent(pipeline, image: torch.Tensor) -> torch.Tensor:
    """[1, C, 1, H, W]: frame 0 of the latent of a clip that opens with `image` ([1, 3, 1, H, W]
    in [-1, 1]), through the pipeline's own pixel-space mapping: the image itself, or with the
    position anchor of the first frame (modules.vae.PixelLatents)."""
    from modules.vae import build_tiny, spec_for
    frames = pipeline.size[2]
    clip = image.expand(-1, -1, frames, -1, -1)
    return build_tiny(spec_for(pipeline), clip.shape[1]).encode(clip)[:, :, :1].contiguous()

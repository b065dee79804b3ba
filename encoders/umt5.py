"""The umT5-XXL text encoder of Wan2.2, through transformers' `UMT5EncoderModel`.

Two layouts of the same weights (stage1_encoders.md section 5):

    official   models_t5_umt5-xxl-enc-bf16.pth (wan/modules/t5.py names) + google/umt5-xxl/
    diffusers  text_encoder/ (config.json + model.safetensors[.index.json]) + tokenizer/

Both go through one loader: the checkpoint's keys and shapes are read first (safetensors headers,
or the .pth unpickled onto the meta device, which reads no tensor data) and checked against a
meta-device `UMT5EncoderModel`; then each tensor is cast, checked finite and assigned. The
official model has no config file: its dimensions are read off the tensor shapes.

Preprocessing as the official `T5EncoderModel.__call__` (wan/modules/t5.py, tokenizers.py):
ftfy + HTML unescape twice + whitespace collapse, `padding="max_length"` to `text_len`,
truncation keeping `</s>`, and the output cut to the real token count. The encoder runs on the
real tokens only: the official run on all `text_len` positions masks the padding keys out
(softmax weight exactly 0), so the kept rows are the same (4.8e-7 in fp32, section 8; in bf16 a
few elements may round one bf16 step apart) at a fraction of the cost.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import ftfy
import regex
import torch

from modules.checkpoint import all_finite, check_against, nonfinite_message
from modules.layouts import CheckpointError
from modules.safetensors_reader import checkpoint_files, read_headers
from modules.vae import one_line

from .request import EncoderInputError

# wan/configs/shared_config.py: t5_dtype (the official encoder runs in bf16)
TEXT_DTYPE = torch.bfloat16

OFFICIAL = "official"
DIFFUSERS = "diffusers"
OFFICIAL_CHECKPOINT = "models_t5_umt5-xxl-enc-bf16.pth"
OFFICIAL_TOKENIZER = "google/umt5-xxl"
DIFFUSERS_ENCODER = "text_encoder"
DIFFUSERS_TOKENIZER = "tokenizer"

# umt5_xxl() in wan/modules/t5.py: fixed there, so not in the .pth's shapes
_MAX_DISTANCE = 128
_EPS = 1e-6

# official (wan/modules/t5.py T5Encoder) -> transformers UMT5EncoderModel names
_RENAMES = [
    (r"^token_embedding\.", "shared."),
    (r"^blocks\.(\d+)\.attn\.([qkvo])\.", r"encoder.block.\1.layer.0.SelfAttention.\2."),
    (r"^blocks\.(\d+)\.pos_embedding\.embedding\.",
     r"encoder.block.\1.layer.0.SelfAttention.relative_attention_bias."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.block.\1.layer.0.layer_norm."),
    (r"^blocks\.(\d+)\.ffn\.gate\.0\.", r"encoder.block.\1.layer.1.DenseReluDense.wi_0."),
    (r"^blocks\.(\d+)\.ffn\.fc1\.", r"encoder.block.\1.layer.1.DenseReluDense.wi_1."),
    (r"^blocks\.(\d+)\.ffn\.fc2\.", r"encoder.block.\1.layer.1.DenseReluDense.wo."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.block.\1.layer.1.layer_norm."),
    (r"^norm\.", "encoder.final_layer_norm."),
]
# the input embedding is tied to `shared`: checkpoints store one of the two
_TIED = ("encoder.embed_tokens.weight", "shared.weight")


@dataclass(frozen=True)
class TextFiles:
    """Where a weights folder keeps the text encoder and its tokenizer."""

    layout: str  # OFFICIAL or DIFFUSERS
    encoder: Path  # the .pth file (official) or the text_encoder/ folder (diffusers)
    tokenizer: Path


def locate(weights: str | Path) -> TextFiles:
    """The layout of a Wan weights folder, by its text encoder."""
    root = Path(weights)
    if not root.is_dir():
        raise EncoderInputError(str(root), "is not a folder",
                                "a Wan2.2 release folder or a diffusers pipeline folder")
    official = root / OFFICIAL_CHECKPOINT
    diffusers = root / DIFFUSERS_ENCODER
    found = [p for p in (official, diffusers) if p.exists()]
    if len(found) != 1:
        problem = ("holds both " + " and ".join(p.name for p in found) if found
                   else "holds no umT5 text encoder")
        raise EncoderInputError(str(root), problem,
                                f"{OFFICIAL_CHECKPOINT} + {OFFICIAL_TOKENIZER}/ (official release) "
                                f"or {DIFFUSERS_ENCODER}/ + {DIFFUSERS_TOKENIZER}/ (diffusers)")
    if found[0] == official:
        return TextFiles(OFFICIAL, official, root / OFFICIAL_TOKENIZER)
    return TextFiles(DIFFUSERS, diffusers, root / DIFFUSERS_TOKENIZER)


# --- tokenizer ------------------------------------------------------------------------------------

def check_tokenizer(folder: Path) -> None:
    """The files AutoTokenizer needs: tokenizer_config.json and tokenizer.json (or spiece.model,
    which transformers converts with sentencepiece)."""
    expected = "a tokenizer folder with tokenizer_config.json and tokenizer.json (or spiece.model)"
    if not folder.is_dir():
        raise EncoderInputError(str(folder), "is missing", expected)
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        raise EncoderInputError(str(folder), "lacks tokenizer_config.json", expected)
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EncoderInputError(str(config), f"is not readable JSON ({exc})",
                                "the tokenizer_config.json a tokenizer's save_pretrained writes") \
            from None
    if (folder / "tokenizer.json").is_file():
        return
    if not (folder / "spiece.model").is_file():
        raise EncoderInputError(str(folder), "lacks tokenizer.json (and spiece.model)", expected)
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        raise EncoderInputError(str(folder), "has spiece.model but no tokenizer.json, and the "
                                "sentencepiece package that converts it is not installed",
                                "tokenizer.json beside it (or pip install sentencepiece)") from None


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    check_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder))


def clean(text: str) -> str:
    """wan/modules/tokenizers.py `whitespace_clean(basic_clean(text))`: ftfy, HTML unescaped
    twice, whitespace runs (the `regex` module's \\s, as the official code) made one space."""
    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return regex.sub(r"\s+", " ", text).strip()


# --- checkpoint headers ---------------------------------------------------------------------------

def _official_shapes(path: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Key -> (shape, dtype) of a .pth state dict, unpickled onto the meta device: no tensor
    data is read."""
    try:
        state = torch.load(str(path), map_location="meta", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise EncoderInputError(str(path), f"is not a readable PyTorch checkpoint "
                                f"({type(exc).__name__}: {one_line(exc)})",
                                "the umT5 encoder state dict of the Wan2.2 release") from None
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise EncoderInputError(str(path), f"holds a {type(state).__name__}, not a flat dict of "
                                "tensors", "the umT5 encoder state dict of the Wan2.2 release")
    return {k: (v.shape, v.dtype) for k, v in state.items()}


def _to_transformers(key: str) -> str:
    for pattern, repl in _RENAMES:
        key, n = re.subn(pattern, repl, key)
        if n:
            break
    return key


def _official_config(path: Path, shapes: dict):
    """UMT5Config of an official checkpoint, from its tensor shapes."""
    from transformers import UMT5Config

    def shape(key):
        if key not in shapes:
            raise EncoderInputError(str(path), f"has no tensor {key!r} (keys such as "
                                    f"{sorted(shapes)[:4]})", "the official umT5 encoder keys "
                                    "(token_embedding, blocks.N.attn/ffn/norm1/norm2/pos_embedding, "
                                    "norm)")
        return shapes[key][0]

    vocab, dim = shape("token_embedding.weight")
    inner = shape("blocks.0.attn.q.weight")[0]
    buckets, heads = shape("blocks.0.pos_embedding.embedding.weight")
    ffn = shape("blocks.0.ffn.fc1.weight")[0]
    layers = 1 + max(int(m.group(1)) for k in shapes if (m := re.match(r"blocks\.(\d+)\.", k)))
    if heads < 1 or inner % heads:
        raise EncoderInputError(str(path), f"has attention width {inner} for {heads} heads",
                                "a width divisible by the heads of its position embedding")
    return UMT5Config(vocab_size=vocab, d_model=dim, d_kv=inner // heads, d_ff=ffn,
                      num_layers=layers, num_heads=heads, relative_attention_num_buckets=buckets,
                      relative_attention_max_distance=_MAX_DISTANCE, layer_norm_epsilon=_EPS,
                      feed_forward_proj="gated-gelu", is_encoder_decoder=False, dropout_rate=0.0)


def _diffusers_config(folder: Path):
    from transformers import UMT5Config

    path = folder / "config.json"
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EncoderInputError(str(path), f"is missing or not JSON ({one_line(exc)})",
                                "the config.json of a UMT5EncoderModel") from None
    if not isinstance(values, dict) or values.get("model_type") != "umt5":
        kind = values.get("model_type") if isinstance(values, dict) else None
        raise EncoderInputError(str(path), f"describes model_type {kind!r}",
                                "a UMT5EncoderModel (model_type 'umt5', the umT5-XXL encoder)")
    return UMT5Config.from_dict(values)


def _diffusers_shapes(folder: Path):
    try:
        headers = read_headers(checkpoint_files(folder))
    except CheckpointError as exc:
        raise EncoderInputError(str(folder), one_line(exc),
                                "UMT5EncoderModel weights as save_pretrained writes them") from None
    return headers, {k: (torch.Size(v.shape), v.dtype) for k, v in headers.items()}


def _meta_model(config):
    from transformers import UMT5EncoderModel

    with torch.device("meta"):
        return UMT5EncoderModel(config).eval()


def _checked_model(files: TextFiles, text_dim: int):
    """(meta model, key -> (shape, dtype) in transformers names, source info) of a checkpoint
    whose headers fit a umT5 encoder of width `text_dim`."""
    if files.layout == OFFICIAL:
        if not files.encoder.is_file():
            raise EncoderInputError(str(files.encoder), "is not a file",
                                    "the umT5 encoder .pth of the Wan2.2 release")
        raw = _official_shapes(files.encoder)
        config = _official_config(files.encoder, raw)
        shapes = {_to_transformers(k): v for k, v in raw.items()}
        source = {_to_transformers(k): k for k in raw}
    else:
        config = _diffusers_config(files.encoder)
        headers, shapes = _diffusers_shapes(files.encoder)
        source = {k: headers[k] for k in headers}
    if config.d_model != text_dim:
        raise EncoderInputError(str(files.encoder), f"is a umT5 encoder of width {config.d_model}",
                                f"width {text_dim}, the text_dim of the pipeline's DiT")
    for key, (_, dtype) in shapes.items():
        if not dtype.is_floating_point:
            raise EncoderInputError(str(files.encoder), f"tensor {key!r} is {dtype}",
                                    "float weights")
    tied, source_key = _TIED
    if tied not in shapes and source_key in shapes:
        shapes[tied] = shapes[source_key]
    elif source_key not in shapes and tied in shapes:
        shapes[source_key] = shapes[tied]
    model = _meta_model(config)
    try:
        check_against(model, {k: tuple(s) for k, (s, _) in shapes.items()}, "the checkpoint")
    except CheckpointError as exc:
        raise EncoderInputError(str(files.encoder), one_line(exc).replace(
            "the model", f"a umT5 encoder of {config.num_layers} layers, width {config.d_model}"),
            "the umT5 encoder's keys and shapes") from None
    return model, shapes, source


def check_files(files: TextFiles, text_dim: int) -> None:
    """Every up-front check of a text encoder and tokenizer: reads headers and small files only."""
    check_tokenizer(files.tokenizer)
    _checked_model(files, text_dim)


# --- load -----------------------------------------------------------------------------------------

def _read_tensors(files: TextFiles, source: dict):
    """(transformers key, where it is stored, tensor), one at a time: peak memory is the model
    plus one tensor."""
    if files.layout == OFFICIAL:
        # mmap: each tensor is read when cast, the file's pages are not all held at once
        state = torch.load(str(files.encoder), map_location="cpu", mmap=True, weights_only=True)
        for key, name in source.items():
            yield key, name, state[name]
        return
    from safetensors import safe_open

    by_file: dict = {}
    for key, info in source.items():
        by_file.setdefault(info.file, []).append((key, info))
    for file, entries in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            for key, info in entries:
                yield key, f"{file.name}: tensor {info.stored!r}", fh.get_tensor(info.stored)


def load_encoder(files: TextFiles, text_dim: int, dtype: torch.dtype = TEXT_DTYPE,
                 device="cpu", tokens: int | None = None):
    """A UMT5EncoderModel from either layout, headers checked before any tensor is read;
    `tokens`: the tokenizer's size, which must fit the embedding (else encodes fail midway)."""
    model, shapes, source = _checked_model(files, text_dim)
    rows = model.config.vocab_size
    if tokens is not None and tokens > rows:
        raise EncoderInputError(str(files.tokenizer), f"has {tokens} tokens, more than the {rows} "
                                f"embedding rows of {files.encoder}",
                                "the tokenizer released with the encoder")
    state = {}
    for key, name, stored in _read_tensors(files, source):
        value = stored.to(dtype)
        if not all_finite(value):
            raise EncoderInputError(str(files.encoder), nonfinite_message(name, stored, dtype),
                                    "finite weights")
        state[key] = value
    tied, source_key = _TIED
    state.setdefault(tied, state.get(source_key))
    state.setdefault(source_key, state[tied])
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device).eval()


# --- encode ---------------------------------------------------------------------------------------

def encode(tokenizer, model, text: str, text_len: int) -> torch.Tensor:
    """[1, S, D] hidden states of the S <= text_len real tokens (official u[:v]), on the CPU."""
    tokens = tokenizer([clean(text)], padding="max_length", max_length=text_len, truncation=True,
                       add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    length = int(tokens.attention_mask.gt(0).sum())
    device = next(model.parameters()).device
    ids = tokens.input_ids[:, :length].to(device)
    mask = tokens.attention_mask[:, :length].to(device)
    with torch.no_grad():
        states = model(input_ids=ids, attention_mask=mask).last_hidden_state
    return states.cpu()


# --- tiny encoder for tests and the embedded default ---------------------------------------------

TINY_SEED = 0
_SPECIALS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2 as umT5's (pad 0, eos 1)


def _tiny_tokenizer(corpus: tuple[str, ...]):
    """A unigram tokenizer in umT5's form (Metaspace pieces, `</s>` appended), its vocabulary
    and log-probabilities counted from `corpus` (words and characters) plus printable ASCII."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    counts: Counter = Counter(chr(c) for c in range(33, 127))
    counts["▁"] += 1
    for line in corpus:
        for word in clean(line).split(" "):
            counts.update(word)
            if word.isascii() and word.isalpha():
                counts["▁" + word.lower()] += 1
    total = sum(counts.values())
    vocab = [(s, 0.0) for s in _SPECIALS] + [(piece, math.log(n / total))
                                             for piece, n in sorted(counts.items())]
    tok = Tokenizer(models.Unigram(vocab, unk_id=_SPECIALS.index("<unk>"), byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>",
                           pad_token="<pad>", extra_ids=0)


def write_tiny(folder: Path, text_dim: int, corpus: tuple[str, ...]) -> None:
    """A deterministic tiny tokenizer and random UMT5EncoderModel of width `text_dim` in the
    diffusers layout (text_encoder/, tokenizer/): 2 layers, 2 heads of 8, FFN 32."""
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = _tiny_tokenizer(corpus)
    tokenizer.save_pretrained(str(folder / DIFFUSERS_TOKENIZER))
    config = UMT5Config(vocab_size=len(tokenizer), d_model=text_dim, d_kv=8, d_ff=32,
                        num_layers=2, num_heads=2, feed_forward_proj="gated-gelu",
                        is_encoder_decoder=False, dropout_rate=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = UMT5EncoderModel(config)
    model.save_pretrained(str(folder / DIFFUSERS_ENCODER))

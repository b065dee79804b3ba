"""Load and save DiT checkpoints: official or diffusers layout, one file or shards with an index.

Loading reads the safetensors headers first and checks every key and shape against a model
built on the meta device, so a wrong family, a missing shard or a mis-shaped tensor fails in
seconds with one error that lists everything, before any tensor data is read. The headers are
checked as strictly as the safetensors format (nothing the library would refuse mid-load gets
past them). Tensors are then read one by one, cast, checked finite, and assigned into the meta
model: no second full copy in memory. Every CheckpointError message is one line.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from modules.convert import DIFFUSERS, LAYOUTS, OFFICIAL, from_layout, to_layout
from modules.registry import (
    FAMILIES,
    Family,
    build_model,
    config_dict,
    config_from_dict,
    family_of,
    resolve_config,
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message says what and where."""


WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")  # single-file exports

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}

# One key that only this family and layout has.
_MARKERS = {
    ("wan", OFFICIAL): "blocks.0.self_attn.q.weight",
    ("wan", DIFFUSERS): "blocks.0.attn1.to_q.weight",
    ("wan_s2v", OFFICIAL): "casual_audio_encoder.weights",
    ("hunyuan_video15", OFFICIAL): "double_blocks.0.img_attn_q.weight",
    ("hunyuan_video15", DIFFUSERS): "transformer_blocks.0.attn.add_q_proj.weight",
}
# A family whose checkpoints hold another's keys and more: its marker wins (S2V is a Wan DiT
# with an audio branch).
_EXTENDS = {("wan_s2v", OFFICIAL): ("wan", OFFICIAL)}
# Wan2.1 I2V's CLIP branch, which Wan2.2 does not have (model_spec trap T8).
_WAN21_I2V = re.compile(r"(^img_emb\.|\.k_img\.|\.add_k_proj\.|^condition_embedder\.image_embedder\.)")


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    stored: str  # the name in the file, before a single-file export prefix is stripped
    offset: int = 0  # where its data begins in the file (bytes from the file's start)


# --- files and headers -------------------------------------------------------------------------

# The safetensors library refuses headers over 100 MB; so do we, before reading one into memory.
MAX_HEADER_BYTES = 100_000_000


def _brief(value, limit: int = 60) -> str:
    """repr() cut to one short line: header values come from the file and may be huge."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_size(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _unique_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} appears twice")
        seen[key] = value
    return seen


def _parse_header(file: Path, raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")  # json.loads(bytes) would also take UTF-16/32; the format does not
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{file}: corrupt safetensors header (not valid UTF-8: {err})") from None
    try:
        header = json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise CheckpointError(f"{file}: corrupt safetensors header (JSON nested too deep)") from None
    except ValueError as err:  # JSONDecodeError or a duplicate key
        raise CheckpointError(f"{file}: corrupt safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object)")
    meta = header.get("__metadata__")
    if meta is not None:
        if not isinstance(meta, dict):
            raise CheckpointError(f"{file}: __metadata__ is {_brief(meta)}; expected a map of "
                                  "strings to strings")
        for key, value in meta.items():
            if not isinstance(value, str):
                raise CheckpointError(f"{file}: __metadata__ {key!r} is {_brief(value)}; expected "
                                      "a map of strings to strings")
    return header


def _entry(file: Path, name: str, entry) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    where = f"{file}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: header entry {_brief(entry)}; expected an object with "
                              "dtype, shape and data_offsets")
    code = entry.get("dtype")
    dtype = _DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise CheckpointError(f"{where}: dtype {_brief(code)}; expected one of {sorted(_DTYPES)}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_size(n) for n in shape):
        raise CheckpointError(f"{where}: shape {_brief(shape)}; expected a list of integers >= 0")
    offsets = entry.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_size(n) for n in offsets):
        raise CheckpointError(f"{where}: data_offsets {_brief(offsets)}; expected [begin, end], "
                              "integers >= 0")
    begin, end = offsets
    if end < begin:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] end before they begin")
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise CheckpointError(f"{where} {_brief(shape)} {code} should take {nbytes} bytes, the header "
                              f"gives {end - begin}")
    return dtype, tuple(shape), begin, end


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors header as strictly as the safetensors library does, so
    that nothing it would refuse passes here and fails mid-load: header length within the file
    and the format's limit, UTF-8 JSON object with no duplicate key, __metadata__ a str -> str
    map, each tensor a known dtype with dims >= 0 and numel * itemsize data bytes, and the
    tensors' byte ranges contiguous from 0 to the end of the file (no overlap, gap or trailer)."""
    file = Path(file)
    if not file.is_file():  # a folder (or a device) named *.safetensors
        raise CheckpointError(f"{file}: not a regular file; expected a safetensors file")
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: not a safetensors file ({size} bytes, no header)")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise CheckpointError(f"{file}: not a safetensors file or truncated (header says "
                                      f"{length} header bytes, the file has {size})")
            if length > MAX_HEADER_BYTES:
                raise CheckpointError(f"{file}: not a safetensors file (header length {length} "
                                      f"bytes; the format allows at most {MAX_HEADER_BYTES})")
            raw = fh.read(length)
    except OSError as err:
        raise CheckpointError(f"{file}: cannot be read ({err.strerror or err})") from None
    header = _parse_header(file, raw)
    tensors, spans = {}, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _entry(file, name, entry)
        tensors[name] = TensorInfo(file, dtype, shape, name, 8 + length + begin)
        spans[name] = (begin, end)
    data_bytes = size - 8 - length
    pos, last = 0, None
    for name, (begin, end) in sorted(spans.items(), key=lambda item: item[1]):
        if begin < pos:
            raise CheckpointError(f"{file}: tensor {name!r} data bytes [{begin}, {end}) overlap "
                                  f"tensor {last!r}, which ends at {pos}; expected contiguous "
                                  "tensors")
        if begin > pos:
            raise CheckpointError(f"{file}: tensor {name!r} starts at data byte {begin}, "
                                  f"{begin - pos} bytes after the previous tensor ends; expected "
                                  "contiguous tensors")
        pos, last = end, name
    if pos > data_bytes:
        raise CheckpointError(f"{file}: truncated: tensor {last!r} ends at data byte {pos}, the "
                              f"file holds {data_bytes} data bytes")
    if pos < data_bytes:
        raise CheckpointError(f"{file}: {data_bytes - pos} trailing bytes after the last tensor "
                              f"(the tensors end at data byte {pos}, the file holds {data_bytes}); "
                              "expected the tensors to cover the file exactly")
    return tensors


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint: a file, an index JSON, or a directory of either."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_dir():
        indexes = sorted(path.glob("*.safetensors.index.json"))
        if len(indexes) > 1:
            raise CheckpointError(f"{path}: {len(indexes)} index files "
                                  f"({[p.name for p in indexes]}); pass the one to load")
        if indexes:
            return checkpoint_files(indexes[0])
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no .safetensors file and no index JSON")
        if len(files) > 1:
            raise CheckpointError(f"{path}: {len(files)} .safetensors files but no "
                                  f"*.safetensors.index.json saying how they fit together")
        return files
    if path.name.endswith(".json"):
        try:
            weight_map = json.loads(path.read_bytes().decode("utf-8"))["weight_map"]
            if not isinstance(weight_map, dict) or \
                    not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError(f"weight_map is {_brief(weight_map)}, not a map of names to files")
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, RecursionError) as err:  # ValueError: JSON, UTF-8
            raise CheckpointError(f"{path}: not a safetensors index (expected a JSON object "
                                  f"with a weight_map; {type(err).__name__}: {err})") from None
        except OSError as err:
            raise CheckpointError(f"{path}: cannot be read ({err.strerror or err})") from None
        files = [path.parent / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path}: {len(missing)} of {len(files)} shards are missing: "
                                  f"{missing}")
        return files
    if path.suffix != ".safetensors":
        raise CheckpointError(f"{path}: expected a .safetensors file, an index JSON or a "
                              "directory (.pt/.pth pickles are not loaded: convert them first)")
    return [path]


def read_headers(files: list[Path]) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in read_header(file).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} is in both {tensors[name].file} and {file}")
            tensors[name] = info
    prefix = next((p for p in PREFIXES if tensors and all(k.startswith(p) for k in tensors)), "")
    return {k[len(prefix):]: v for k, v in tensors.items()}


def detect(keys) -> tuple[str, str]:
    """(family, layout) of a state dict's keys."""
    keys = set(keys)
    found = [fl for fl, marker in _MARKERS.items() if marker in keys]
    found = [fl for fl in found if not any(_EXTENDS.get(other) == fl for other in found)]
    if len(found) != 1:
        sample = sorted(keys)[:5]
        raise CheckpointError("not a Wan2.2 or HunyuanVideo-1.5 DiT checkpoint in a known layout: "
                              f"expected one of the keys {sorted(_MARKERS.values())}; "
                              f"found {len(keys)} keys such as {sample}")
    family, layout = found[0]
    if family == "wan" and any(_WAN21_I2V.search(k) for k in keys):
        raise CheckpointError("this is a Wan2.1 I2V checkpoint (CLIP image branch); Wan2.2 models "
                              "have no image cross-attention (model_spec trap T8)")
    return family, layout


# --- config.json -------------------------------------------------------------------------------

def config_to_json(config, layout: str) -> dict:
    """config.json in a layout's own vocabulary, plus our exact config under `static_dit`."""
    fam, c = family_of(config), config
    if fam.name == "wan_s2v":
        if layout != OFFICIAL:
            raise CheckpointError("Wan2.2 S2V has no diffusers layout; save it as official")
        own = dict(_class_name="WanModel_S2V", model_type="s2v", **_S2V_RELEASED,
                   audio_inject_layers=list(c.audio_inject_layers), zero_timestep=c.zero_timestep,
                   cond_dim=c.cond_dim, audio_dim=c.audio_dim, num_audio_token=c.num_audio_token,
                   motion_frames=c.motion_frames, patch_size=list(c.patch_size),
                   text_len=c.text_len, in_dim=c.in_dim, dim=c.dim, ffn_dim=c.ffn_dim,
                   freq_dim=c.freq_dim, text_dim=c.text_dim, out_dim=c.out_dim,
                   num_heads=c.num_heads, num_layers=c.num_layers, eps=c.eps)
    elif fam.name == "wan":
        if layout == OFFICIAL:
            own = dict(_class_name="WanModel", model_type=c.model_type,
                       patch_size=list(c.patch_size), text_len=c.text_len, in_dim=c.in_dim,
                       dim=c.dim, ffn_dim=c.ffn_dim, freq_dim=c.freq_dim, text_dim=c.text_dim,
                       out_dim=c.out_dim, num_heads=c.num_heads, num_layers=c.num_layers,
                       window_size=[-1, -1], qk_norm=True, cross_attn_norm=True, eps=c.eps)
        else:
            own = dict(_class_name="WanTransformer3DModel", patch_size=list(c.patch_size),
                       num_attention_heads=c.num_heads, attention_head_dim=c.head_dim,
                       in_channels=c.in_dim, out_channels=c.out_dim, text_dim=c.text_dim,
                       freq_dim=c.freq_dim, ffn_dim=c.ffn_dim, num_layers=c.num_layers,
                       cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=c.eps,
                       image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024)
    elif layout == OFFICIAL:
        own = dict(_class_name="HunyuanVideo_1_5_DiffusionTransformer",
                   patch_size=list(c.patch_size), in_channels=c.in_channels,
                   concat_condition=True, out_channels=c.out_channels,
                   hidden_size=c.hidden_size, heads_num=c.num_heads,
                   mlp_width_ratio=c.mlp_ratio, mm_double_blocks_depth=c.num_layers,
                   mm_single_blocks_depth=0, rope_dim_list=list(c.rope_axes),
                   rope_theta=c.rope_theta, text_states_dim=c.text_dim,
                   vision_states_dim=c.vision_dim, use_meanflow=c.use_meanflow)
    else:
        own = dict(_class_name="HunyuanVideo15Transformer3DModel",
                   in_channels=2 * c.in_channels + 1, out_channels=c.out_channels,
                   num_attention_heads=c.num_heads, attention_head_dim=c.head_dim,
                   num_layers=c.num_layers, num_refiner_layers=c.refiner_layers,
                   mlp_ratio=c.mlp_ratio, patch_size=c.patch_size[1],
                   patch_size_t=c.patch_size[0], qk_norm="rms_norm", text_embed_dim=c.text_dim,
                   text_embed_2_dim=c.byt5_dim, image_embed_dim=c.vision_dim,
                   rope_theta=c.rope_theta, rope_axes_dim=list(c.rope_axes),
                   use_meanflow=c.use_meanflow)
    return {**own, "static_dit": {"family": fam.name, **config_dict(config)}}


# Architecture switches of the official HunyuanVideo-1.5 config that every release shares.
_HY_FIXED = {"mm_single_blocks_depth": 0, "guidance_embed": False, "concat_condition": True,
             "glyph_byT5_v2": True, "text_states_dim_2": None, "use_cond_type_embedding": True,
             "text_projection": "single_refiner", "vision_projection": "linear"}


# Switches of WanModel_S2V that the released S2V-14B sets and modules/wan_s2v.py builds; the
# official constructor's own defaults differ (motioner on, framepack off, no AdaIN).
_S2V_RELEASED = {"enable_adain": True, "adain_mode": "attn_norm", "enable_motioner": False,
                 "enable_framepack": True, "framepack_drop_mode": "padd", "add_last_motion": True,
                 "enable_tsm": False, "trainable_token_pos_emb": False}
_S2V_OFFICIAL_DEFAULTS = {"enable_adain": False, "enable_motioner": True,
                          "enable_framepack": False, "adain_mode": "attn_norm",
                          "framepack_drop_mode": "drop", "add_last_motion": True,
                          "enable_tsm": False, "trainable_token_pos_emb": False}


def _s2v_config(values: dict):
    g = values.get
    switches = {k: g(k, _S2V_OFFICIAL_DEFAULTS[k]) for k in _S2V_RELEASED}
    # with every motion bucket kept (add_last_motion), the two drop modes compute the same
    wrong = {k: v for k, v in switches.items() if v != _S2V_RELEASED[k]
             and not (k == "framepack_drop_mode" and v == "drop")}
    if wrong or not g("cond_dim"):
        raise CheckpointError(f"config.json sets {wrong or {'cond_dim': g('cond_dim')}}; the "
                              f"S2V model here is the released one: {_S2V_RELEASED}, cond_dim > 0")
    return FAMILIES["wan_s2v"].config_cls(
        dim=g("dim"), ffn_dim=g("ffn_dim"), num_layers=g("num_layers"), num_heads=g("num_heads"),
        audio_inject_layers=tuple(g("audio_inject_layers", (0, 4, 8, 12, 16, 20, 24, 27))),
        in_dim=g("in_dim", 16), out_dim=g("out_dim", 16), cond_dim=g("cond_dim"),
        audio_dim=g("audio_dim", 5120), num_audio_token=g("num_audio_token", 4),
        motion_frames=g("motion_frames", 73), zero_timestep=bool(g("zero_timestep", False)),
        patch_size=tuple(g("patch_size", (1, 2, 2))), text_len=g("text_len", 512),
        text_dim=g("text_dim", 4096), freq_dim=g("freq_dim", 256), eps=g("eps", 1e-6))


def config_from_json(values: dict):
    """Our config from a config.json of either layout (released models) or one we saved."""
    if "static_dit" in values:
        ours = dict(values["static_dit"])
        family = FAMILIES.get(ours.pop("family", None))
        if family is None:
            raise CheckpointError(f"config.json static_dit names no known family: {values}")
        return config_from_dict(family, ours)
    cls_name = values.get("_class_name", "")
    g = values.get
    try:
        if cls_name == "WanModel_S2V" or g("model_type") == "s2v":
            return _s2v_config(values)
        if cls_name == "WanModel" or "dim" in values and "num_heads" in values:
            if g("model_type") not in ("ti2v", "i2v", "t2v"):
                raise CheckpointError(f"config.json model_type {g('model_type')!r}: expected a "
                                      "Wan2.2 ti2v, i2v or t2v model")
            return FAMILIES["wan"].config_cls(
                dim=g("dim"), ffn_dim=g("ffn_dim"), num_layers=g("num_layers"),
                num_heads=g("num_heads"), in_dim=g("in_dim"), out_dim=g("out_dim"),
                model_type=g("model_type"), patch_size=tuple(g("patch_size", (1, 2, 2))),
                text_len=g("text_len", 512), text_dim=g("text_dim", 4096),
                freq_dim=g("freq_dim", 256), eps=g("eps", 1e-6))
        if cls_name == "WanTransformer3DModel":
            if g("image_dim") or g("added_kv_proj_dim"):
                raise CheckpointError("config.json describes a Wan2.1 I2V model (image_dim / "
                                      "added_kv_proj_dim set); Wan2.2 has no CLIP branch (T8)")
            in_dim, out_dim = g("in_channels"), g("out_channels")
            heads = g("num_attention_heads")
            return FAMILIES["wan"].config_cls(
                dim=heads * g("attention_head_dim"), ffn_dim=g("ffn_dim"),
                num_layers=g("num_layers"), num_heads=heads, in_dim=in_dim, out_dim=out_dim,
                model_type="ti2v" if in_dim == out_dim else "i2v",
                patch_size=tuple(g("patch_size", (1, 2, 2))), text_dim=g("text_dim", 4096),
                freq_dim=g("freq_dim", 256), eps=g("eps", 1e-6))
        if cls_name == "HunyuanVideo_1_5_DiffusionTransformer" or "mm_double_blocks_depth" in values:
            unsupported = {k: g(k) for k, want in _HY_FIXED.items() if k in values and g(k) != want}
            if unsupported:
                raise CheckpointError(f"config.json sets {unsupported}; every released "
                                      f"HunyuanVideo-1.5 variant has {_HY_FIXED}")
            return FAMILIES["hunyuan_video15"].config_cls(
                hidden_size=g("hidden_size"), num_heads=g("heads_num"),
                num_layers=g("mm_double_blocks_depth"), in_channels=g("in_channels"),
                out_channels=g("out_channels"), patch_size=tuple(g("patch_size", (1, 1, 1))),
                rope_axes=tuple(g("rope_dim_list", (16, 56, 56))), rope_theta=g("rope_theta", 256.0),
                mlp_ratio=g("mlp_width_ratio", 4.0), text_dim=g("text_states_dim", 3584),
                vision_dim=g("vision_states_dim", 1152), use_meanflow=bool(g("use_meanflow")))
        if cls_name == "HunyuanVideo15Transformer3DModel":
            return FAMILIES["hunyuan_video15"].config_cls(
                hidden_size=g("num_attention_heads") * g("attention_head_dim"),
                num_heads=g("num_attention_heads"), num_layers=g("num_layers"),
                in_channels=(g("in_channels") - 1) // 2, out_channels=g("out_channels"),
                patch_size=(g("patch_size_t", 1), g("patch_size", 1), g("patch_size", 1)),
                rope_axes=tuple(g("rope_axes_dim")), rope_theta=g("rope_theta", 256.0),
                mlp_ratio=g("mlp_ratio", 4.0), refiner_layers=g("num_refiner_layers", 2),
                text_dim=g("text_embed_dim"), byt5_dim=g("text_embed_2_dim"),
                vision_dim=g("image_embed_dim"), use_meanflow=bool(g("use_meanflow")))
    except TypeError as err:  # a field is missing (None where a number is needed)
        raise CheckpointError(f"config.json lacks a field of {cls_name or 'the model'}: {err}") from None
    raise CheckpointError(f"config.json describes {cls_name or 'an unknown model'!r}; expected "
                          "a Wan2.2 or HunyuanVideo-1.5 transformer config (Wan2.2: T2V, I2V, TI2V, S2V)")


def _config_beside(files: list[Path]):
    candidate = files[0].parent / "config.json"
    if not candidate.is_file():
        return None
    try:
        return config_from_json(json.loads(candidate.read_text()))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{candidate}: not valid JSON ({err})") from None


# --- load --------------------------------------------------------------------------------------

def _keep_fp32(family: Family, key: str) -> bool:
    return any(p in "." + key for p in family.keep_fp32)


def _official_name(family: Family, key: str, layout: str) -> str:
    """Our name for one stored key (fp32 islands are listed in official names)."""
    return next(iter(from_layout(family.name, {key: torch.empty(0, device="meta")}, layout)))


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast a model's weights to `dtype` in place, keeping the fp32 islands a load keeps."""
    family = family_of(model.config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = _cast(p.data, family, name, dtype)
    return model


def _cast(value: torch.Tensor, family: Family, official_key: str, dtype: torch.dtype | None):
    if dtype is None or not value.is_floating_point():
        return value
    return value.to(torch.float32 if _keep_fp32(family, official_key) else dtype)


def check_against(model: nn.Module, shapes: dict[str, tuple], where: str) -> None:
    """Raise one CheckpointError line listing every key of `shapes` (a checkpoint's, from its
    headers) missing from, unexpected by or mis-shaped for `model` (a meta-device model will do)."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    misshaped = sorted(f"{k}: checkpoint {list(shapes[k])}, model {list(expected[k])}"
                       for k in set(expected) & set(shapes) if tuple(shapes[k]) != expected[k])
    if missing or unexpected or misshaped:
        # one line (the commands print errors as one): counts and the first few names of each kind
        def listing(title, items):
            more = f" (+{len(items) - 5} more)" if len(items) > 5 else ""
            return f"{title} ({len(items)}): " + ", ".join(items[:5]) + more
        kinds = [("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)]
        raise CheckpointError(f"{where} does not fit the model: "
                              + "; ".join(listing(t, items) for t, items in kinds if items))


# float8 has no aminmax kernel: it is checked as float32 in steps of this many elements, which
# bounds that copy to 16 MB.
_FLOAT8_STEP = 1 << 22


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite (True for integer and empty tensors). min and max
    propagate NaN and are infinite when any element is, so one aminmax pass decides it with no
    scratch copy (torch.isfinite builds |x| and two masks, and ran 20-25x slower on CPU)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    if tensor.element_size() == 1:
        parts = (part.float() for part in tensor.reshape(-1).split(_FLOAT8_STEP))
    else:
        parts = (tensor,)
    for part in parts:
        low, high = torch.aminmax(part)
        if not (math.isfinite(low.item()) and math.isfinite(high.item())):
            return False
    return True


def nonfinite_message(where: str, stored: torch.Tensor, dtype: torch.dtype) -> str:
    """Why a weight that failed all_finite after loading as `dtype` is unusable: non-finite in
    the file, or finite there but beyond `dtype`'s range."""
    values = stored.float() if stored.element_size() == 1 else stored
    nan, inf = int(values.isnan().sum()), int(values.isinf().sum())
    if nan or inf:
        return (f"{where} holds {nan} NaN and {inf} Inf of {values.numel()} values; a non-finite "
                "weight makes every output NaN")
    return (f"{where} has values up to {values.abs().max().item():.3g}, beyond {dtype}'s range; "
            "load it in a wider dtype")


@dataclass(frozen=True)
class _Checked:
    """A checkpoint whose headers fit the model: everything a load needs before any data."""
    files: list[Path]
    headers: dict[str, TensorInfo]
    family: Family
    layout: str
    model: nn.Module  # on the meta device
    officials: dict[str, str]  # header name -> our name (fp32 islands are listed in ours)


def _check(path, config) -> _Checked:
    """Read and check the headers against the model of `config` (default: config.json beside
    the weights): family, keys, shapes and float dtypes, before any tensor data is read."""
    files = checkpoint_files(path)
    headers = read_headers(files)
    found_family, layout = detect(headers)
    if config is None:
        config = _config_beside(files)
        if config is None:
            raise CheckpointError(f"{path}: no config.json beside the weights; name the model "
                                  f"(one of {[n for f in FAMILIES.values() for n in f.configs]})")
    config = resolve_config(config)
    family = family_of(config)
    if found_family != family.name:
        raise CheckpointError(f"{path} holds a {FAMILIES[found_family].title} checkpoint; the "
                              f"requested model is a {family.title}")

    model = build_model(config, meta=True)
    metas = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in headers.items()}
    converted = from_layout(family.name, metas, layout)
    check_against(model, {k: tuple(v.shape) for k, v in converted.items()}, str(path))
    officials = {name: _official_name(family, name, layout) for name in headers}
    expected = {k: v.dtype for k, v in model.state_dict().items()}
    for name, info in headers.items():
        # a name from_layout merges (the refiner's split q/k/v) has no entry of its own: a float too
        want = expected.get(officials[name], torch.float32)
        if want.is_floating_point and not info.dtype.is_floating_point:
            raise CheckpointError(f"{info.file}: tensor {info.stored!r} is {_CODES[info.dtype]}; "
                                  f"expected a float weight (the model holds it as {want})")
    return _Checked(files, headers, family, layout, model, officials)


def _meta_state(checked: _Checked, dtype) -> dict[str, torch.Tensor]:
    """Meta tensors, by header name, with the dtypes a load gives (cast, fp32 islands kept)."""
    return {name: _cast(torch.empty(info.shape, dtype=info.dtype, device="meta"), checked.family,
                        checked.officials[name], dtype)
            for name, info in checked.headers.items()}


def load_model(path: str | os.PathLike, config=None, *, dtype: torch.dtype | None = None,
               meta: bool = False):
    """Build the model of `config` (a name or config; default: config.json beside the weights)
    and fill it from the checkpoint at `path`. Returns (model, info dict). meta=True reads the
    headers only: a meta-device model with the shapes and dtypes the load would give."""
    checked = _check(path, config)
    files, headers, family, layout = checked.files, checked.headers, checked.family, checked.layout
    model, officials = checked.model, checked.officials

    state = {}
    for file in [] if meta else files:
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            for name, info in headers.items():
                if info.file == file:  # cast one tensor at a time: peak memory = model + 1 tensor
                    value = _cast(fh.get_tensor(info.stored), family, officials[name], dtype)
                    # checked as loaded, so a NaN or overflowing weight never reaches a run
                    if not all_finite(value):
                        raise CheckpointError(nonfinite_message(
                            f"{file}: tensor {info.stored!r}", fh.get_tensor(info.stored),
                            value.dtype))
                    state[name] = value
    if meta:
        state = _meta_state(checked, dtype)
    state = from_layout(family.name, state, layout)
    model.load_state_dict(state, strict=True, assign=True)
    info = {"family": family.name, "layout": layout, "files": [str(f) for f in files],
            "tensors": len(state)}
    return model, info



# --- open: check now, read later, a slice at a time ---------------------------------------------

@dataclass(frozen=True)
class Rows:
    """Rows [start, stop) along dim 0 of one stored tensor (by header name)."""
    name: str
    start: int
    stop: int


@dataclass(frozen=True)
class ParamSource:
    """Where one parameter's values lie: its dim 0 is the stored row ranges `parts`, one after
    another, every other dim as stored; `dtype` is the one a load gives it."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[Rows, ...]


_ROW_BITS = 40  # a row number's bits in a row id; the stored tensor's index sits above them


def _row_sources(checked: _Checked) -> dict[str, tuple[Rows, ...]]:
    """Each parameter's stored rows, found by running the layout conversion (`from_layout`, the
    one place it is written) on row ids: per stored tensor, a vector whose entry i names its
    row i. The conversions are renames, row reorders and row concatenations (dim 0), so what
    comes out says where every row of every parameter comes from."""
    names = sorted(checked.headers)
    ids = {name: torch.arange(_rows(checked.headers[name].shape), dtype=torch.int64) + (k << _ROW_BITS)
           for k, name in enumerate(names)}
    out = {}
    for param, row_ids in from_layout(checked.family.name, ids, checked.layout).items():
        which, row = row_ids >> _ROW_BITS, row_ids & ((1 << _ROW_BITS) - 1)
        # a run ends where the source tensor changes or a row does not follow the one before
        breaks = torch.nonzero((which[1:] != which[:-1]) | (row[1:] != row[:-1] + 1)).flatten() + 1
        bounds = [0, *breaks.tolist(), len(row_ids)]
        out[param] = tuple(Rows(names[int(which[a])], int(row[a]), int(row[b - 1]) + 1)
                           for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a)
    return out


def _rows(shape: tuple[int, ...]) -> int:
    """Rows of a stored tensor: its dim 0 (a 0-d tensor is one row of one value)."""
    return shape[0] if shape else 1


class CheckpointReader:
    """A checked checkpoint's parameters, read by rows straight from the files: positional reads
    of just those rows' bytes (no mapping of the file, no read of other rows), then cast and
    checked finite as `load_model` does. Thread-safe; the reads release the GIL.

    `sources` says, per parameter (our name), its shape, loaded dtype and stored rows;
    `bytes_read` counts the tensor bytes read so far.
    """

    def __init__(self, checked: _Checked, dtype: torch.dtype | None, params: dict[str, torch.Tensor]):
        self._checked, self._dtype = checked, dtype
        rows = _row_sources(checked)
        self.sources = {}
        for name, p in params.items():
            parts = rows[name]
            headers = [checked.headers[r.name] for r in parts]
            if sum(r.stop - r.start for r in parts) != _rows(tuple(p.shape)) or \
                    any(tuple(h.shape[1:]) != tuple(p.shape[1:]) for h in headers):
                raise CheckpointError(f"{name}: its layout conversion is not a map of stored rows; "
                                      "it cannot be read in slices")
            self.sources[name] = ParamSource(tuple(p.shape), p.dtype, parts)
        self.bytes_read = 0
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of parameter `name` (default: all of it), every other dim whole,
        in the dtype a load gives; CheckpointError if a value is not finite."""
        source = self.sources[name]
        n = _rows(source.shape)
        start, stop = 0 if start is None else start, n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise IndexError(f"{name}: rows [{start}, {stop}) of {n}")
        pieces, at = [], 0
        for part in source.parts:
            size = part.stop - part.start
            lo, hi = max(start, at), min(stop, at + size)
            if lo < hi:
                pieces.append(self._stored_rows(part.name, part.start + lo - at,
                                                part.start + hi - at, source.dtype))
            at += size
        if not source.shape:
            return pieces[0].reshape(())
        if not pieces:
            return torch.empty((0, *source.shape[1:]), dtype=source.dtype)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _stored_rows(self, name: str, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        info = self._checked.headers[name]
        row_bytes = math.prod(info.shape[1:]) * info.dtype.itemsize
        nbytes = (stop - start) * row_bytes
        raw = _read_at(self._fd(info.file), info.offset + start * row_bytes, nbytes, info.file)
        with self._lock:
            self.bytes_read += nbytes
        stored = (torch.frombuffer(raw, dtype=info.dtype) if nbytes
                  else torch.empty(0, dtype=info.dtype)).reshape(stop - start, *info.shape[1:])
        value = _cast(stored, self._checked.family, self._checked.officials[name], self._dtype)
        if value.dtype != dtype:  # pieces of one parameter stored in different float dtypes
            value = value.to(dtype)
        if not all_finite(value):
            part = "" if stop - start == _rows(info.shape) else f" rows {start}-{stop - 1}"
            raise CheckpointError(nonfinite_message(f"{info.file}: tensor {info.stored!r}{part}",
                                                    stored, value.dtype))
        return value

    def _fd(self, file: Path) -> int:
        with self._lock:
            if file not in self._fds:
                try:
                    self._fds[file] = os.open(file, os.O_RDONLY)
                except OSError as err:
                    raise CheckpointError(f"{file}: cannot be read ({err.strerror or err})") from None
            return self._fds[file]

    @property
    def checkpoint_bytes(self) -> int:
        """Tensor bytes in the checkpoint's files, all of them."""
        return sum(math.prod(h.shape) * h.dtype.itemsize for h in self._checked.headers.values())

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _read_at(fd: int, offset: int, nbytes: int, file: Path) -> bytearray:
    """nbytes of a file from offset, read straight into a new buffer (the GIL is released while
    the kernel copies)."""
    buf = bytearray(nbytes)
    view, done = memoryview(buf), 0
    try:
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise CheckpointError(f"{file}: truncated since its header was checked (no data "
                                      f"at byte {offset + done})")
            done += got
    except OSError as err:
        raise CheckpointError(f"{file}: cannot be read ({err.strerror or err})") from None
    return buf


def open_checkpoint(path: str | os.PathLike, config=None, *, dtype: torch.dtype | None = None):
    """The model of `config` on the meta device (names, shapes, the dtypes a load gives) and a
    CheckpointReader of its weights: every check of `load_model` on the headers now, the data
    later, read by whoever places the weights and only the rows they ask for. Returns
    (model, reader, info dict); close the reader (or use it as a context manager) when done."""
    checked = _check(path, config)
    state = from_layout(checked.family.name, _meta_state(checked, dtype), checked.layout)
    model = checked.model
    model.load_state_dict(state, strict=True, assign=True)
    reader = CheckpointReader(checked, dtype, dict(model.named_parameters()))
    info = {"family": checked.family.name, "layout": checked.layout,
            "files": [str(f) for f in checked.files], "tensors": len(state)}
    return model, reader, info

# --- save --------------------------------------------------------------------------------------

def save_checkpoint(model: nn.Module, directory: str | os.PathLike, *, layout: str = OFFICIAL,
                    max_shard_bytes: int | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write weights (sharded with an index when larger than max_shard_bytes) and config.json.

    The directory must not exist yet (nothing is overwritten); files are written to a
    temporary sibling and renamed into place, so a failure leaves no partial checkpoint.
    """
    if layout not in LAYOUTS:
        raise CheckpointError(f"layout {layout!r}: expected one of {LAYOUTS}")
    config_json = config_to_json(model.config, layout)  # refuses a layout the family lacks
    directory = Path(directory)
    if directory.exists():
        raise CheckpointError(f"{directory} already exists; choose a new directory")
    family = family_of(model.config)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    # safetensors refuses tensors that share storage (the split refiner qkv): copy those views.
    state = {k: v.contiguous().clone() if _is_view(v) else v.contiguous()
             for k, v in to_layout(family.name, state, layout).items()}

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(state):
        nbytes = state[key].numel() * state[key].element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = state[key]
        size += nbytes

    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        if len(shards) == 1:
            save_file(shards[0], str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                name = f"diffusion_pytorch_model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, name))
            total = sum(v.numel() * v.element_size() for v in state.values())
            (tmp / INDEX_NAME).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2))
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _is_view(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() != t.numel() * t.element_size()


# --- which weights a profile was measured on ------------------------------------------------------

FINGERPRINT_SAMPLES = 8  # parameters whose first values enter the fingerprint


def fingerprint(shapes: dict[str, tuple[int, ...]], first_row) -> str:
    """A short identity of a set of weights: sha256 over every parameter's name and shape, and
    the first 16 values of the first row of FINGERPRINT_SAMPLES of them (evenly spaced in name
    order), rounded to bf16 so that the dtype they were loaded in does not change it.
    `first_row(name)` -> that parameter's rows [0, 1) (any dtype, any device)."""
    digest = hashlib.sha256()
    names = sorted(shapes)
    for name in names:
        digest.update(f"{name}:{tuple(shapes[name])};".encode())
    sampled = [n for n in names if len(shapes[n]) > 0]
    step = max(1, len(sampled) // FINGERPRINT_SAMPLES)
    for name in sampled[::step][:FINGERPRINT_SAMPLES]:
        values = first_row(name).detach().reshape(-1)[:16].to("cpu", torch.bfloat16).float()
        digest.update(values.numpy().tobytes())
    return digest.hexdigest()[:16]


def model_fingerprint(model: nn.Module) -> str:
    """`fingerprint` of a model's own (host) weights."""
    params = dict(model.named_parameters())
    return fingerprint({n: tuple(p.shape) for n, p in params.items()}, lambda n: params[n][:1])


def reader_fingerprint(model: nn.Module, reader: CheckpointReader) -> str:
    """`fingerprint` of the weights a checkpoint reader would place into `model` (a meta
    model): the same value as `model_fingerprint` of the loaded model, reading a few rows."""
    return fingerprint({n: tuple(p.shape) for n, p in model.named_parameters()},
                       lambda n: reader.read(n, 0, 1))

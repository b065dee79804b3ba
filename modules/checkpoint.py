"""Load and save DiT checkpoints: official or diffusers layout, one file or shards with an index.

Loading reads the safetensors headers first (`modules.safetensors_reader`) and checks every key
and shape against a model built on the meta device, so a wrong family, a missing shard or a
mis-shaped tensor fails in seconds with one error that lists everything, before any tensor data
is read. Tensors are then read one by one, cast, checked finite, and assigned into the meta
model: no second full copy in memory. What is family-specific (marker keys, config.json
vocabularies, the diffusers key mapping) is each family's `CheckpointFormat`, found through
`modules.registry`. Every CheckpointError message is one line.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from modules.layouts import LAYOUTS, OFFICIAL, CheckpointError
from modules.registry import (
    FAMILIES,
    Family,
    build_model,
    config_dict,
    config_from_dict,
    family_of,
    resolve_config,
)
from modules.safetensors_reader import (
    DTYPE_CODES,
    RowReader,
    TensorInfo,
    checkpoint_files,
    read_headers,
    read_tensors,
)

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"


def detect(keys) -> tuple[str, str]:
    """(family, layout) of a state dict's keys."""
    keys = set(keys)
    markers = {(f.name, layout): marker for f in FAMILIES.values()
               for layout, marker in f.format.markers.items()}
    found = [fl for fl, marker in markers.items() if marker in keys]
    # a family whose checkpoints hold another's keys and more (S2V: a Wan DiT's and an audio
    # branch's) wins over that one in the same layout
    extended = {(FAMILIES[family].format.extends, layout) for family, layout in found}
    found = [fl for fl in found if fl not in extended]
    if len(found) != 1:
        sample = sorted(keys)[:5]
        raise CheckpointError("not a Wan2.2 or HunyuanVideo-1.5 DiT checkpoint in a known layout: "
                              f"expected one of the keys {sorted(markers.values())}; "
                              f"found {len(keys)} keys such as {sample}")
    family, layout = found[0]
    FAMILIES[family].format.check_keys(keys)
    return family, layout


# --- config.json -------------------------------------------------------------------------------

def config_to_json(config, layout: str) -> dict:
    """config.json in a layout's own vocabulary, plus our exact config under `static_dit`."""
    family = family_of(config)
    own = family.format.config_to_json(config, layout)
    return {**own, "static_dit": {"family": family.name, **config_dict(config)}}


def config_from_json(values: dict):
    """Our config from a config.json of either layout (released models) or one we saved."""
    if "static_dit" in values:
        ours = dict(values["static_dit"])
        family = FAMILIES.get(ours.pop("family", None))
        if family is None:
            raise CheckpointError(f"config.json static_dit names no known family: {values}")
        return config_from_dict(family, ours)
    cls_name = values.get("_class_name", "")
    # a family that extends another reads as that one too (S2V's config has Wan's fields): first
    families = sorted(FAMILIES.values(), key=lambda f: f.format.extends is None)
    try:
        for family in families:
            config = family.format.config_from_json(values)
            if config is not None:
                return config
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
    return next(iter(family.format.from_layout({key: torch.empty(0, device="meta")}, layout)))


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
    converted = family.format.from_layout(metas, layout)
    check_against(model, {k: tuple(v.shape) for k, v in converted.items()}, str(path))
    officials = {name: _official_name(family, name, layout) for name in headers}
    expected = {k: v.dtype for k, v in model.state_dict().items()}
    for name, info in headers.items():
        # a name from_layout merges (the refiner's split q/k/v) has no entry of its own: a float too
        want = expected.get(officials[name], torch.float32)
        if want.is_floating_point and not info.dtype.is_floating_point:
            raise CheckpointError(f"{info.file}: tensor {info.stored!r} is {DTYPE_CODES[info.dtype]}; "
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
        names = {info.stored: name for name, info in headers.items() if info.file == file}
        for stored_name, stored in read_tensors(file, names):
            # cast one tensor at a time: peak memory = model + 1 tensor
            value = _cast(stored, family, officials[names[stored_name]], dtype)
            # checked as loaded, so a NaN or overflowing weight never reaches a run
            if not all_finite(value):
                raise CheckpointError(nonfinite_message(f"{file}: tensor {stored_name!r}", stored,
                                                        value.dtype))
            state[names[stored_name]] = value
            del stored  # before the next one is read
    if meta:
        state = _meta_state(checked, dtype)
    state = family.format.from_layout(state, layout)
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
    for param, row_ids in checked.family.format.from_layout(ids, checked.layout).items():
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
        self._row_reader = RowReader()

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
        stored = self._row_reader.read(info, start, stop)
        value = _cast(stored, self._checked.family, self._checked.officials[name], self._dtype)
        if value.dtype != dtype:  # pieces of one parameter stored in different float dtypes
            value = value.to(dtype)
        if not all_finite(value):
            part = "" if stop - start == _rows(info.shape) else f" rows {start}-{stop - 1}"
            raise CheckpointError(nonfinite_message(f"{info.file}: tensor {info.stored!r}{part}",
                                                    stored, value.dtype))
        return value

    @property
    def bytes_read(self) -> int:
        """Tensor bytes read so far."""
        return self._row_reader.bytes_read

    @property
    def checkpoint_bytes(self) -> int:
        """Tensor bytes in the checkpoint's files, all of them."""
        return sum(math.prod(h.shape) * h.dtype.itemsize for h in self._checked.headers.values())

    def close(self) -> None:
        self._row_reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_checkpoint(path: str | os.PathLike, config=None, *, dtype: torch.dtype | None = None):
    """The model of `config` on the meta device (names, shapes, the dtypes a load gives) and a
    CheckpointReader of its weights: every check of `load_model` on the headers now, the data
    later, read by whoever places the weights and only the rows they ask for. Returns
    (model, reader, info dict); close the reader (or use it as a context manager) when done."""
    checked = _check(path, config)
    state = checked.family.format.from_layout(_meta_state(checked, dtype), checked.layout)
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
             for k, v in family.format.to_layout(state, layout).items()}

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

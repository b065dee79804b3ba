"""Safetensors files read without trusting them: which files a checkpoint path names (one file,
an index JSON or a folder of either), their headers checked as strictly as the safetensors
library checks them, whole tensors one at a time, and rows of a tensor by positional reads.
Knows nothing of models or layouts; every CheckpointError message is one line.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from modules.layouts import CheckpointError

PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")  # single-file exports

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}

# The safetensors library refuses headers over 100 MB; so do we, before reading one into memory.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    stored: str  # the name in the file, before a single-file export prefix is stripped
    offset: int = 0  # where its data begins in the file (bytes from the file's start)


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
    dtype = DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise CheckpointError(f"{where}: dtype {_brief(code)}; expected one of {sorted(DTYPES)}")
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
    """Every file's tensors by name, with a prefix that all of them share (single-file exports,
    PREFIXES) stripped."""
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in read_header(file).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} is in both {tensors[name].file} and {file}")
            tensors[name] = info
    prefix = next((p for p in PREFIXES if tensors and all(k.startswith(p) for k in tensors)), "")
    return {k[len(prefix):]: v for k, v in tensors.items()}


# --- data --------------------------------------------------------------------------------------

def read_tensors(file: Path, stored_names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(stored name, tensor) for each name, read from one file one tensor at a time."""
    with safe_open(str(file), framework="pt", device="cpu") as fh:
        for name in stored_names:
            yield name, fh.get_tensor(name)


def read_at(fd: int, offset: int, nbytes: int, file: Path) -> bytearray:
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


class RowReader:
    """Rows of stored tensors read by position straight from their files (no mapping of the
    file, no read of other rows), in the stored dtype. Thread-safe; the reads release the GIL.
    `bytes_read` counts the tensor bytes read so far."""

    def __init__(self):
        self.bytes_read = 0
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def read(self, info: TensorInfo, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the tensor `info` describes, every other dim whole."""
        row_bytes = math.prod(info.shape[1:]) * info.dtype.itemsize
        nbytes = (stop - start) * row_bytes
        raw = read_at(self._fd(info.file), info.offset + start * row_bytes, nbytes, info.file)
        with self._lock:
            self.bytes_read += nbytes
        return (torch.frombuffer(raw, dtype=info.dtype) if nbytes
                else torch.empty(0, dtype=info.dtype)).reshape(stop - start, *info.shape[1:])

    def _fd(self, file: Path) -> int:
        with self._lock:
            if file not in self._fds:
                try:
                    self._fds[file] = os.open(file, os.O_RDONLY)
                except OSError as err:
                    raise CheckpointError(f"{file}: cannot be read ({err.strerror or err})") from None
            return self._fds[file]

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

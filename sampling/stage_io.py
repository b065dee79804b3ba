"""Stage files, compatible with the existing TPU port's pipeline (tpu_notes 1.2).

    <dir>/stage1_embeddings.safetensors   text (and image) embeddings, written by stage 1
    <dir>/generation_config.json          settings; each stage adds its fields
    <dir>/stage2_latents.safetensors      key `latents` [1, C, F, H, W], metadata as strings

Everything is checked before sampling starts (missing file or key, wrong shape or dtype, bad
JSON, an output folder that cannot take the files), and every write is atomic: files are written
under temporary names, then renamed in pairs, so a failure (a full disk, SIGINT/SIGTERM) leaves
no partial output and the previous pair as it was. A pair is renamed in under an exclusive lock
on the folder (read under a shared one), so two runs writing the same folder at once leave one
run's pair, never one file of each.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import tempfile
from collections.abc import Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .interrupt import deferred
from .pipelines import TensorSpec

EMBEDDINGS = "stage1_embeddings.safetensors"
LATENTS = "stage2_latents.safetensors"
CONFIG = "generation_config.json"


class StageFileError(ValueError):
    """A stage file is missing, unreadable or does not match what the pipeline expects."""


def _dtype_from_name(name: str):
    return getattr(torch, name.removeprefix("torch."), None)


def read_config(directory: str) -> dict:
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise StageFileError(f"{path} is missing; expected the {CONFIG} that stage 1 writes")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise StageFileError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise StageFileError(f"{path} holds a {type(config).__name__}; expected a JSON object")
    return config


def read_tensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of a safetensors file and its metadata; bf16 saved as fp32 with a
    `dtype_info` entry (the Wan utils of the TPU port do that) comes back as bf16."""
    if not os.path.isfile(path):
        raise StageFileError(f"{path} is missing")
    try:
        tensors = load_file(path)
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            metadata = dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as exc:
        raise StageFileError(f"{path} is not a readable safetensors file: {exc}") from None
    try:
        info = json.loads(metadata.get("dtype_info", "{}"))
    except json.JSONDecodeError:
        info = {}
    for key, name in (info.items() if isinstance(info, dict) else ()):
        dtype = _dtype_from_name(str(name))
        if key in tensors and isinstance(dtype, torch.dtype) and tensors[key].dtype != dtype:
            tensors[key] = tensors[key].to(dtype)
    return tensors, metadata


def check_tensors(tensors: Mapping[str, torch.Tensor], specs: Mapping[str, TensorSpec],
                  source: str) -> None:
    """Raise StageFileError naming the first key whose presence, shape or dtype is wrong."""
    missing = [k for k, s in specs.items() if s.required and k not in tensors]
    if missing:
        raise StageFileError(f"{source} lacks {', '.join(missing)}; expected keys "
                             f"{', '.join(specs)}")
    for key, spec in specs.items():
        if key not in tensors:
            continue
        t = tensors[key]
        shape = tuple(t.shape)
        if len(shape) != len(spec.shape) or any(w is not None and w != n
                                                for w, n in zip(spec.shape, shape, strict=False)):
            want = "[" + ", ".join("*" if w is None else str(w) for w in spec.shape) + "]"
            raise StageFileError(f"{source}: {key} has shape {list(shape)}; expected {want}"
                                 + (f" ({spec.doc})" if spec.doc else ""))
        if t.dtype not in spec.dtypes:
            raise StageFileError(f"{source}: {key} has dtype {t.dtype}; expected one of "
                                 f"{', '.join(str(d) for d in spec.dtypes)}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise StageFileError(f"{source}: {key} holds NaN or Inf values")


def read_stage1(directory: str, specs: Mapping[str, TensorSpec]):
    """(tensors, generation config) of a stage-1 directory, checked against `specs`."""
    if not os.path.isdir(directory):
        raise StageFileError(f"--input_dir {directory} is not a directory")
    config = read_config(directory)
    path = os.path.join(directory, EMBEDDINGS)
    tensors, _ = read_tensors(path)
    check_tensors(tensors, specs, path)
    return tensors, config


def _temporary(directory: str, name: str, suffix: str = ".tmp") -> str:
    fd, path = tempfile.mkstemp(prefix=f".{name}.", suffix=suffix, dir=directory)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)  # mkstemp makes 0600; outputs get the usual permissions
    return path


def write_stage(directory: str, tensors: Mapping[str, torch.Tensor], tensors_name: str,
                metadata: Mapping[str, object], config: Mapping) -> dict[str, str]:
    """Write a tensors file and the generation config atomically (both or neither)."""
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    meta["dtype_info"] = json.dumps({k: str(t.dtype) for k, t in tensors.items()})
    return _write_with_config(
        directory, tensors_name, ".tmp",
        lambda tmp: save_file({k: t.contiguous() for k, t in tensors.items()}, tmp, metadata=meta),
        config)


def _write_with_config(directory: str, name: str, suffix: str, write_payload,
                       config: Mapping) -> dict[str, str]:
    """write_payload(a temporary path ending in `suffix`), the config beside it, then both renamed
    in (both or neither); the temporary files never outlive the call. An OSError (a full disk)
    becomes a StageFileError saying which file could not be written."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise StageFileError(f"output directory {directory} exists and is not a directory")
    temps = []
    try:
        os.makedirs(directory, exist_ok=True)
        for taken in (name, CONFIG):
            if os.path.isdir(os.path.join(directory, taken)):
                raise StageFileError(_taken_by_folder(directory, taken))
        payload_tmp = _temporary(directory, name, suffix)
        temps.append(payload_tmp)
        write_payload(payload_tmp)
        config_tmp = _temporary(directory, CONFIG)
        temps.append(config_tmp)
        with open(config_tmp, "w") as f:
            json.dump(dict(config), f, indent=2, default=str)
            f.write("\n")
        paths = {name: os.path.join(directory, name), CONFIG: os.path.join(directory, CONFIG)}
        with folder_lock(directory, exclusive=True), deferred():
            _replace_both(payload_tmp, paths[name], config_tmp, paths[CONFIG])
        return paths
    except OSError as exc:
        raise StageFileError(f"could not write {name} and {CONFIG} in {directory}: "
                             f"{exc.strerror or exc}"
                             + (" (the disk is full)" if exc.errno == errno.ENOSPC else "")
                             + "; nothing was written, and files of earlier runs are as they "
                             "were") from None
    finally:
        with deferred():  # an interruption here would leave a temporary file behind
            for tmp in temps:
                if os.path.exists(tmp):
                    os.remove(tmp)


def atomic_write(path: str, write, mode: str = "w") -> None:
    """write(file object) to a temporary file beside `path`, then renamed in: no partial file,
    and no temporary one, outlives a failure or an interruption."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = _temporary(folder, os.path.basename(path))
    try:
        with open(tmp, mode) as f:
            write(f)
        os.replace(tmp, path)
    finally:
        with deferred():
            if os.path.exists(tmp):
                os.remove(tmp)


@contextlib.contextmanager
def folder_lock(directory: str, *, exclusive: bool):
    """flock on the folder itself (no lock file is left behind): writers of a pair exclude each
    other and readers, so a pair is never seen or left half from one run."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


def _taken_by_folder(directory: str, name: str) -> str:
    return (f"--output_dir {directory}: {os.path.join(directory, name)} is a folder; expected that "
            f"name free for the {name} file (move the folder away)")


def _replace_both(tensor_tmp, tensor_path, config_tmp, config_path):
    """Two renames; if the second fails, the first is undone (the previous file comes back)."""
    backup = None
    if os.path.exists(tensor_path):
        backup = _temporary(os.path.dirname(tensor_path), "previous")
        os.replace(tensor_path, backup)
    try:
        os.replace(tensor_tmp, tensor_path)
        os.replace(config_tmp, config_path)
    except BaseException:
        if os.path.exists(tensor_path):
            os.remove(tensor_path)
        if backup is not None:
            os.replace(backup, tensor_path)
        raise
    if backup is not None:
        os.remove(backup)


def write_stage2(directory: str, latents: torch.Tensor, metadata: Mapping[str, object],
                 config: Mapping) -> dict[str, str]:
    return write_stage(directory, {"latents": latents}, LATENTS, metadata, config)


def read_stage2(directory: str):
    """(latents, metadata, generation config) written by stage 2, read as one pair."""
    lock = folder_lock(directory, exclusive=False) if os.path.isdir(directory) else \
        contextlib.nullcontext()
    with lock:
        tensors, metadata = read_tensors(os.path.join(directory, LATENTS))
        config = read_config(directory)
    if "latents" not in tensors:
        raise StageFileError(f"{os.path.join(directory, LATENTS)} lacks the key 'latents'")
    return tensors["latents"], metadata, config


# --- stage 3: the video -------------------------------------------------------------------------

VIDEO = "output_video.mp4"


def _probe(folder: str) -> None:
    """Create and remove a file in `folder`: the one check that holds as root and on read-only
    or pseudo file systems, where permission bits say nothing."""
    os.remove(_temporary(folder, "write-check"))


def check_writable(directory: str, flag: str = "--output_dir", names: tuple[str, ...] = (),
                   hint: str = "") -> None:
    """Raise StageFileError unless `directory` is, or can be made, a folder we can create files
    in, and none of `names` in it is held by a folder. Creates nothing (a missing folder is made
    when its files are written)."""
    if not directory:
        raise StageFileError(f"{flag} {directory!r}: expected a folder path{hint}")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise StageFileError(f"{flag} {directory} exists and is not a directory; expected a "
                             f"folder to write into{hint}")
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise StageFileError(f"{flag} {directory}: {existing} is a file; expected a folder to "
                             f"write into{hint}")
    try:
        _probe(existing)
    except OSError as exc:
        where = "" if existing == os.path.abspath(directory) else f" (in {existing})"
        raise StageFileError(f"{flag} {directory} is not writable{where}: {exc.strerror or exc}; "
                             f"expected a folder you can create files in{hint}") from None
    for name in names:
        if os.path.isdir(os.path.join(directory, name)):
            raise StageFileError(_taken_by_folder(directory, name).replace("--output_dir", flag, 1))


def check_writable_file(flag: str, path: str | None) -> None:
    """Refuse, before any work, a report path that is empty or a folder, or whose folder is
    missing or cannot take a new file."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path)) if path else ""
    if not path or os.path.isdir(path) or not os.path.isdir(folder):
        raise StageFileError(f"{flag} {path!r}: expected a file in an existing, writable folder")
    try:
        _probe(folder)
    except OSError as exc:
        raise StageFileError(f"{flag} {path}: its folder {folder} is not writable "
                             f"({exc.strerror or exc}); expected a file in an existing, writable "
                             "folder") from None


def write_video(directory: str, frames, fps: float, config: Mapping,
                quality: int = 8) -> dict[str, str]:
    """Encode frames [F, H, W, 3] uint8 as H.264 mp4 and write it with the generation config,
    atomically (both or neither): the video goes to a temporary file in `directory` first.
    `quality` is imageio's 1-10 (8, as the official Wan scripts write, is x264 CRF 10)."""
    import imageio.v2 as imageio

    def encode(video_tmp):
        # macro_block_size 1 keeps the size exact (the VAE strides make it even, as yuv420p needs)
        writer = imageio.get_writer(video_tmp, format="FFMPEG", mode="I", fps=fps,
                                    codec="libx264", quality=quality, macro_block_size=1)
        try:
            for frame in frames:
                writer.append_data(frame)
        finally:
            writer.close()

    # the temporary name ends in .mp4: imageio picks the ffmpeg writer by the extension
    return _write_with_config(directory, VIDEO, ".mp4", encode, config)

"""Stage files, compatible with the existing TPU port's pipeline (tpu_notes 1.2).

    <dir>/stage1_embeddings.safetensors   text (and image) embeddings, written by stage 1
    <dir>/generation_config.json          settings; each stage adds its fields
    <dir>/stage2_latents.safetensors      key `latents` [1, C, F, H, W], metadata as strings

Everything is checked before sampling starts (missing file or key, wrong shape or dtype, bad
JSON), and every write is atomic: files are written under temporary names, then renamed, so a
failure leaves no partial output.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

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


def _temporary(directory: str, name: str) -> str:
    fd, path = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)  # mkstemp makes 0600; outputs get the usual permissions
    return path


def write_stage(directory: str, tensors: Mapping[str, torch.Tensor], tensors_name: str,
                metadata: Mapping[str, object], config: Mapping) -> dict[str, str]:
    """Write a tensors file and the generation config atomically (both or neither)."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise StageFileError(f"output directory {directory} exists and is not a directory")
    os.makedirs(directory, exist_ok=True)
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    meta["dtype_info"] = json.dumps({k: str(t.dtype) for k, t in tensors.items()})
    return _write_with_config(
        directory, tensors_name, _temporary(directory, tensors_name),
        lambda tmp: save_file({k: t.contiguous() for k, t in tensors.items()}, tmp, metadata=meta),
        config)


def _write_with_config(directory: str, name: str, payload_tmp: str, write_payload,
                       config: Mapping) -> dict[str, str]:
    """write_payload(payload_tmp), the config beside it, then both renamed in (both or neither);
    the temporary files never outlive the call."""
    temps = [payload_tmp]
    try:
        write_payload(payload_tmp)
        config_tmp = _temporary(directory, CONFIG)
        temps.append(config_tmp)
        with open(config_tmp, "w") as f:
            json.dump(dict(config), f, indent=2, default=str)
            f.write("\n")
        paths = {name: os.path.join(directory, name), CONFIG: os.path.join(directory, CONFIG)}
        _replace_both(payload_tmp, paths[name], config_tmp, paths[CONFIG])
        return paths
    finally:
        for tmp in temps:
            if os.path.exists(tmp):
                os.remove(tmp)


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
    """(latents, metadata, generation config) written by stage 2."""
    tensors, metadata = read_tensors(os.path.join(directory, LATENTS))
    if "latents" not in tensors:
        raise StageFileError(f"{os.path.join(directory, LATENTS)} lacks the key 'latents'")
    return tensors["latents"], metadata, read_config(directory)


# --- stage 3: the video -------------------------------------------------------------------------

VIDEO = "output_video.mp4"


def check_writable(directory: str) -> None:
    """Raise StageFileError unless files can be created in `directory` (made if missing)."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise StageFileError(f"--output_dir {directory} exists and is not a directory; expected a "
                             "folder to write into")
    try:
        os.makedirs(directory, exist_ok=True)
        os.remove(_temporary(directory, "write-check"))
    except OSError as exc:
        raise StageFileError(f"--output_dir {directory} is not writable ({exc.strerror}); expected "
                             "a folder you can create files in") from None


def write_video(directory: str, frames, fps: float, config: Mapping,
                quality: int = 8) -> dict[str, str]:
    """Encode frames [F, H, W, 3] uint8 as H.264 mp4 and write it with the generation config,
    atomically (both or neither): the video goes to a temporary file in `directory` first.
    `quality` is imageio's 1-10 (8, as the official Wan scripts write, is x264 CRF 10)."""
    import imageio.v2 as imageio

    check_writable(directory)

    def encode(video_tmp):
        # macro_block_size 1 keeps the size exact (the VAE strides make it even, as yuv420p needs)
        writer = imageio.get_writer(video_tmp, format="FFMPEG", mode="I", fps=fps,
                                    codec="libx264", quality=quality, macro_block_size=1)
        try:
            for frame in frames:
                writer.append_data(frame)
        finally:
            writer.close()

    return _write_with_config(directory, VIDEO, _temporary_video(directory), encode, config)


def _temporary_video(directory: str) -> str:
    """Like _temporary, but ending in .mp4: imageio picks the ffmpeg writer by the extension."""
    path = _temporary(directory, VIDEO)
    os.replace(path, path + ".mp4")
    return path + ".mp4"

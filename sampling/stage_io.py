"""Stage files, compatible with the existing TPU port's pipeline (tpu_notes 1.2).

    <dir>/stage1_embeddings.safetensors   text (and image) embeddings, written by stage 1
    <dir>/generation_config.json          settings; each stage adds its fields
    <dir>/stage2_latents.safetensors      key `latents` [1, C, F, H, W], metadata as strings
                                          (speech-to-video: also what stage 3 decodes the
                                          clips with, `sampling.clips.decode_inputs`)
    <dir>/output_video.mp4                the video stage 3 decodes

Everything is checked before sampling starts (missing file or key, wrong shape or dtype, bad
JSON, an output path that cannot be created or would overwrite an input). Every write goes
through temporary files and a commit journal (`sampling.journal`): a failure (a full disk,
SIGINT/SIGTERM, kill -9 at any instruction) leaves the previous outputs or the new ones, whole,
and the next writer or reader of the folder finishes or cleans what was left. A pair is
committed under an exclusive lock on the folder, so two runs writing the same folder at once
leave one run's pair, never one file of each; a pair id ties the latents to their config.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import uuid
from collections.abc import Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from cache.validate import FieldError, present, read_json
from sampling.errors import StageFileError

from .journal import (
    FILE_MODE,
    JOURNAL,
    PROBE,
    TEMP_ROOM,
    Commit,
    Staged,
    folder_lock,
    probe,
    remove_stale,
    roll_forward,
    sync,
    temp_prefix,
)
from .pipelines import TensorSpec
from .video_file import encode_mp4

__all__ = [
    "CONFIG", "EMBEDDINGS", "LATENTS", "MAX_ABS", "PAIR_ID", "STAGE3_FIELDS", "VIDEO",
    "check_creatable", "check_distinct", "check_tensors", "check_writable",
    "check_writable_file", "read_config", "read_stage1", "read_stage2", "read_stage2_tensors",
    "read_tensors", "recover", "write_stage", "write_stage2", "write_tensors", "write_video"
]

EMBEDDINGS = "stage1_embeddings.safetensors"
LATENTS = "stage2_latents.safetensors"
CONFIG = "generation_config.json"
VIDEO = "output_video.mp4"
# what stage 3 adds to the config: a stage-2 rerun drops them (they describe the old latents' video)
STAGE3_FIELDS = ("output_video", "stage3_decode_time", "vae", "vae_dtype", "video_frames",
                 "video_height", "video_width", "video_enlarged", "vae_patch_parallel_ranks",
                 "vae_patch_grid", "vae_tiled")
PAIR_ID = "stage2_pair_id"  # in the latents' metadata and the config: one id per written pair


# the largest magnitude a stage-1 tensor may hold: text encoders' hidden states reach ~1e3 (LLM
# outlier features), far below the 1e19 whose square overflows fp32 in a norm
MAX_ABS = 1e6


def _dtype_from_name(name: str):
    return getattr(torch, name.removeprefix("torch."), None)


def read_config(directory: str) -> dict:
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise StageFileError(f"{path} is missing; expected the {CONFIG} that stage 1 writes")
    try:
        config = read_json(path)
    except FieldError as exc:
        raise StageFileError(f"{path} {exc}") from None
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
    for key, spec, t in present(specs, tensors):
        shape = tuple(t.shape)
        if len(shape) != len(spec.shape) or any(w is not None and w != n
                                                for w, n in zip(spec.shape, shape, strict=False)):
            want = "[" + ", ".join("*" if w is None else str(w) for w in spec.shape) + "]"
            raise StageFileError(f"{source}: {key} has shape {list(shape)}; expected {want}"
                                 + (f" ({spec.doc})" if spec.doc else ""))
        for dim, (n, most) in enumerate(zip(shape, spec.most or (), strict=False)):
            if most is not None and n > most:
                raise StageFileError(f"{source}: {key} has {n} entries along dim {dim} (shape "
                                     f"{list(shape)}); expected at most {most}, the model's "
                                     "text length")
        if t.dtype not in spec.dtypes:
            raise StageFileError(f"{source}: {key} has dtype {t.dtype}; expected one of "
                                 f"{', '.join(str(d) for d in spec.dtypes)}")
        if spec.needs_token and t.numel() and not bool(t.reshape(shape[0], -1).ne(0).any(1).all()):
            raise StageFileError(f"{source}: {key} marks no valid token (all zero); expected at "
                                 "least one (an encoder's mask always keeps its template tokens)")
        if t.is_floating_point():
            if not bool(torch.isfinite(t).all()):
                raise StageFileError(f"{source}: {key} holds NaN or Inf values")
            peak = float(t.abs().max()) if t.numel() else 0.0
            if peak > MAX_ABS:
                raise StageFileError(f"{source}: {key} holds values up to {peak:.3g}; expected "
                                     f"|x| <= {MAX_ABS:g} (encoders give values of order 1 to "
                                     "1e3; larger ones overflow the model's norms)")


def read_stage1(directory: str, specs: Mapping[str, TensorSpec]):
    """(tensors, generation config) of a stage-1 directory, checked against `specs`."""
    if not os.path.isdir(directory):
        raise StageFileError(f"--input_dir {directory} is not a directory")
    config = read_config(directory)
    path = os.path.join(directory, EMBEDDINGS)
    tensors, _ = read_tensors(path)
    check_tensors(tensors, specs, path)
    return tensors, config


# --- writing: a pair of stage files, committed by the journal (sampling.journal) ----------------

# what an interrupted write of these can leave in a stage folder; ".previous" is the backup an
# earlier version of this module renamed the old latents to
_STAGE_NAMES = (LATENTS, EMBEDDINGS, CONFIG, VIDEO, JOURNAL, "previous", PROBE)


def _restore_previous(directory: str) -> None:
    """An earlier version renamed the old latents to a `.previous.*.tmp` backup before renaming
    the new ones in; killed in between, the latents were missing: put the backup back."""
    target = os.path.join(directory, LATENTS)
    if os.path.lexists(target):
        return
    backups = sorted((e for e in os.listdir(directory) if e.startswith(temp_prefix("previous"))),
                     key=lambda e: os.path.getmtime(os.path.join(directory, e)))
    if backups:
        os.replace(os.path.join(directory, backups[-1]), target)


def recover(directory: str) -> None:
    """Under the folder's exclusive lock: finish a commit an interrupted run left, and remove
    its temporary files. A folder with nothing to recover is not written to."""
    if os.path.lexists(os.path.join(directory, JOURNAL)):
        roll_forward(directory)
    _restore_previous(directory)
    remove_stale(directory, _STAGE_NAMES)


@contextlib.contextmanager
def settled_folder(directory: str):
    """The folder's exclusive lock, with anything an interrupted run left recovered first."""
    with folder_lock(directory, exclusive=True):
        try:
            recover(directory)
        except OSError as exc:
            raise StageFileError(f"{directory}: files an interrupted write left there could not "
                                 f"be recovered ({exc.strerror or exc}); expected a folder this "
                                 "user can write to") from None
        yield


def write_stage(directory: str, tensors: Mapping[str, torch.Tensor], tensors_name: str,
                metadata: Mapping[str, object], config: Mapping,
                also: Staged | None = None) -> dict[str, str]:
    """Write a tensors file and the generation config atomically (both or neither), with the
    files `also` prepared."""
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    meta["dtype_info"] = json.dumps({k: str(t.dtype) for k, t in tensors.items()})
    return _write_with_config(
        directory, tensors_name, ".tmp",
        lambda tmp: write_tensors({k: t.contiguous() for k, t in tensors.items()}, tmp, meta),
        config, also)


def write_tensors(tensors: Mapping[str, torch.Tensor], path: str, metadata: dict | None = None) -> None:
    """The safetensors bytes, written by us into `path` (our temporary file). save_file would
    write them into a `.tmpXXXXXX` of its own beside it and rename that in (safetensors 0.8): a
    file a kill leaves that no recovery of ours knows, and a full disk raised as its own error
    type, not the OSError it is."""
    data = save(dict(tensors), metadata=metadata)
    with open(path, "wb") as f:
        f.write(data)


def _write_with_config(directory: str, name: str, suffix: str, write_payload,
                       config: Mapping, also: Staged | None = None) -> dict[str, str]:
    """write_payload(a temporary path ending in `suffix`), the config beside it, then both
    committed by the journal (both or neither, even under kill -9), with the files `also` has
    prepared (reports) in the same journal; the temporary files never outlive the call. An
    OSError (a full disk) becomes a StageFileError saying which file could not be written."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise StageFileError(f"output directory {directory} exists and is not a directory")
    pair = Commit(directory, also if also is not None else Staged())
    try:
        os.makedirs(directory, exist_ok=True)
        with settled_folder(directory):
            for taken in (name, CONFIG):
                if os.path.isdir(os.path.join(directory, taken)):
                    raise StageFileError(_taken_by_folder(directory, taken))
            payload_tmp = pair.temporary(name, suffix)
            write_payload(payload_tmp)
            os.chmod(payload_tmp, FILE_MODE)  # a writer that makes its own file (safetensors) makes it 0600
            sync(payload_tmp)
            config_tmp = pair.temporary(CONFIG)
            with open(config_tmp, "w") as f:
                json.dump(dict(config), f, indent=2, default=str)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            pair.commit()
        return {name: os.path.join(directory, name), CONFIG: os.path.join(directory, CONFIG)}
    except OSError as exc:
        what = (f"could not finish renaming {name} and {CONFIG} in {directory}: "
                f"{exc.strerror or exc}; the next run or read of the folder finishes it"
                if pair.journaled else
                f"could not write {name} and {CONFIG} in {directory}: {exc.strerror or exc}"
                + (" (the disk is full)" if exc.errno == errno.ENOSPC else "")
                + "; nothing was written, and files of earlier runs are as they were")
        raise StageFileError(what) from None
    finally:
        pair.close()


def _taken_by_folder(directory: str, name: str) -> str:
    return (f"--output_dir {directory}: {os.path.join(directory, name)} is a folder; expected that "
            f"name free for the {name} file (move the folder away)")


def write_stage2(directory: str, latents: torch.Tensor, metadata: Mapping[str, object],
                 config: Mapping, also: Staged | None = None,
                 extra: Mapping[str, torch.Tensor] | None = None) -> dict[str, str]:
    """The latents and the config, tied by one pair id that read_stage2 checks: a pair put
    together from two runs (by hand, or by a tool that does not recover) is refused. `extra`:
    more tensors beside `latents` in the same file (readers of `latents` alone ignore them)."""
    extra = dict(extra or {})
    if "latents" in extra:
        raise ValueError("extra tensors may not be named 'latents'")
    pair = uuid.uuid4().hex
    return write_stage(directory, {"latents": latents, **extra}, LATENTS,
                       {**metadata, PAIR_ID: pair}, {**config, PAIR_ID: pair}, also)


def read_stage2(directory: str):
    """(latents, metadata, generation config) written by stage 2, read as one pair."""
    tensors, metadata, config = read_stage2_tensors(directory)
    return tensors["latents"], metadata, config


def read_stage2_tensors(directory: str):
    """(every tensor of the latents file, metadata, generation config), read as one pair."""
    lock = settled_folder(directory) if os.path.isdir(directory) else contextlib.nullcontext()
    with lock:
        tensors, metadata = read_tensors(os.path.join(directory, LATENTS))
        config = read_config(directory)
    if "latents" not in tensors:
        raise StageFileError(f"{os.path.join(directory, LATENTS)} lacks the key 'latents'")
    if PAIR_ID in metadata and PAIR_ID in config and metadata[PAIR_ID] != config[PAIR_ID]:
        raise StageFileError(f"{directory}: {LATENTS} ({PAIR_ID} {metadata[PAIR_ID]}) and {CONFIG} "
                             f"({PAIR_ID} {config[PAIR_ID]}) were written by different runs; "
                             "expected the pair one stage-2 run writes (rerun stage 2)")
    return tensors, metadata, config


# --- outputs, checked before any work ----------------------------------------------------------


def check_creatable(flag: str, path: str, hint: str = "") -> None:
    """Refuse a path that no file system call could create: over PATH_MAX (with room for our
    temporary names), a name over NAME_MAX, a symbolic link loop or a file where a folder must
    be. Existence checks call all of these "missing"; creating it would fail after the run."""
    full = os.path.abspath(path)
    limit = os.pathconf("/", "PC_PATH_MAX") if hasattr(os, "pathconf") else 4096
    if len(os.fsencode(full)) + TEMP_ROOM >= limit:
        raise StageFileError(f"{flag} {path[:60]}...: a path of {len(os.fsencode(full))} bytes; "
                             f"expected under {limit - TEMP_ROOM} (PATH_MAX {limit}){hint}")
    existing = full
    while True:
        try:
            os.stat(existing)
            break
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StageFileError(f"{flag} {path}: {existing} is a loop of symbolic links; "
                                     f"expected a path that resolves{hint}") from None
            if existing == os.path.dirname(existing):
                break
            existing = os.path.dirname(existing)
    try:
        name_max = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    for part in full.split(os.sep):
        if len(os.fsencode(part)) > name_max:
            raise StageFileError(f"{flag} {path[:60]}...: a name of {len(os.fsencode(part))} "
                                 f"bytes ({part[:24]}...); expected at most {name_max} (NAME_MAX)"
                                 f"{hint}")


def check_writable(directory: str, flag: str = "--output_dir", names: tuple[str, ...] = (),
                   hint: str = "") -> None:
    """Raise StageFileError unless `directory` is, or can be made, a folder we can create files
    in, and none of `names` in it is held by a folder. Creates nothing (a missing folder is made
    when its files are written)."""
    if not directory:
        raise StageFileError(f"{flag} {directory!r}: expected a folder path{hint}")
    check_creatable(flag, directory, hint)
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
        probe(existing)
    except OSError as exc:
        where = "" if existing == os.path.abspath(directory) else f" (in {existing})"
        raise StageFileError(f"{flag} {directory} is not writable{where}: {exc.strerror or exc}; "
                             f"expected a folder you can create files in{hint}") from None
    for name in names:
        if os.path.isdir(os.path.join(directory, name)):
            raise StageFileError(_taken_by_folder(directory, name).replace("--output_dir", flag, 1))


def check_distinct(outputs: Mapping[str, str], inputs: Mapping[str, str]) -> None:
    """Refuse two outputs at one path, or an output onto an input (or inside an input folder):
    flag -> path each; the paths compared as the file system resolves them."""
    seen: dict[str, str] = {}
    resolved_inputs = {flag: os.path.realpath(path) for flag, path in inputs.items() if path}
    for flag, path in outputs.items():
        if path is None:
            continue
        real = os.path.realpath(path)
        if real in seen:
            raise StageFileError(f"{flag} {path}: the run writes {seen[real]} there too; "
                                 "expected a path of its own")
        for source, inside in resolved_inputs.items():
            if real == inside or (os.path.isdir(inside) and real.startswith(inside + os.sep)):
                raise StageFileError(f"{flag} {path} would overwrite {source} {inputs[source]}"
                                     f"{'' if real == inside else ' (inside it)'}; expected an "
                                     "output path apart from the inputs")
        seen[real] = flag


def check_writable_file(flag: str, path: str | None) -> None:
    """Refuse, before any work, a report path that is empty or a folder, or whose folder is
    missing or cannot take a new file."""
    if path is None:
        return
    if path:
        check_creatable(flag, path)
    folder = os.path.dirname(os.path.abspath(path)) if path else ""
    if not path or os.path.isdir(path) or not os.path.isdir(folder):
        raise StageFileError(f"{flag} {path!r}: expected a file in an existing, writable folder")
    try:
        probe(folder)
    except OSError as exc:
        raise StageFileError(f"{flag} {path}: its folder {folder} is not writable "
                             f"({exc.strerror or exc}); expected a file in an existing, writable "
                             "folder") from None


# --- stage 3: the video -------------------------------------------------------------------------


def write_video(directory: str, frames, fps: float, config: Mapping,
                quality: int = 8, also: Staged | None = None) -> dict[str, str]:
    """Encode frames [F, H, W, 3] uint8 as H.264 mp4 and write it with the generation config,
    atomically (both or neither): the video goes to a temporary file in `directory` first.
    `quality` is imageio's 1-10 (8, as the official Wan scripts write, is x264 CRF 10). `also`:
    files prepared to be committed with them."""
    return _write_with_config(directory, VIDEO, ".mp4", lambda tmp: encode_mp4(tmp, frames, fps,
                                                                                quality),
                              config, also)

"""Stage files, compatible with the existing TPU port's pipeline (tpu_notes 1.2).

    <dir>/stage1_embeddings.safetensors   text (and image) embeddings, written by stage 1
    <dir>/generation_config.json          settings; each stage adds its fields
    <dir>/stage2_latents.safetensors      key `latents` [1, C, F, H, W], metadata as strings
                                          (speech-to-video: also what stage 3 decodes the
                                          clips with, `sampling.clips.decode_inputs`)

Everything is checked before sampling starts (missing file or key, wrong shape or dtype, bad
JSON, an output path that cannot be created or would overwrite an input). Every write goes
through temporary files and a commit journal (see "writing" below): a failure (a full disk,
SIGINT/SIGTERM, kill -9 at any instruction) leaves the previous outputs or the new ones, whole,
and the next writer or reader of the folder finishes or cleans what was left. A pair is
committed under an exclusive lock on the folder, so two runs writing the same folder at once
leave one run's pair, never one file of each; a pair id ties the latents to their config.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from cache.validate import FieldError, read_json

from .interrupt import deferred
from .pipelines import TensorSpec

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


class StageFileError(ValueError):
    """A stage file is missing, unreadable or does not match what the pipeline expects."""


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


# --- writing: temporary files, a journal, renames ----------------------------------------------
#
# Every file a run writes goes to a temporary name beside its final one first. A temporary file
# is flock'ed by its writer for as long as the writer lives, so any later process can tell a live
# writer's file (lock held) from one a killed writer left (lock free: removed). A pair of stage
# files is committed under the folder's exclusive lock by a journal: JOURNAL, renamed in once
# both temporary files are complete, names the renames; they are done, then JOURNAL is removed.
# Killed before the journal exists, the folder holds the old pair (and stale temporary files,
# which the next writer or reader removes); killed after, the next writer or reader of the
# folder finishes the renames (roll forward) and holds the new pair. Nothing is ever renamed
# away, so there is nothing to restore.

JOURNAL = ".stage_commit.json"
_PREFIX_CHARS = 64  # of the final name in a temporary one: long names keep room under NAME_MAX
_held: dict[str, int] = {}  # temporary path -> the open, flock'ed descriptor of this process


_umask = os.umask(0)
os.umask(_umask)
_MODE = 0o666 & ~_umask


def _prefix(name: str) -> str:
    return f".{name[:_PREFIX_CHARS]}."


def _temporary(directory: str, name: str, suffix: str = ".tmp") -> str:
    fd, path = tempfile.mkstemp(prefix=_prefix(name), suffix=suffix, dir=directory)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _held[path] = fd
    os.fchmod(fd, _MODE)  # mkstemp makes 0600; outputs get the usual permissions
    return path


def _release(path: str) -> None:
    """Remove a temporary file of ours if it is still there (not renamed in), and unlock it."""
    with deferred():  # an interruption here would leave a temporary file behind
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.remove(path)
        _forget(path)


def _forget(path: str) -> None:
    """Unlock a temporary file of ours without removing it (it is renamed in, or a journal
    names it)."""
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def _sync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale(directory: str, names: tuple[str, ...]) -> None:
    """Remove the temporary files of `names` in `directory` that no live process holds."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    prefixes = tuple(_prefix(n) for n in names)
    for entry in entries:
        if not entry.startswith(prefixes):
            continue
        path = os.path.join(directory, entry)
        if path in _held:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live writer holds it
        else:
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
        finally:
            os.close(fd)


# what an interrupted write of these can leave in a stage folder; ".previous" is the backup an
# earlier version of this module renamed the old latents to
_STAGE_NAMES = (LATENTS, EMBEDDINGS, CONFIG, VIDEO, JOURNAL, "previous",
                "write-check")


def _journal_path(directory: str, path: str) -> str:
    """How the journal names a path: by its name inside the stage folder, else in full."""
    folder, name = os.path.split(os.path.abspath(path))
    return name if folder == os.path.abspath(directory) else os.path.abspath(path)


def _roll_forward(directory: str) -> None:
    """Finish the renames JOURNAL names (files, and folders whose files move into their parent),
    then remove it. Every step can be repeated, so a kill in here is finished by the next call."""
    journal = os.path.join(directory, JOURNAL)
    try:
        with open(journal) as f:
            entries = json.load(f)
        files = [(str(tmp), str(final)) for tmp, final in entries["renames"]]
        folders = [(str(tmp), str(folder)) for tmp, folder in entries.get("folders", [])]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StageFileError(f"{journal}: an unreadable commit journal ({exc}); expected the one "
                             "an interrupted stage write leaves; remove it to keep the files as "
                             "they are") from None

    def checked(tmp, final, name):
        # only ever a temporary file of ours onto its final name, beside it
        tmp, final = (os.path.join(directory, p) for p in (tmp, final))
        beside = os.path.abspath(os.path.dirname(final if name is None else final + os.sep))
        if os.path.abspath(os.path.dirname(tmp)) != beside \
                or not os.path.basename(tmp).startswith(_prefix(name or os.path.basename(final))):
            raise StageFileError(f"{journal} names the rename {tmp!r} -> {final!r}; expected "
                                 "a temporary file of a stage write beside its final name")
        return tmp, final

    for tmp, final in (checked(t, f, None) for t, f in files):
        if os.path.lexists(tmp):
            os.replace(tmp, final)
    for tmp, folder in (checked(t, f, "events") for t, f in folders):
        if os.path.isdir(tmp):
            for name in sorted(os.listdir(tmp)):
                os.replace(os.path.join(tmp, name), os.path.join(folder, name))
            os.rmdir(tmp)
    _sync(directory)
    os.remove(journal)
    _sync(directory)


def _restore_previous(directory: str) -> None:
    """An earlier version renamed the old latents to a `.previous.*.tmp` backup before renaming
    the new ones in; killed in between, the latents were missing: put the backup back."""
    target = os.path.join(directory, LATENTS)
    if os.path.lexists(target):
        return
    backups = sorted((e for e in os.listdir(directory) if e.startswith(_prefix("previous"))),
                     key=lambda e: os.path.getmtime(os.path.join(directory, e)))
    if backups:
        os.replace(os.path.join(directory, backups[-1]), target)


def recover(directory: str) -> None:
    """Under the folder's exclusive lock: finish a commit an interrupted run left, and remove
    its temporary files. A folder with nothing to recover is not written to."""
    if os.path.lexists(os.path.join(directory, JOURNAL)):
        _roll_forward(directory)
    _restore_previous(directory)
    remove_stale(directory, _STAGE_NAMES)


@contextlib.contextmanager
def _stage_folder(directory: str):
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
    also = also if also is not None else Staged()
    temps = []
    committing = False
    try:
        os.makedirs(directory, exist_ok=True)
        with _stage_folder(directory):
            for taken in (name, CONFIG):
                if os.path.isdir(os.path.join(directory, taken)):
                    raise StageFileError(_taken_by_folder(directory, taken))
            payload_tmp = _temporary(directory, name, suffix)
            temps.append(payload_tmp)
            write_payload(payload_tmp)
            os.chmod(payload_tmp, _MODE)  # a writer that makes its own file (safetensors) makes it 0600
            _sync(payload_tmp)
            config_tmp = _temporary(directory, CONFIG)
            temps.append(config_tmp)
            with open(config_tmp, "w") as f:
                json.dump(dict(config), f, indent=2, default=str)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            journal_tmp = _temporary(directory, JOURNAL)
            temps.append(journal_tmp)
            entries = {
                "renames": [[_journal_path(directory, t), _journal_path(directory, p)]
                            for t, p in [(payload_tmp, os.path.join(directory, name)),
                                         (config_tmp, os.path.join(directory, CONFIG)),
                                         *also.files]],
                "folders": [[_journal_path(directory, t), _journal_path(directory, p)]
                            for t, p in also.folders]}
            with open(journal_tmp, "w") as f:
                json.dump(entries, f)
                f.flush()
                os.fsync(f.fileno())
            with deferred():
                os.replace(journal_tmp, os.path.join(directory, JOURNAL))
                committing = True
                _roll_forward(directory)
        return {name: os.path.join(directory, name), CONFIG: os.path.join(directory, CONFIG)}
    except OSError as exc:
        what = (f"could not finish renaming {name} and {CONFIG} in {directory}: "
                f"{exc.strerror or exc}; the next run or read of the folder finishes it"
                if committing else
                f"could not write {name} and {CONFIG} in {directory}: {exc.strerror or exc}"
                + (" (the disk is full)" if exc.errno == errno.ENOSPC else "")
                + "; nothing was written, and files of earlier runs are as they were")
        raise StageFileError(what) from None
    finally:
        if committing:  # the journal names them: renamed in, or by the next recovery
            for tmp in temps:
                _forget(tmp)
            also.forget()
        else:
            for tmp in temps:
                _release(tmp)
            also.discard()


class Staged:
    """Files written under temporary names beside their final paths by `add` (a folder's new
    files: `add_folder`), renamed in by `commit` (each rename atomic), removed by `discard`: what
    a run writes outside its stage folder (reports) is prepared before the stage files are
    committed and renamed in after them."""

    def __init__(self):
        self.files: list[tuple[str, str]] = []  # (temporary, final)
        self.folders: list[tuple[str, str]] = []  # (temporary folder, the folder it fills)

    def add(self, path: str, write, mode: str = "w", flag: str | None = None) -> None:
        """write(open file); an OSError becomes a StageFileError naming `flag` if given."""
        try:
            folder = os.path.dirname(os.path.abspath(path))
            remove_stale(folder, (os.path.basename(path),))
            tmp = _temporary(folder, os.path.basename(path))
            self.files.append((tmp, path))
            with open(tmp, mode) as f:
                write(f)
        except OSError as exc:
            if flag is None:
                raise
            raise StageFileError(_not_written(flag, path, exc)) from None

    def add_folder(self, folder: str, write, flag: str) -> None:
        """write(a temporary folder inside `folder`); the files it makes move into `folder`."""
        try:
            os.makedirs(folder, exist_ok=True)
            remove_stale(folder, ("events",))
            tmp = tempfile.mkdtemp(prefix=_prefix("events"), suffix=".tmp", dir=folder)
            fd = os.open(tmp, os.O_RDONLY)
            _held[tmp] = fd
            fcntl.flock(fd, fcntl.LOCK_EX)
            self.folders.append((tmp, folder))
            write(tmp)
        except OSError as exc:
            raise StageFileError(_not_written(flag, folder, exc)) from None

    def commit(self) -> None:
        with deferred():
            for tmp, path in self.files:
                os.replace(tmp, path)
            for tmp, folder in self.folders:
                for name in sorted(os.listdir(tmp)):
                    os.replace(os.path.join(tmp, name), os.path.join(folder, name))
        self.discard()

    def discard(self) -> None:
        for tmp, _ in self.files + self.folders:
            _release(tmp)
        self.files, self.folders = [], []

    def forget(self) -> None:
        """Another commit (a stage pair's journal) has taken these files over."""
        for tmp, _ in self.files + self.folders:
            _forget(tmp)
        self.files, self.folders = [], []


def _not_written(flag: str, path: str, exc: OSError) -> str:
    return (f"{flag} {path} could not be written: {exc.strerror or exc}"
            + (" (the disk is full)" if exc.errno == errno.ENOSPC else "")
            + "; nothing was written, and files of earlier runs are as they were")


@contextlib.contextmanager
def staged():
    """A Staged whose files are renamed in when the block ends normally, removed otherwise."""
    files = Staged()
    try:
        yield files
    except BaseException:
        files.discard()
        raise
    files.commit()


def atomic_write(path: str, write, mode: str = "w") -> None:
    """write(file object) to a temporary file beside `path`, then renamed in: no partial file,
    and no temporary one, outlives a failure, an interruption or a kill."""
    with staged() as files:
        files.add(path, write, mode)


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
    lock = _stage_folder(directory) if os.path.isdir(directory) else contextlib.nullcontext()
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


# --- stage 3: the video -------------------------------------------------------------------------


def _probe(folder: str) -> None:
    """Create and remove a file in `folder`: the one check that holds as root and on read-only
    or pseudo file systems, where permission bits say nothing."""
    _release(_temporary(folder, "write-check"))


# room a path leaves for our temporary names beside or inside it (see _temporary)
_TEMP_ROOM = _PREFIX_CHARS + 24


def check_creatable(flag: str, path: str, hint: str = "") -> None:
    """Refuse a path that no file system call could create: over PATH_MAX (with room for our
    temporary names), a name over NAME_MAX, a symbolic link loop or a file where a folder must
    be. Existence checks call all of these "missing"; creating it would fail after the run."""
    full = os.path.abspath(path)
    limit = os.pathconf("/", "PC_PATH_MAX") if hasattr(os, "pathconf") else 4096
    if len(os.fsencode(full)) + _TEMP_ROOM >= limit:
        raise StageFileError(f"{flag} {path[:60]}...: a path of {len(os.fsencode(full))} bytes; "
                             f"expected under {limit - _TEMP_ROOM} (PATH_MAX {limit}){hint}")
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
        _probe(existing)
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
        _probe(folder)
    except OSError as exc:
        raise StageFileError(f"{flag} {path}: its folder {folder} is not writable "
                             f"({exc.strerror or exc}); expected a file in an existing, writable "
                             "folder") from None


def write_video(directory: str, frames, fps: float, config: Mapping,
                quality: int = 8, also: Staged | None = None) -> dict[str, str]:
    """Encode frames [F, H, W, 3] uint8 as H.264 mp4 and write it with the generation config,
    atomically (both or neither): the video goes to a temporary file in `directory` first.
    `quality` is imageio's 1-10 (8, as the official Wan scripts write, is x264 CRF 10). `also`:
    files prepared to be committed with them."""
    return _write_with_config(directory, VIDEO, ".mp4", lambda tmp: encode_mp4(tmp, frames, fps,
                                                                                quality),
                              config, also)


def encode_mp4(path: str, frames, fps: float, quality: int = 8) -> None:
    """Frames [F, H, W, 3] uint8 as an H.264 mp4 at `path`; the name must end in .mp4 (imageio
    picks its ffmpeg writer by the extension)."""
    import imageio.v2 as imageio

    # macro_block_size 1 keeps the size exact (the VAE strides make it even, as yuv420p needs)
    writer = imageio.get_writer(path, format="FFMPEG", mode="I", fps=fps, codec="libx264",
                                quality=quality, macro_block_size=1)
    try:
        for frame in frames:
            writer.append_data(frame)
    finally:
        writer.close()

"""Crash-safe writes: temporary files, a commit journal, renames.

Every file a run writes goes to a temporary name beside its final one first. A temporary file is
flock'ed by its writer for as long as the writer lives, so any later process can tell a live
writer's file (lock held) from one a killed writer left (lock free: removed). Files that must
change together (a pair of stage files, with the reports of the same run) are committed under the
folder's exclusive lock by a journal (`Commit`): JOURNAL, renamed in once every temporary file is
complete, names the renames; they are done, then JOURNAL is removed. Killed before the journal
exists, the folder holds the old files (and stale temporary files, which the next writer or
reader removes); killed after, the next writer or reader of the folder finishes the renames
(`roll_forward`) and holds the new ones. Nothing is ever renamed away, so there is nothing to
restore. A single file needs no journal: `atomic_write`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import tempfile

from .errors import StageFileError
from .interrupt import deferred

JOURNAL = ".stage_commit.json"
PREFIX_CHARS = 64  # of the final name in a temporary one: long names keep room under NAME_MAX
TEMP_ROOM = PREFIX_CHARS + 24  # room a path leaves for our temporary names beside or inside it
FOLDER_FILES = "events"  # the name a temporary folder of `Staged.add_folder` is made after
PROBE = "write-check"  # the name the temporary file of `probe` is made after
_held: dict[str, int] = {}  # temporary path -> the open, flock'ed descriptor of this process


_umask = os.umask(0)
os.umask(_umask)
FILE_MODE = 0o666 & ~_umask  # what our outputs get (mkstemp makes 0600)



def temp_prefix(name: str) -> str:
    """How the temporary files of the final name `name` begin."""
    return f".{name[:PREFIX_CHARS]}."


def temporary(directory: str, name: str, suffix: str = ".tmp") -> str:
    """A new temporary file for `name` in `directory`, flock'ed by this process until `release`
    or `forget`."""
    fd, path = tempfile.mkstemp(prefix=temp_prefix(name), suffix=suffix, dir=directory)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _held[path] = fd
    os.fchmod(fd, FILE_MODE)  # mkstemp makes 0600; outputs get the usual permissions
    return path


def release(path: str) -> None:
    """Remove a temporary file of ours if it is still there (not renamed in), and unlock it."""
    with deferred():  # an interruption here would leave a temporary file behind
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.remove(path)
        forget(path)


def forget(path: str) -> None:
    """Unlock a temporary file of ours without removing it (it is renamed in, or a journal
    names it)."""
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def sync(path: str) -> None:
    """fsync a file or a folder (a folder: the renames in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def probe(folder: str) -> None:
    """Create and remove a file in `folder`: the one check that holds as root and on read-only
    or pseudo file systems, where permission bits say nothing."""
    release(temporary(folder, PROBE))


def remove_stale(directory: str, names: tuple[str, ...]) -> None:
    """Remove the temporary files of `names` in `directory` that no live process holds."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    prefixes = tuple(temp_prefix(n) for n in names)
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


def _journal_path(directory: str, path: str) -> str:
    """How the journal names a path: by its name inside the folder, else in full."""
    folder, name = os.path.split(os.path.abspath(path))
    return name if folder == os.path.abspath(directory) else os.path.abspath(path)


def roll_forward(directory: str) -> None:
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
                or not os.path.basename(tmp).startswith(temp_prefix(name or os.path.basename(final))):
            raise StageFileError(f"{journal} names the rename {tmp!r} -> {final!r}; expected "
                                 "a temporary file of a stage write beside its final name")
        return tmp, final

    for tmp, final in (checked(t, f, None) for t, f in files):
        if os.path.lexists(tmp):
            os.replace(tmp, final)
    for tmp, folder in (checked(t, f, FOLDER_FILES) for t, f in folders):
        if os.path.isdir(tmp):
            for name in sorted(os.listdir(tmp)):
                os.replace(os.path.join(tmp, name), os.path.join(folder, name))
            os.rmdir(tmp)
    sync(directory)
    os.remove(journal)
    sync(directory)


class Commit:
    """Files written under temporary names in `directory` (by `temporary`), renamed onto their
    final names there as one by a journal (`commit`), with the files `also` has prepared
    elsewhere (reports): after a failure or a kill, the folder holds all the old files or, once
    the next `roll_forward` ran, all the new ones. Use under the folder's exclusive lock, and
    `close` in every case."""

    def __init__(self, directory: str, also: Staged):
        self.directory, self.also = directory, also
        self.renames: list[tuple[str, str]] = []  # (temporary, final) in `directory`
        self.temps: list[str] = []  # every temporary file made, the journal's included
        self.journaled = False  # the journal is in: the renames are decided (done now or later)

    def temporary(self, name: str, suffix: str = ".tmp") -> str:
        """A temporary file that `commit` renames onto `name` in the folder."""
        tmp = temporary(self.directory, name, suffix)
        self.temps.append(tmp)
        self.renames.append((tmp, os.path.join(self.directory, name)))
        return tmp

    def commit(self) -> None:
        """Write the journal, rename it in (from then on the renames are decided), and do them."""
        directory = self.directory
        journal_tmp = temporary(directory, JOURNAL)
        self.temps.append(journal_tmp)
        entries = {
            "renames": [[_journal_path(directory, t), _journal_path(directory, p)]
                        for t, p in [*self.renames, *self.also.files]],
            "folders": [[_journal_path(directory, t), _journal_path(directory, p)]
                        for t, p in self.also.folders]}
        with open(journal_tmp, "w") as f:
            json.dump(entries, f)
            f.flush()
            os.fsync(f.fileno())
        with deferred():
            os.replace(journal_tmp, os.path.join(directory, JOURNAL))
            self.journaled = True
            roll_forward(directory)

    def close(self) -> None:
        """Unlock the temporary files; remove them (and `also`'s) unless the journal names them."""
        if self.journaled:  # the journal names them: renamed in, or by the next recovery
            for tmp in self.temps:
                forget(tmp)
            self.also.forget()
        else:
            for tmp in self.temps:
                release(tmp)
            self.also.discard()


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
            tmp = temporary(folder, os.path.basename(path))
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
            remove_stale(folder, (FOLDER_FILES,))
            tmp = tempfile.mkdtemp(prefix=temp_prefix(FOLDER_FILES), suffix=".tmp", dir=folder)
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
            release(tmp)
        self.files, self.folders = [], []

    def forget(self) -> None:
        """Another commit (a stage pair's journal) has taken these files over."""
        for tmp, _ in self.files + self.folders:
            forget(tmp)
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

"""One writer per output folder: a run holds the folder for as long as it writes there, and a
second run into the same folder is refused up front, naming the folder and the run that holds it.

The hold is an flock on a lock file in the folder, so a killed run holds nothing: the kernel
drops its lock with its last file descriptor, and the next run takes the folder over. The file
names the holder (pid, host, command) for the refusal, and is removed when the run ends.

A batch (`generate.py --prompts`) writes numbered subfolders of the folder it holds, so the
hold covers the folder's whole tree: a run into a folder below one another run holds is refused
too (it would write over a prompt of the batch). The workers of one batch sharing a folder
(`sampling.claims`) hold it together, with a shared lock: a single run into it, or below it, is
refused as before; each prompt's subfolder is held by the one worker making it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time

from sampling.errors import StageFileError

LOCK = ".writer.lock"
_HELD: set[str] = set()  # the folders this process holds (a batch writes below its own)


def _shared_holders(path: str) -> bool:
    """Whether the lock at `path` is held shared (by a batch's workers), not exclusively."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _holder(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            who = json.load(f)
        return (f"pid {who['pid']} on {who['host']}, started {who['started']}: "
                f"{who['command']}")
    except (OSError, ValueError, KeyError, TypeError):
        return "a run that has not said who it is yet"


def _open_locked(path: str, shared: bool = False) -> int | None:
    """A descriptor of `path` holding its exclusive (or shared) flock, or None if another
    process holds it exclusively (or at all, for an exclusive one)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        # the holder we waited on may have removed the file as it ended: a lock on a removed
        # file holds nothing, so take the one now at the path
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _taken(fd: int) -> bool:
    """Whether another process holds the lock of `fd`, exclusively or shared (a batch's workers).
    An exclusive lock taken only to look is dropped at once; another run looking the same instant
    also holds one for a moment, so a look that fails is tried again before it counts."""
    for attempt in range(5):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            time.sleep(0.01 * (attempt + 1))
            continue
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    return True


def _held_above(folder: str) -> tuple[str, str] | None:
    """(an ancestor of `folder` that another live run holds, its holder), or None."""
    up = os.path.dirname(os.path.abspath(folder))
    while True:
        if up in _HELD:  # this process's own batch
            return None
        path = os.path.join(up, LOCK)
        if os.path.exists(path):
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                fd = None
            if fd is not None:
                try:
                    if _taken(fd):
                        return up, _holder(path)
                finally:
                    os.close(fd)
        parent = os.path.dirname(up)
        if parent == up:
            return None
        up = parent


@contextlib.contextmanager
def one_writer(folder: str, flag: str = "--output_dir", shared: bool = False):
    """Hold `folder` (made if missing) for the block; StageFileError if another live run holds
    it. Folders it made are removed again if the run leaves them empty (a run that fails
    leaves nothing behind). `shared`: held with the other workers of one batch, who share its
    prompts by claims (an exclusive holder, a single run, keeps them all out and they it)."""
    above = _held_above(folder)
    if above is not None:
        raise StageFileError(f"{flag} {folder} is inside {above[0]}, which another run is "
                             f"writing ({above[1]}); expected one run per output folder and the "
                             "folders below it: wait for that run to end, or give a folder "
                             "outside it")
    made, up = [], os.path.abspath(folder)
    while not os.path.exists(up):
        made.append(up)
        up = os.path.dirname(up)
    try:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, LOCK)
        fd = _open_locked(path, shared)
    except OSError as exc:
        raise StageFileError(f"{flag} {folder}: could not take it for this run "
                             f"({exc.strerror or exc}); expected a folder you can create files "
                             "in") from None
    if fd is None and not shared and _shared_holders(path):
        raise StageFileError(f"{flag} {folder} is being written by the workers of a batch "
                             f"({_holder(path)}); expected one run per output folder: wait for "
                             f"the batch to end, or give another {flag}")
    if fd is None:
        raise StageFileError(f"{flag} {folder} is being written by another run ({_holder(path)}); "
                             "expected one run per output folder: wait for that run to end, or "
                             f"give another {flag}")
    try:
        who = {"pid": os.getpid(), "host": socket.gethostname(),
               "started": time.strftime("%Y-%m-%d %H:%M:%S"),
               "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])[:500]}
        if shared:  # the batch's first worker names it; the others leave the name as it is
            who["command"] = "workers of " + who["command"]
        if not shared or os.fstat(fd).st_size == 0:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(who).encode(), 0)
    except OSError:
        pass  # the name is for the refusal's message only; the lock holds without it
    held = os.path.abspath(folder)
    _HELD.add(held)
    try:
        yield
    finally:
        _HELD.discard(held)
        last = True
        if shared:  # the last of the batch's workers removes the file
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                last = False
        if last:
            with contextlib.suppress(OSError):
                os.unlink(path)  # while still held: a run waiting on it retries on the new file
        os.close(fd)
        for empty in made:  # deepest first; a folder the run wrote into stays
            try:
                os.rmdir(empty)
            except OSError:
                break

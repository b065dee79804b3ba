"""One prompt list, many workers: which prompt a worker takes next, how a multi-host slice agrees
on it, and the index of the folder the workers share.

A worker walks the list in order and takes each prompt it still needs under its claim
(`sampling.claims`) and its folder's hold (`sampling.one_writer`); a prompt another live worker
holds is come back to once the rest are done, and taken over if that worker dies. After a claim
is taken the prompt's folder is read again: another worker may have made it meanwhile. A
multi-host slice is one worker: its process 0 claims and tells the other processes which prompt
comes next (they sample with it)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from sampling.claims import Claims
from sampling.errors import StageFileError
from sampling.one_writer import one_writer

INDEX = "index.json"  # the folder's merged index, written by every worker as it ends
POLL = 0.2  # seconds between looks at the prompts other workers hold


def batch_id(request_ids: Iterable[str]) -> str:
    """The same command (prompt list and flags) gives the same id on every worker."""
    return hashlib.sha256("\n".join(request_ids).encode()).hexdigest()[:20]


def key_of(folder: str) -> str:
    return os.path.basename(os.path.normpath(folder))


def turns(jobs: list, claims: Claims | None, needs: Callable[[object], bool],
          refresh: Callable[[object], None], peek: Callable[[object], None],
          say: Callable[[str], None] = lambda text: None,
          last: bool = False) -> Iterator[tuple[int, object]]:
    """(index, job) of every job this worker is to work on now, in list order, each while this
    worker holds its claim and folder. `needs(job)`: whether its state still asks for the work;
    `refresh(job)`: read its state again once claimed; `peek(job)`: read it without a claim (a
    prompt another worker holds may have moved past what this phase needs). Without claims (one
    worker) every job that needs the work, in order. A prompt whose folder a run outside the
    batch holds is left to the batch's rerun: in the `last` phase, StageFileError naming it once
    every other prompt is made."""
    todo = [(i, j) for i, j in enumerate(jobs) if needs(j)]
    if claims is None:
        yield from todo
        return
    waited, blocked = False, []
    while todo:
        later = []
        for i, job in todo:
            key = key_of(job.folder)
            if not claims.take(key):
                later.append((i, job))
                continue
            try:
                refresh(job)
                if needs(job):
                    job.by_other = False  # whatever another worker did before, this one ends it
                    with contextlib.ExitStack() as hold:
                        try:
                            hold.enter_context(one_writer(job.folder))
                        except StageFileError as exc:
                            blocked.append(str(exc))
                            continue
                        yield i, job
                else:
                    job.by_other = True
            finally:
                claims.release(key)
        todo = []
        for i, job in later:
            peek(job)
            if needs(job):
                todo.append((i, job))
            else:
                job.by_other = True
        if todo:
            if not waited:
                say(f"waiting for {len(todo)} prompt(s) other workers are making (taken over "
                    f"if a worker dies: at once on this host, after {claims.lease:.0f} s "
                    "without its heartbeat from another)")
                waited = True
            time.sleep(POLL)
    if blocked and last:
        raise StageFileError(f"{blocked[0]} (this batch made every other prompt it could; a "
                             "rerun of it makes the rest)" + (
                                 f"; and {len(blocked) - 1} more prompt(s) alike"
                                 if len(blocked) > 1 else ""))


def agreed(mine: Iterator[tuple[int, object]] | None, jobs: list, multihost: bool,
           states: tuple[str, ...]) -> Iterator[tuple[int, object]]:
    """The jobs of `mine` (process 0's turns) on every process of a multi-host slice: process 0
    sends each index and state, then -1; the other processes (`mine` None) follow."""
    if not multihost or _one_process():
        yield from mine
        return
    from jax.experimental import multihost_utils

    def send(index: int, state: str | None) -> tuple[int, str | None]:
        got = multihost_utils.broadcast_one_to_all(
            np.asarray([index, states.index(state) if state else -1], np.int32))
        return int(got[0]), (states[int(got[1])] if int(got[1]) >= 0 else None)

    if mine is not None:
        for i, job in mine:
            send(i, job.state)
            yield i, job
        send(-1, None)
        return
    while True:
        i, state = send(0, None)
        if i < 0:
            return
        jobs[i].state = state
        yield i, jobs[i]


def _one_process() -> bool:
    import jax
    return jax.process_count() == 1


def write_index(root: str, jobs: list, lines: list[str], claims: Claims | None,
                video: str, done: Callable[[object], bool]) -> str:
    """The folder's index of the whole list (every worker writes it as it ends, from what the
    folders hold then, under a lock so the last one written is the most complete): each prompt's
    line, folder, request, whether its video is there and which worker made it."""
    path = os.path.join(root, INDEX)
    with open(os.path.join(root, ".index.lock"), "a") as lock:
        with contextlib.suppress(OSError):
            fcntl.flock(lock, fcntl.LOCK_EX)  # best effort where the filesystem has no flock
        entries = []
        for job, line in zip(jobs, lines, strict=True):
            key = key_of(job.folder)
            made = done(job)
            entries.append({"line": line, "prompt": job.request.prompt, "folder": key,
                            "request_id": job.id,
                            "video": os.path.join(key, video) if made else None,
                            "made_by": claims.made_by(key) if claims is not None and made
                            else None})
        index = {"prompts": entries, "done": sum(e["video"] is not None for e in entries),
                 "of": len(entries), "written": time.strftime("%Y-%m-%d %H:%M:%S")}
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=1)
        os.replace(tmp, path)
    return path

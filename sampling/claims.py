"""Per-prompt claims: many workers share one prompt list and one output folder, each prompt
worked on by one worker at a time, a dead worker's prompt taken over by another.

A worker is a process on this host, or a host or a whole multi-host slice (its process 0 claims
for it) sharing the folder over a network filesystem. A claim is a file `<dir>/<key>.<n>` made
with O_CREAT | O_EXCL: `n` counts the attempts at `key`, and the exclusive create is the one
step that must be atomic, so two workers never both hold attempt n. The file says who took it
(worker, host, pid, the process's start, the batch). A claim is live until a
`<key>.<n>.released` beside it says it was let go, or its worker is dead: on this host, its
process is gone (pid and start time, so a reused pid is not taken for it); on another host, the
heartbeat (the holder touches the file every lease / 4 s) is older than the lease. A dead claim
is taken over by making attempt n + 1. Nothing is renamed or removed: the files are the record
of who made what (the batch's index names the worker of each prompt from them).

A worker that stalled longer than the lease (a network partition) may find its claim taken over:
`ours` tells it before it publishes.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time

from sampling.errors import StageFileError

CLAIMS = ".claims"  # the folder of claims, in the batch's output folder unless given
LEASE = 120.0  # seconds without a heartbeat after which another host's claim is dead
RELEASED = ".released"


def _process_start(pid: int) -> str | None:
    """The start time of `pid` in clock ticks since boot (Linux), which a reused pid changes."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    now = _process_start(pid)
    return started is None or now is None or now == started


class Claims:
    """This worker's claims on the keys of one batch (`batch`: an id the same command gives on
    every worker; a live claim of another batch is refused, not waited on)."""

    def __init__(self, folder: str, batch: str, lease: float = LEASE, worker: str | None = None):
        if not lease > 0:
            raise ValueError(f"lease {lease!r}: expected seconds > 0")
        self.dir, self.batch, self.lease = folder, batch, float(lease)
        os.makedirs(folder, exist_ok=True)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.worker = worker or f"{self.host}:{self.pid}"
        self.started = time.time()
        self._held: dict[str, str] = {}
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # --- reading ------------------------------------------------------------------------------

    def _attempts(self, key: str) -> list[tuple[int, str, bool]]:
        """(n, path, released) of every attempt at `key`, oldest first. Attempts are made one
        after another by exclusive create and never removed, so they are 1, 2, ... with no gap:
        a few stats a key, not a listing of the whole folder (a batch of thousands of prompts)."""
        found = []
        while True:
            path = os.path.join(self.dir, f"{key}.{len(found) + 1}")
            if not os.path.exists(path):
                return found
            found.append((len(found) + 1, path, os.path.exists(path + RELEASED)))

    def _who(self, path: str) -> dict | None:
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None  # being written this instant (the create and the write are two steps)

    def _alive(self, path: str, who: dict | None) -> bool:
        """On this host, whether its process lives; elsewhere (or made but not yet written),
        whether its heartbeat is younger than the lease."""
        if who is not None and who.get("host") == self.host:
            return _pid_alive(int(who["pid"]), who.get("process_start"))
        try:
            return time.time() - os.stat(path).st_mtime < self.lease
        except FileNotFoundError:
            return False

    def holder(self, key: str) -> dict | None:
        """Who holds `key` now (their claim's record), or None."""
        attempts = self._attempts(key)
        if not attempts or attempts[-1][2]:
            return None
        _, path, _ = attempts[-1]
        who = self._who(path)
        return (who or {"worker": "a worker that is still writing its claim"}) \
            if self._alive(path, who) else None

    def made_by(self, key: str) -> str | None:
        """The worker whose claim on `key` was last let go (the one that made its files)."""
        for _, path, released in reversed(self._attempts(key)):
            if released:
                who = self._who(path)
                return who.get("worker") if who else None
        return None

    def finished_since(self, key: str, when: float) -> bool:
        """Whether a worker let go of `key` after `when` (its files are this batch run's)."""
        for _, path, released in reversed(self._attempts(key)):
            if released:
                with contextlib.suppress(OSError):
                    return os.stat(path + RELEASED).st_mtime >= when
                return False
        return False

    # --- holding ------------------------------------------------------------------------------

    def take(self, key: str) -> bool:
        """Claim `key`: True if this worker holds it now, False while another live worker of
        this batch does. StageFileError if a live worker of another batch holds it."""
        while True:
            attempts = self._attempts(key)
            if attempts and not attempts[-1][2]:
                _, path, _ = attempts[-1]
                if path == self._held.get(key):
                    return True
                who = self._who(path)
                if self._alive(path, who):
                    if who is not None and who.get("batch") != self.batch:
                        raise StageFileError(
                            f"{self.dir}: prompt {key} is being made by another batch "
                            f"({who.get('worker')}: {who.get('command', '?')}); expected every "
                            "worker sharing a folder to run the same command (the same prompt "
                            "list and flags): wait for that batch to end, or give another "
                            "--output_dir")
                    return False
            n = attempts[-1][0] + 1 if attempts else 1
            path = os.path.join(self.dir, f"{key}.{n}")
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                continue  # another worker took attempt n this instant: look again
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"worker": self.worker, "host": self.host, "pid": self.pid,
                           "process_start": _process_start(self.pid), "batch": self.batch,
                           "taken": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "command": " ".join(sys.argv)[:500]}, f)
            with self._guard:
                self._held[key] = path
            self._start_heartbeat()
            return True

    def ours(self, key: str) -> bool:
        """Whether this worker still holds `key` (a stalled worker's claim may have been taken
        over: it then publishes nothing of that prompt)."""
        path = self._held.get(key)
        attempts = self._attempts(key)
        return path is not None and bool(attempts) and attempts[-1][1] == path \
            and not attempts[-1][2]

    def release(self, key: str) -> None:
        with self._guard:
            path = self._held.pop(key, None)
        if path is not None:
            with contextlib.suppress(FileExistsError):
                os.close(os.open(path + RELEASED, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))

    def close(self) -> None:
        for key in list(self._held):
            self.release(key)
        self._stop.set()

    def _start_heartbeat(self) -> None:
        if self._beat is None:
            self._beat = threading.Thread(target=self._heartbeat, name="claims-heartbeat",
                                          daemon=True)
            self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease / 4):
            with self._guard:
                paths = list(self._held.values())
            for path in paths:
                with contextlib.suppress(OSError):
                    os.utime(path)

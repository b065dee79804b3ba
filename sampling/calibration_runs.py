"""Finished calibration runs kept on disk, so a killed budget calibration resumes.

Budgeted mode's calibration runs every configuration on a few draws, screens and confirms the
chosen ones on up to a hundred more: thousands of runs, hours on trained weights (the trained
HunyuanVideo-1.5 twin's was still confirming after 2 h on a CPU core). Every run is a pure
function of the weights, the sampler, the configuration and the draw, so each finished one is
appended to a JSON-lines file as it lands (one line, flushed and fsync'ed: a kill loses at most
the run under way), and a rerun with the same file answers those from it instead of sampling.

The file's first line names what its runs hold for (the weights' fingerprint, the sampler's
steps, solver and shift, the backend); a rerun with anything else is refused with what differs,
never mixed in. A line cut short by a kill (the last one) is dropped and run again: the file is
truncated after the last whole line, in place, so a kill at that moment loses nothing else
(rewriting the kept lines would put every one of them at risk).
"""

from __future__ import annotations

import json
import os

import torch

from sampling.errors import StageFileError

VERSION = 1


class RunsFileError(StageFileError):
    """The runs file cannot be read, or holds runs of other weights or settings."""


def identity(weights, *, model: str, steps: int, solver: str, shift: float, shape,
             **more) -> dict:
    """What a calibration's runs hold for: the weights' fingerprint, the sampler, the latent
    shape, `more` (the backend, the CFG scale) and torch's thread count (a CPU run's last bits
    move with it)."""
    return {"weights": weights, "model": model, "steps": steps, "solver": solver, "shift": shift,
            "shape": list(shape), **more, "threads": torch.get_num_threads()}


def key(fields: dict, seed: int) -> str:
    """One run's key: the configuration's fields (canonical JSON) and the draw."""
    return json.dumps([fields, seed], sort_keys=True)


class RunMemo:
    """get(fields, seed) -> (rel L2, computed fraction) or None; add(...) appends one run."""

    def __init__(self, path: str, identity: dict):
        self.path, self.identity, self.runs = path, {"version": VERSION, **identity}, {}
        self.reused = 0
        self.torn = False  # a last line cut short by a kill was dropped
        header = json.dumps(self.identity, sort_keys=True)
        if os.path.exists(path) and os.path.getsize(path) > 0:
            self._read(header)
        else:
            with open(path, "w") as f:
                f.write(header + "\n")
                f.flush()
                os.fsync(f.fileno())

    def _read(self, header: str) -> None:
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
            lines = raw.decode("utf-8", errors="surrogateescape").split("\n")
        except OSError as exc:
            raise RunsFileError(f"runs file {self.path}: cannot read it ({exc}); expected the "
                                "JSON-lines file of an earlier calibration, or a new path") from None
        try:
            theirs = json.loads(lines[0])
        except ValueError:
            theirs = None
        mine = json.loads(header)
        if theirs != mine:
            differ = (sorted(k for k in {**theirs, **mine} if theirs.get(k) != mine.get(k))
                      if isinstance(theirs, dict) else "its first line is not a header")
            raise RunsFileError(f"runs file {self.path}: holds runs of other weights or settings "
                                f"(differs in: {differ}); expected runs of this calibration; "
                                "give another path or remove it")
        for i, line in enumerate(lines[1:], 1):
            if not line:
                continue
            try:
                run = json.loads(line)
                self.runs[run["key"]] = (float(run["rel_l2"]), float(run["computed"]))
            except (ValueError, KeyError, TypeError):
                if any(lines[i + 1:]):
                    raise RunsFileError(f"runs file {self.path}: line {i + 1} is not a run "
                                        "({key, rel_l2, computed}); expected only a last line "
                                        "torn by a kill") from None
                # the torn last line: cut it off and run it again
                self._cut_torn(len("\n".join(lines[:i]).encode("utf-8", "surrogateescape")) + 1)
                break

    def _cut_torn(self, keep: int) -> None:
        """Truncate after the first `keep` bytes (the whole lines): the kept runs are never
        rewritten."""
        with open(self.path, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
        self.torn = True

    def resumed(self) -> str | None:
        """The line a calibration prints when it takes runs from the file, else None."""
        if not self.runs:
            return None
        return (f"resuming from {self.path}: {len(self.runs)} finished run(s) kept"
                + (", a last line torn by a kill dropped (it runs again)" if self.torn else ""))

    def get(self, fields: dict, seed: int):
        found = self.runs.get(key(fields, seed))
        if found is not None:
            self.reused += 1
        return found

    def add(self, fields: dict, seed: int, rel_l2: float, computed: float) -> None:
        k = key(fields, seed)
        self.runs[k] = (rel_l2, computed)
        with open(self.path, "a") as f:
            f.write(json.dumps({"key": k, "rel_l2": rel_l2, "computed": computed}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def __len__(self) -> int:
        return len(self.runs)

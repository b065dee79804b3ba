"""Resuming a prompt batch: each prompt's request id (its line, seed, model and every flag that
changes an output, with the files they name), and what the prompt's folder already holds for that
very request, so a rerun skips, decodes, samples or encodes it (`commands.generate`)."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from sampling.errors import StageFileError
from sampling.stage_io import (
    EMBEDDINGS,
    LATENTS,
    PAIR_ID,
    VIDEO,
    read_config,
    settled_folder,
)

LINE_KEYS = ("prompt", "negative_prompt", "image", "audio", "seed")
UNCACHED_VIDEO = "output_video_uncached.mp4"  # --compare's uncached video, beside the cached one
STRIP = "compare_strip.png"  # --compare's frames, cached above uncached

REQUEST = "request_id"  # in every stage's generation_config.json: the request the files answer
# what a prompt still needs, from least to most work
DONE, DECODE, SAMPLE, ENCODE = "done", "decode", "sample", "encode"
STATES = (DONE, DECODE, SAMPLE, ENCODE)
OTHER = "other"  # made by another worker of the batch while this one ran
# flags that change no output: where files go, what is printed, how the run is launched
_NOT_REQUEST = {"help_all", "quiet", "verbose", "summary_json", "prompt", "prompts", "output_dir",
                "input_dir", "overwrite", "multihost", "coordinator_address", "num_processes",
                "process_id", "no_progress", "telemetry_json", "telemetry_csv", "tensorboard_dir",
                "plot_png", "compile_cache_dir", "warmup_steps", "claims_dir", "claim_lease"}
_PATHS = {"image", "audio", "model_path", "encoder_path", "vae_path", "budget_profile",
          "magcache_profile"}
_HASHED = 64 << 20  # files up to this size are known by their bytes, larger ones (checkpoints)
# by size and modification time


def _identity(path: str | None):
    """What a path's contents are, as far as a rerun can tell cheaply."""
    if path is None:
        return None
    real = os.path.realpath(path)
    try:
        if os.path.isdir(real):
            return [real, sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns)
                                 for e in os.scandir(real) if e.is_file())]
        st = os.stat(real)
        if st.st_size > _HASHED:
            return [real, st.st_size, st.st_mtime_ns]
        with open(real, "rb") as f:
            return [real, hashlib.sha256(f.read()).hexdigest()]
    except OSError:
        return [real, None]


def request_id(given: dict, entry: dict, seed: int, model: str) -> str:
    """One prompt's request: its line, seed and model and every flag that changes an output
    (`given`: {flag's dest: value}, `sampling.cli.leaves` of the command's request; the files
    named by flags or lines as their contents), as a short hash."""
    flags = {k: _identity(v) if k in _PATHS else v for k, v in sorted(given.items())
             if k not in _NOT_REQUEST}
    line = {k: _identity(entry.get(k)) if k in _PATHS else entry.get(k) for k in LINE_KEYS}
    text = json.dumps({"flags": flags, "line": line, "seed": seed, "model": model},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def folder_state(folder: str, request: str, compare: bool) -> str:
    """What `folder` still needs for `request`: DONE (its video), DECODE (its latents), SAMPLE
    (its embeddings) or ENCODE (nothing of this request). An interrupted commit is finished
    first, so a kill mid-write reads as the old or the new files, never half of them."""
    if not os.path.isdir(folder):
        return ENCODE
    try:
        with settled_folder(folder):
            config = read_config(folder)
    except (OSError, StageFileError):
        return ENCODE
    if config.get(REQUEST) != request:
        return ENCODE
    has = {name: os.path.isfile(os.path.join(folder, name))
           for name in (EMBEDDINGS, LATENTS, VIDEO, UNCACHED_VIDEO, STRIP)}
    if "output_video" in config and has[VIDEO] and (not compare or (has[UNCACHED_VIDEO]
                                                                    and has[STRIP])):
        return DONE
    if PAIR_ID in config:  # stage 2's config: its latents (the pair is checked when read)
        # --compare decodes the uncached latents too, which only a sampling run holds
        return DECODE if has[LATENTS] and not compare else ENCODE
    return SAMPLE if has[EMBEDDINGS] else ENCODE


def agree(states: list[str], multihost: bool) -> list[str]:
    """Process 0's reading of the folders, on every process of a multi-host job (stage 2 is one
    collective computation: every host must sample the same prompts)."""
    if not multihost:
        return states
    import jax
    if jax.process_count() == 1:
        return states
    from jax.experimental import multihost_utils
    codes = multihost_utils.broadcast_one_to_all(
        np.asarray([STATES.index(s) for s in states], np.int32))
    return [STATES[int(c)] for c in np.asarray(codes)]


def resuming(states: list[str]) -> str | None:
    counts = {s: states.count(s) for s in STATES}
    if counts[ENCODE] == len(states):
        return None
    n = len(states)
    return (f"resuming: {counts[DONE]} of {n} prompt(s) skipped (their video is there), "
            f"{counts[DECODE]} decoded from their latents, {counts[SAMPLE]} sampled from their "
            f"embeddings, {counts[ENCODE]} from the start (--overwrite redoes them all)")

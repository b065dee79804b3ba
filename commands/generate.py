"""Prompt(s) in, mp4(s) out, in one process: stage 1, stage 2 with caching, stage 3.

    python generate.py --prompt "red circle moves right on blue" --enable_cache
    python generate.py --prompts prompts.txt --enable_cache --output_dir videos
    python generate.py --model wan2.2-ti2v-5b --model_path /ckpts/Wan2.2-TI2V-5B \
        --encoder_path /ckpts/Wan2.2-TI2V-5B --vae_path /ckpts/Wan2.2-TI2V-5B/Wan2.2_VAE.pth \
        --prompt "..." --image first.png --enable_cache

`--prompts FILE`: one prompt per line, or JSON lines {"prompt": ..., "negative_prompt": ...,
"image": ..., "audio": ..., "seed": ...}; blank lines and lines starting with # are skipped.
Every line, file and flag is checked before any model work. The encoders run for every prompt
first and are freed; the DiT loads once and its programs compile once (for the first prompt's
shapes: later prompts of the same shapes compile nothing); then each prompt is sampled and
decoded at once by one VAE, so its video is final before the next prompt starts. One prompt
writes its stage files and `output_video.mp4` in --output_dir; several write folder 001, 002, ...
in it. `--compare` adds the uncached video (`output_video_uncached.mp4`) and `compare_strip.png`
(cached frames above, uncached below), committed with the cached video.
Every stage-2 flag applies (cache flags, --seed: the first prompt's, the next ones +1, +2, ...
unless a line gives its own).

A rerun of the same command resumes: each stage's config records its prompt's request id
(`request_id`), and a prompt whose folder holds the video of the same request is skipped, one
with its latents is decoded, one with its embeddings sampled; `--overwrite` redoes every prompt.
One run writes into the output folder at a time (`sampling.one_writer`), except the workers of
one batch: the same `--prompts` command run by several processes, or by several hosts or slices
sharing --output_dir, shares the list by per-prompt claims (`commands.batch`, `sampling.claims`):
each prompt made by one worker, a dead worker's prompt taken over, each worker's summary its own
and `index.json` in the folder the whole list's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from encoders.request import EncoderInputError
from sampling.claims import CLAIMS, LEASE, Claims
from sampling.cli import CommandParser, as_int, as_number, command, leaves, typed
from sampling.errors import StageFileError, UsageError
from sampling.journal import Staged
from sampling.one_writer import one_writer
from sampling.pipelines import DEFAULT_PIPELINE
from sampling.run_spec import DEFAULT_SEED, RunSpec
from sampling.stage_io import (
    CONFIG,
    EMBEDDINGS,
    LATENTS,
    VIDEO,
    check_writable,
    read_config,
    read_tensors,
    write_stage,
)
from sampling.video_file import encode_mp4

from . import batch, stage1, stage2, stage3
from .resume import (
    DONE,
    ENCODE,
    LINE_KEYS,
    OTHER,
    REQUEST,
    SAMPLE,
    STATES,
    STRIP,
    UNCACHED_VIDEO,
    agree,
    folder_state,
    request_id,
    resuming,
)
from .stage1 import Inputs
from .stage2_resolve import Stage2Request
from .stage3 import DecodeReport, Stage3Request

ERRORS = (*stage1.ERRORS, *stage2.ERRORS, *stage3.ERRORS)
MAX_PROMPTS = 10_000


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="generate.py",
        common=stage1.COMMON | stage2.COMMON - {"input_dir"} | {"prompts", "vae_path", "fps"},
        sections=stage2.SECTIONS | {"stage 3": "inputs and model"},
        description="Prompt(s) to mp4(s): stage 1 (encoders), stage 2 (the DiT with feature "
                    "caching), stage 3 (VAE decode) in one process.")
    g = parser.add_argument_group("inputs and model")
    g.add_argument("--prompt", help="the prompt")
    g.add_argument("--prompts", help="a file of prompts: one a line, or JSON lines with "
                   f"{', '.join(LINE_KEYS)}")
    g.add_argument("--overwrite", action="store_true",
                   help="redo every prompt (default: a rerun skips the prompts whose folder holds "
                   "the video of the same request, and resumes those with latents or embeddings;"
                   " with several workers, start only the first with it)")
    g.add_argument("--claims_dir", help="where the workers of a --prompts batch keep their "
                   f"per-prompt claims (default: {CLAIMS} in --output_dir); it needs an atomic "
                   "exclusive create (local disk, NFS v3+, Lustre), which a bucket mount may not "
                   "give: see docs/tpu.md")
    g.add_argument("--claim_lease", type=float, default=LEASE,
                   help="seconds without a heartbeat after which another host's worker is taken "
                   f"for dead and its prompt taken over (default {LEASE:.0f}; on one host a dead "
                   "worker is seen at once)")
    stage1.add_arguments(parser, sizes=False)
    g = parser.add_argument_group("stage 3")
    g.add_argument("--vae_path", help="the VAE checkpoint (default: the model's built-in one, or "
                   "a tiny random VAE)")
    g.add_argument("--fps", type=float, help="frames per second (default: the model's)")
    stage2.add_arguments(parser)
    for action in parser._actions:  # stage 2's flag, which writes elsewhere when run alone
        if action.dest == "output_dir":
            action.help = ("where the videos go: the folder itself for one prompt, one numbered "
                           "subfolder a prompt for --prompts (default ./outputs)")
    return parser


# --- prompts -----------------------------------------------------------------------------------

def _line(path: str, number: int, text: str) -> dict:
    where = f"--prompts {path} line {number}"
    if not text.lstrip().startswith("{"):
        return {"prompt": text.strip()}
    try:
        entry = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where}: not valid JSON ({exc.msg}); expected a prompt, or a JSON "
                         f"object with {', '.join(LINE_KEYS)}") from None
    if not isinstance(entry, dict):
        raise UsageError(f"{where}: a JSON {type(entry).__name__}; expected an object with "
                         f"{', '.join(LINE_KEYS)}")
    unknown = sorted(set(entry) - set(LINE_KEYS))
    if unknown:
        raise UsageError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(unknown)}; expected {', '.join(LINE_KEYS)}")
    if not isinstance(entry.get("prompt"), str) or not entry["prompt"].strip():
        raise UsageError(f"{where}: no \"prompt\" text; expected a non-empty string")
    for key in ("negative_prompt", "image", "audio"):
        if entry.get(key) is not None and not isinstance(entry[key], str):
            raise UsageError(f"{where}: \"{key}\" is {entry[key]!r}; expected a string")
    if "seed" in entry:
        entry["seed"] = as_int(f"{where}: \"seed\"", entry["seed"], minimum=0,
                               maximum=2 ** 64 - 1)
    return entry


SHOWN = 80  # characters of a refused prompt echoed back (a line can be 200 KB)


def shown(text: str) -> str:
    """A prompt as an error message quotes it: its first SHOWN characters."""
    return repr(text) if len(text) <= SHOWN else f"{text[:SHOWN]!r}... ({len(text):,} characters)"


def numbered_prompts(prompt: str | None, prompts: str | None) -> list[tuple[str, dict]]:
    """The job's prompts, each {"prompt", and optionally "negative_prompt", "image", "audio",
    "seed"}, checked line by line, with where each came from ("--prompt", "--prompts FILE line
    N"): the --prompt flag's, or the --prompts file's."""
    if (prompt is None) == (prompts is None):
        raise UsageError("give --prompt TEXT or --prompts FILE (one of them)")
    if prompt is not None:
        if not prompt.strip():
            raise UsageError("--prompt '': expected a prompt")
        return [("--prompt", {"prompt": prompt})]
    try:
        with open(prompts, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise UsageError(f"--prompts {prompts} does not exist; expected a text file of "
                         "prompts") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--prompts {prompts} cannot be read ({exc}); expected a UTF-8 "
                         "text file of prompts") from None
    entries = [(f"--prompts {prompts} line {n}", _line(prompts, n, text))
               for n, text in enumerate(lines, 1)
               if text.strip() and not text.lstrip().startswith("#")]
    if not entries:
        raise UsageError(f"--prompts {prompts} holds no prompt; expected one a line")
    if len(entries) > MAX_PROMPTS:
        raise UsageError(f"--prompts {prompts} holds {len(entries)} prompts; expected at "
                         f"most {MAX_PROMPTS} a job")
    return entries


# --- the job -----------------------------------------------------------------------------------

def _say(writer: bool, text: str) -> None:
    if writer:
        print(text, file=sys.stderr, flush=True)


def _folders(root: str, n: int) -> list[str]:
    return [root] if n == 1 else [os.path.join(root, f"{i + 1:03d}") for i in range(n)]


def _root(output_dir: str | None) -> str:
    return output_dir if output_dir is not None else "outputs"


# --- the job -----------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """The command line, typed: its own flags, stage 1's conditioning and encoders, and stage
    2's flags (each prompt's run is `sample` with the prompt's folder and seed)."""

    prompt: str | None
    prompts: str | None
    overwrite: bool
    claims_dir: str | None
    claim_lease: float
    vae_path: str | None
    fps: float | None
    inputs: Inputs
    sample: Stage2Request


def request_of(args: argparse.Namespace) -> GenerateRequest:
    """The command line's request: the one place this command reads its Namespace."""
    return typed(GenerateRequest, args)


def run(args: argparse.Namespace) -> dict:
    return generate(request_of(args))


def generate(r: GenerateRequest) -> dict:
    """Every prompt to its video; returns the job's report."""
    if r.sample.input_dir is not None:
        raise UsageError("--input_dir: this command makes its own stage-1 inputs from the "
                         "prompts; run stage2_transformer_flax_deepcache.py for a stage-1 folder")
    r = dataclasses.replace(r, sample=dataclasses.replace(
        r.sample, model=r.sample.model or DEFAULT_PIPELINE))
    sample, inputs = r.sample, r.inputs
    numbered = numbered_prompts(r.prompt, r.prompts)
    entries = [entry for _, entry in numbered]
    pipe = stage1.pipeline_of(sample.model)
    folders = _folders(_root(sample.output_dir), len(entries))
    base_seed = sample.seed if sample.seed is not None else DEFAULT_SEED
    flags = leaves(r)
    jobs = []
    for i, (entry, folder) in enumerate(zip(entries, folders, strict=True)):
        request = stage1.encoder_request(
            inputs, entry["prompt"], height=sample.height, width=sample.width,
            frames=sample.video_length, clips=sample.num_clips,
            **{k: entry.get(k) for k in ("negative_prompt", "image", "audio")})
        seed = entry.get("seed", (base_seed + i) % 2 ** 64)
        check_writable(folder, "--output_dir", (EMBEDDINGS, CONFIG, LATENTS, VIDEO)
                       + ((UNCACHED_VIDEO, STRIP) if sample.compare else ()))
        try:
            stage1.check(pipe, request, inputs.encoder_path, inputs.random_encoders)
        except EncoderInputError as exc:
            if exc.name not in ("--prompt", "--negative_prompt"):
                raise
            # name the file and line of a batch's prompt, and quote a long one only in part
            text = request.prompt if exc.name == "--prompt" else request.negative_prompt or ""
            problem = exc.problem.replace(repr(text), shown(text), 1)
            where = numbered[i][0] if r.prompts is not None else exc.name
            if r.prompts is not None and exc.name == "--negative_prompt":
                where += ' "negative_prompt"' if "negative_prompt" in entry else " (--negative_prompt)"
            raise EncoderInputError(where, problem, exc.expected) from None
        jobs.append(Job(request, functools.partial(
            stage2.resolve, dataclasses.replace(sample, output_dir=folder, seed=seed)), folder,
            request_id(flags, entry, seed, pipe.name)))
    # stage 2's flags, sizes and outputs, checked on the first prompt: refused here, before any
    # model loads
    jobs[0].resolve(None)
    # stage 3 of each prompt, in its folder; one compile cache for both stages
    decode = Stage3Request(input_dir=folders[0], output_dir=None, model=None, vae_path=r.vae_path,
                           fps=r.fps, dtype=stage3.DEFAULT_DTYPE, backend=None, device=None,
                           compile_cache_dir=sample.launch.compile_cache_dir, patch_parallel=False,
                           grid=None, tiled=False, tile_size=None)
    if r.fps is not None:
        as_number("--fps", r.fps, minimum=stage3.MIN_FPS, maximum=stage3.MAX_FPS)
    as_number("--claim_lease", r.claim_lease, minimum=1.0, maximum=86400.0)
    shared = len(jobs) > 1  # a batch: its workers share the folder, each prompt by its claim
    if shared and r.claims_dir is not None:
        check_writable(r.claims_dir, "--claims_dir")

    if sample.launch.multihost:  # before anything touches JAX (importing the backend does)
        from tpu.compile import cache_dir_of, enable_compile_cache
        from tpu.distributed import initialize
        initialize(sample.launch.coordinator_address, sample.launch.num_processes, sample.launch.process_id)
        # the processes agree on each prompt's state (`resume.agree`, a psum) before stage 2 turns
        # the persistent cache on: without it there, that program compiled again on every run
        enable_compile_cache(cache_dir_of(sample.launch.compile_cache_dir))
    writer = stage2.backend_writer(sample.launch.multihost)
    root = _root(sample.output_dir)
    settings = Settings(overwrite=r.overwrite, compare=sample.compare, multihost=sample.launch.multihost,
                        encoder_path=inputs.encoder_path, encoder_device=inputs.encoder_device,
                        vae_path=r.vae_path)
    with one_writer(root, shared=shared) if writer else contextlib.nullcontext():
        claims = Claims(r.claims_dir or os.path.join(root, CLAIMS),
                        batch.batch_id(j.id for j in jobs), r.claim_lease) \
            if writer and shared else None
        try:
            report = _job(settings, pipe, jobs, decode, writer, claims)
            if shared and writer:
                report["index"] = batch.write_index(
                    root, jobs, [where for where, _ in numbered], claims, VIDEO,
                    lambda j: folder_state(j.folder, j.id, sample.compare) == DONE)
        finally:
            if claims is not None:
                claims.close()
    return {**report, "random_encoders": stage1.random_encoders_used(pipe, inputs.encoder_path)}


_PER_CALL = ("trace", "histograms", "summary")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What the job's loop needs of its own flags (each prompt's stage-2 run is its `Job`'s)."""

    overwrite: bool
    compare: bool
    multihost: bool
    encoder_path: str | None
    encoder_device: str | None
    vae_path: str | None


def own_config(job: "Job", what: str) -> dict:
    """The folder's stage config, read back before its files are used: refused where another
    request's run wrote into the folder after this job checked it (issue 62: the batch then
    published that run's video as its own prompt's)."""
    config = read_config(job.folder)
    if config.get(REQUEST) != job.id:
        raise StageFileError(f"--output_dir {job.folder}: its {what} are another request's (a "
                             "run outside this batch wrote into the folder while it ran); "
                             "expected this batch's own: nothing of that prompt is published, "
                             "run the batch again to redo it")
    return config


class Job:
    """One prompt of the job: its stage-1 request, its stage-2 run (resolved from its flags once
    its stage-1 (tensors, config) are there, `resolve(given)`), its folder and request id."""

    def __init__(self, request, resolve: Callable[[tuple | None], RunSpec], folder: str,
                 request_id: str):
        self.request, self.resolve, self.folder, self.id = request, resolve, folder, request_id
        self.state = self.found = ENCODE  # what it needs now; what it needed at the start
        self.given = None  # stage 1's (tensors, config), made or read back
        self.report = None  # stage 2's, when this run sampled it
        self.decode = None  # stage 3's seconds and compiles, when this run decoded it
        self.uncached = None  # --compare: the uncached latents
        self.by_other = False  # made by another worker of the batch while this one ran


def _job(settings: Settings, pipe, jobs: list[Job], decode_request: Stage3Request, writer: bool,
         claims: Claims | None = None) -> dict:
    began, began_wall = time.perf_counter(), time.time()
    n = len(jobs)
    states = [ENCODE] * n if settings.overwrite else [
        folder_state(j.folder, j.id, settings.compare) for j in jobs] if writer else [ENCODE] * n
    for job, state in zip(jobs, agree(states, settings.multihost), strict=True):
        job.state = job.found = state
    note = resuming([j.state for j in jobs])
    if note:
        _say(writer, note)

    def peek(job: Job) -> None:
        job.state = folder_state(job.folder, job.id, settings.compare)

    def refresh(job: Job) -> None:
        # once claimed: what the folder holds now (another worker may have made it); with
        # --overwrite only what a worker made since this one started counts
        if not settings.overwrite or claims.finished_since(batch.key_of(job.folder), began_wall):
            peek(job)

    say = functools.partial(_say, writer)
    # stage 1: every prompt without embeddings of its request, then the encoders go before the
    # DiT loads. The other hosts of a multi-host job encode what they sample (they may not share
    # the writer's disk)
    encoding = batch.turns(jobs, claims, lambda j: j.state == ENCODE or (
        j.state == SAMPLE and not writer), refresh, peek, say)
    with contextlib.closing(encoding):
        for i, job in encoding:
            _encode(job, f"[{i + 1}/{n}]", pipe, settings, writer)
    gc.collect()

    # stages 2 and 3 prompt by prompt: a video is final as soon as its prompt is decoded. One
    # backend, its programs built for the first sampled prompt's shapes; one VAE and decoder
    backend, decode = None, _Decoder(decode_request)
    turns = batch.turns(jobs, claims, lambda j: j.state != DONE, refresh, peek, say,
                        last=True) if writer else None
    with contextlib.closing(turns) if turns is not None else contextlib.nullcontext():
        for i, job in batch.agreed(turns, jobs, settings.multihost, STATES):
            at = f"[{i + 1}/{n}]"
            if job.state == ENCODE:  # its embeddings went after stage 1 (removed by hand)
                _encode(job, at, pipe, settings, writer)
            if job.state in (SAMPLE, ENCODE):
                if job.given is None and not writer:
                    _encode(job, at, pipe, settings, writer)
                given = job.given or (read_tensors(os.path.join(job.folder, EMBEDDINGS))[0],
                                      own_config(job, EMBEDDINGS))
                spec = job.resolve(given)
                opened = None
                if backend is None:
                    backend, opened = stage2.open_backend(spec)
                _publishing(job, claims)
                say(f"{at} stage 2 sampling {shown(job.request.prompt)} ...")
                report, job.uncached = stage2.sample_and_write(spec, backend, writer, opened)
                # the per-call trace stays in the prompt's own telemetry: a batch of thousands
                # keeps each prompt's figures only
                job.report = {k: v for k, v in report.as_dict().items() if k not in _PER_CALL}
                computed, calls = report.calls
                say(f"{at} stage 2 {report.time['stage_seconds']:.2f} s  computed "
                    f"{computed}/{calls} calls, {speedup_text(job.report)}, compiles warm-up "
                    f"{_lowered(report.compiles['warmup'])} loop "
                    f"{_lowered(report.compiles['loop'])}")
                for warning in report.warnings:  # slower than uncached, and the like
                    say(f"{at} warning: {warning}")
            if job.state != DONE and writer:
                say(f"{at} stage 3 decoding into {job.folder} ...")
                _publishing(job, claims)
                out = decode(job)
                # on JAX stage 3's counts (prepare, loop, process: `compiled` is what the
                # persistent cache did not serve), as stage 2's; none on torch
                job.decode = {"seconds": out.decode_seconds, "compiles": out.compiles}
                say(f"{at} stage 3 {out.decode_seconds:.2f} s  "
                    f"{os.path.join(job.folder, VIDEO)}")
            job.given = job.uncached = None  # a long batch holds one prompt's tensors at a time
    return {"model": pipe.name, "prompts": [j.request.prompt for j in jobs],
            "videos": [os.path.join(j.folder, VIDEO) for j in jobs] if writer else [],
            "states": [OTHER if j.by_other else j.found for j in jobs],
            "stage2": [j.report for j in jobs], "stage3": [j.decode for j in jobs],
            "seconds": time.perf_counter() - began, "writer": writer,
            "worker": claims.worker if claims is not None else None}


def _encode(job: Job, at: str, pipe, settings: Settings, writer: bool) -> None:
    """Stage 1 of one prompt: written into its folder (read back when its turn comes: a batch
    holds one prompt's tensors), or kept by a multi-host job's other processes."""
    t0 = time.perf_counter()
    # a line before the work too: stage 1 runs seconds (tiny S2V) to minutes with nothing else
    # on the screen (issue 62)
    _say(writer, f"{at} stage 1 encoding {shown(job.request.prompt)} ...")
    tensors, metadata, config = stage1.encode(pipe, job.request, settings.encoder_path,
                                              settings.encoder_device)
    config[REQUEST] = job.id
    if writer:
        write_stage(job.folder, tensors, EMBEDDINGS, metadata, config)
        job.state = SAMPLE
    else:
        job.given = (tensors, config)
    _say(writer, f"{at} stage 1 {time.perf_counter() - t0:.2f} s  {job.request.prompt!r}")


def _publishing(job: Job, claims: Claims | None) -> None:
    """Before a stage writes a prompt's files: this worker still holds its claim (one that
    stalled past the lease may have lost it to another worker, which then makes the prompt)."""
    if claims is not None and not claims.ours(batch.key_of(job.folder)):
        raise StageFileError(f"--output_dir {job.folder}: this worker's claim on the prompt was "
                             f"taken over (it went {claims.lease:.0f} s without a heartbeat, as "
                             "a dead worker does); expected to hold it while writing: nothing of "
                             "the prompt is published by this worker, another one makes it")


class _Decoder:
    """Stage 3 for every prompt of the job: one VAE, and on JAX one decoder whose programs
    compile for the first prompt's shapes and are reused by the next ones."""

    def __init__(self, request: Stage3Request):
        self.request = request
        self.built, self.decoders = None, {}
        # The mp4 writer starts ffmpeg through subprocess, whose fork is followed by exec at
        # once; JAX's warning about forking a multithreaded process is for forks that go on
        # running Python
        warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)

    def __call__(self, job: Job) -> DecodeReport:
        own_config(job, LATENTS)  # never a video of another request's latents
        r3 = stage3.resolve(dataclasses.replace(self.request, input_dir=job.folder))
        device = stage3.device_for(None, None)
        if self.built is None:
            self.built = stage3.build_vae(r3.pipe, self.request.vae_path, r3.dtype)
        also = None
        if job.uncached is not None:  # --compare: the uncached video and a strip beside it
            also = Staged()
            cached = stage3.video_frames(self.built[0], r3.latents.to(device), r3.pipe)
            reference = stage3.video_frames(self.built[0], job.uncached.to(device), r3.pipe)
            also.add_folder(job.folder, lambda tmp, c=cached, u=reference, fps=r3.fps:
                            _write_compare(tmp, c, u, fps), "--compare")
        try:
            if r3.backend == "jax":  # stage 3's default, as stage 2's
                out = stage3.decode_jax(r3, self.built, also, self.decoders)
            else:
                out = stage3.decode_torch(r3, 0, 1, device, self.built, also)
        finally:
            if also is not None:
                also.discard()
        return out


def _write_compare(folder: str, cached, uncached, fps: float) -> None:
    """The uncached video, and a PNG of both: cached frames above, uncached below."""
    from PIL import Image
    encode_mp4(os.path.join(folder, UNCACHED_VIDEO), uncached, fps)
    rows = [np.concatenate(list(v), axis=1) for v in (cached, uncached)]
    gap = np.full((max(2, rows[0].shape[0] // 32), rows[0].shape[1], 3), 255, np.uint8)
    Image.fromarray(np.concatenate([rows[0], gap, rows[1]])).save(os.path.join(folder, STRIP))


def _lowered(counts) -> str:
    return "-" if counts is None else str(counts["lowered"])


def speedup_text(r: dict) -> str:
    """A prompt's speedup as the console shows it: measured against the uncached run and its
    PSNR where --compare ran one (issue 62: the estimate alone read 1.26x where the loops took
    0.95x), else the estimate; the schedule ideal beside."""
    ideal = r["speedup"]["schedule_ideal"]
    if "compare" in r:
        c = r["compare"]
        return (f"speedup {c['speedup']:.2f}x measured against uncached (estimated "
                f"{r['speedup']['estimated'] or 0:.2f}x, schedule ideal {ideal:.2f}x), PSNR "
                f"{c['psnr_db']:.1f} dB")
    return f"speedup {r['speedup']['estimated'] or 0:.2f}x estimated (schedule ideal {ideal:.2f}x)"


def format_summary(report: dict) -> str:
    lines = [f"generate: {report['model']}  {len(report['prompts'])} prompt(s) in "
             f"{report['seconds']:.1f} s"]
    if report.get("random_encoders"):
        lines.append(stage1.RANDOM_NOTE)
    for prompt, video, state, r in zip(report["prompts"], report["videos"], report["states"],
                                       report["stage2"], strict=True):
        how = (speedup_text(r) if r is not None else
               "skipped: made by an earlier run" if state == DONE else
               "made by another worker of this batch" if state == OTHER else
               "decoded from an earlier run's latents")
        lines.append(f"  {video}  {prompt!r}  {how}")
    sampled = [r for r in report["stage2"] if r is not None]
    others = report["states"].count(OTHER)
    if report.get("worker") is not None:
        mine = len(report["prompts"]) - others - report["states"].count(DONE)
        lines.append(f"this worker ({report['worker']}) made {mine} prompt(s), other workers "
                     f"{others}; the whole list: {report['index']}")
    skipped = report["states"].count(DONE)
    if skipped:
        lines.append(f"skipped {skipped} of {len(report['prompts'])} prompt(s) whose video an "
                     "earlier run of the same request made (--overwrite redoes them)")
    if sampled and sampled[0]["compiles"]["warmup"] is not None:
        first, rest = sampled[0], sampled[1:]
        later = sum(r["compiles"]["warmup"]["lowered"] for r in rest if r["compiles"]["warmup"])
        loop = sum(r["compiles"]["loop"]["lowered"] for r in sampled if r["compiles"]["loop"])
        lines.append(f"compiles: first prompt {first['compiles']['warmup']['lowered']}, later "
                     f"prompts {later}, in the loops {loop}")
    return "\n".join(lines)


main = command(build_parser, run, format_summary, ERRORS, lambda report: report["writer"])

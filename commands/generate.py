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
shapes: later prompts of the same shapes compile nothing); the VAE loads once. One prompt writes
its stage files and `output_video.mp4` in --output_dir; several write folder 001, 002, ... in it.
`--compare` adds the uncached video (`output_video_uncached.mp4`) and `compare_strip.png` (cached
frames above, uncached below), committed with the cached video.
Every stage-2 flag applies (cache flags, --seed: the first prompt's, the next ones +1, +2, ...
unless a line gives its own).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
import warnings

import numpy as np

from sampling.cli import CommandParser, UsageError, as_int, command
from sampling.pipelines import DEFAULT_PROMPT_PIPELINE
from sampling.stage_io import (
    CONFIG,
    EMBEDDINGS,
    LATENTS,
    VIDEO,
    Staged,
    check_writable,
    encode_mp4,
    write_stage,
)

from . import stage1, stage2, stage3

ERRORS = (*stage1.ERRORS, *stage2.ERRORS, *stage3.ERRORS)
LINE_KEYS = ("prompt", "negative_prompt", "image", "audio", "seed")
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
    stage1.add_arguments(parser, sizes=False)
    g = parser.add_argument_group("stage 3")
    g.add_argument("--vae_path", help="the VAE checkpoint (default: the model's built-in one, or "
                   "a tiny random VAE)")
    g.add_argument("--fps", type=float, help="frames per second (default: the model's)")
    stage2.add_arguments(parser)
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


def read_prompts(args) -> list[dict]:
    """The job's prompts, each {"prompt", and optionally "negative_prompt", "image", "audio",
    "seed"}, checked line by line."""
    if (args.prompt is None) == (args.prompts is None):
        raise UsageError("give --prompt TEXT or --prompts FILE (one of them)")
    if args.prompt is not None:
        if not args.prompt.strip():
            raise UsageError("--prompt '': expected a prompt")
        return [{"prompt": args.prompt}]
    try:
        with open(args.prompts, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise UsageError(f"--prompts {args.prompts} does not exist; expected a text file of "
                         "prompts") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--prompts {args.prompts} cannot be read ({exc}); expected a UTF-8 "
                         "text file of prompts") from None
    entries = [_line(args.prompts, n, text) for n, text in enumerate(lines, 1)
               if text.strip() and not text.lstrip().startswith("#")]
    if not entries:
        raise UsageError(f"--prompts {args.prompts} holds no prompt; expected one a line")
    if len(entries) > MAX_PROMPTS:
        raise UsageError(f"--prompts {args.prompts} holds {len(entries)} prompts; expected at "
                         f"most {MAX_PROMPTS} a job")
    return entries


# --- the job -----------------------------------------------------------------------------------

def _say(writer: bool, text: str) -> None:
    if writer:
        print(text, file=sys.stderr, flush=True)


def _folders(args, n: int) -> list[str]:
    root = args.output_dir if args.output_dir is not None else "outputs"
    return [root] if n == 1 else [os.path.join(root, f"{i + 1:03d}") for i in range(n)]


def run(args) -> dict:
    if args.input_dir is not None:
        raise UsageError("--input_dir: this command makes its own stage-1 inputs from the "
                         "prompts; run stage2_transformer_flax_deepcache.py for a stage-1 folder")
    args.model = args.model or DEFAULT_PROMPT_PIPELINE
    entries = read_prompts(args)
    pipe = stage1.pipeline_of(args)
    if pipe.task == "s2v":
        raise UsageError(f"--model {pipe.name}: this command does not run speech-to-video yet; "
                         "run stage1_encode.py, stage2_transformer_flax_deepcache.py and "
                         "stage3_vae_decode.py")
    folders = _folders(args, len(entries))
    base_seed = args.seed if args.seed is not None else stage2.DEFAULT_SEED
    jobs = []
    for i, (entry, folder) in enumerate(zip(entries, folders, strict=True)):
        request = stage1.request_of(args, entry["prompt"], **{
            k: entry.get(k) for k in ("negative_prompt", "image", "audio")})
        run_args = copy.copy(args)
        run_args.output_dir = folder
        run_args.seed = entry.get("seed", (base_seed + i) % 2 ** 64)
        check_writable(folder, "--output_dir", (EMBEDDINGS, CONFIG, LATENTS, VIDEO)
                       + ((UNCACHED_VIDEO, STRIP) if args.compare else ()))
        stage1.check(pipe, request, args.encoder_path)
        jobs.append((request, run_args, folder))
    # stage 2's flags, sizes and outputs, on synthetic inputs: refused here, before any encoder
    stage2.resolve(copy.copy(jobs[0][1]))
    stage3_args = stage3.build_parser().parse_args([])
    stage3_args.vae_path, stage3_args.fps = args.vae_path, args.fps
    if args.fps is not None:
        from sampling.cli import as_number
        as_number("--fps", args.fps, minimum=stage3.MIN_FPS, maximum=stage3.MAX_FPS)

    if args.multihost:  # before anything touches JAX (importing the backend does)
        from tpu.distributed import initialize
        initialize(args.coordinator_address, args.num_processes, args.process_id)
    writer = stage2.backend_writer(args)
    began = time.perf_counter()
    n = len(jobs)

    # stage 1: every prompt, then the encoders go before the DiT loads
    encoded = []
    for i, (request, _, folder) in enumerate(jobs):
        t0 = time.perf_counter()
        tensors, metadata, config = stage1.encode(pipe, request, args.encoder_path,
                                                  args.encoder_device)
        if writer:
            write_stage(folder, tensors, EMBEDDINGS, metadata, config)
        encoded.append((tensors, config))
        _say(writer, f"[{i + 1}/{n}] stage 1 {time.perf_counter() - t0:.2f} s  {request.prompt!r}")
    gc.collect()

    # stage 2: one backend, its programs built for the first prompt's shapes
    reports, backend, uncached = [], None, []
    for i, ((_, run_args, _), given) in enumerate(zip(jobs, encoded, strict=True)):
        r = stage2.resolve(run_args, given)
        loaded = None
        if backend is None:
            backend, loaded = stage2.open_backend(run_args, r)
        report = stage2.sample_and_write(run_args, r, backend, writer, loaded)
        reports.append(report)
        uncached.append(r.get("uncached_latents"))
        t, c = report["time"], report["compiles"]
        computed = sum(v["computed"] for v in report["branches"].values())
        calls = computed + sum(v["reused"] for v in report["branches"].values())
        _say(writer, f"[{i + 1}/{n}] stage 2 {t['stage_seconds']:.2f} s  computed "
                     f"{computed}/{calls} calls, speedup {report['speedup']['estimated'] or 0:.2f}x "
                     f"(ideal {report['speedup']['schedule_ideal']:.2f}x), compiles warm-up "
                     f"{_lowered(c['warmup'])} loop {_lowered(c['loop'])}")
    del backend
    gc.collect()

    # stage 3: one VAE for every prompt. The mp4 writer starts ffmpeg through subprocess, whose
    # fork is followed by exec at once; JAX's warning about forking a multithreaded process is
    # for forks that go on running Python
    warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
    videos, built = [], None
    for i, (_, _, folder) in enumerate(jobs):
        if not writer:
            break
        decode_args = copy.copy(stage3_args)
        decode_args.input_dir = folder
        r3 = stage3.resolve(decode_args)
        device = stage3._device(None, None)
        if built is None:
            built = stage3.build_vae(r3["pipe"], args.vae_path, r3["dtype"])
        also = None
        if uncached[i] is not None:  # --compare: the uncached video and a strip beside it
            also = Staged()
            cached = stage3.video_frames(built[0], r3["latents"].to(device), r3["pipe"])
            reference = stage3.video_frames(built[0], uncached[i].to(device), r3["pipe"])
            also.add_folder(folder, lambda tmp, c=cached, u=reference, fps=r3["fps"]:
                            _write_compare(tmp, c, u, fps), "--compare")
        try:
            if r3["backend"] == "jax":  # stage 3's default, as stage 2's
                out = stage3._run_jax(decode_args, r3, built, also)
            else:
                out = stage3._run(decode_args, r3, 0, 1, device, built, also)
        finally:
            if also is not None:
                also.discard()
        videos.append(os.path.join(folder, VIDEO))
        _say(writer, f"[{i + 1}/{n}] stage 3 {out['decode_seconds']:.2f} s  {videos[-1]}")
    return {"model": pipe.name, "prompts": [j[0].prompt for j in jobs], "videos": videos,
            "stage2": reports, "seconds": time.perf_counter() - began, "writer": writer}


UNCACHED_VIDEO = "output_video_uncached.mp4"
STRIP = "compare_strip.png"


def _write_compare(folder: str, cached, uncached, fps: float) -> None:
    """The uncached video, and a PNG of both: cached frames above, uncached below."""
    from PIL import Image
    encode_mp4(os.path.join(folder, UNCACHED_VIDEO), uncached, fps)
    rows = [np.concatenate(list(v), axis=1) for v in (cached, uncached)]
    gap = np.full((max(2, rows[0].shape[0] // 32), rows[0].shape[1], 3), 255, np.uint8)
    Image.fromarray(np.concatenate([rows[0], gap, rows[1]])).save(os.path.join(folder, STRIP))


def _lowered(counts) -> str:
    return "-" if counts is None else str(counts["lowered"])


def format_summary(report: dict) -> str:
    lines = [f"generate: {report['model']}  {len(report['prompts'])} prompt(s) in "
             f"{report['seconds']:.1f} s"]
    for prompt, video, r in zip(report["prompts"], report["videos"], report["stage2"],
                                strict=True):
        lines.append(f"  {video}  {prompt!r}  speedup {r['speedup']['estimated'] or 0:.2f}x "
                     f"(schedule ideal {r['speedup']['schedule_ideal']:.2f}x)")
    first, rest = report["stage2"][0], report["stage2"][1:]
    later = sum(r["compiles"]["warmup"]["lowered"] for r in rest if r["compiles"]["warmup"])
    loop = sum(r["compiles"]["loop"]["lowered"] for r in report["stage2"] if r["compiles"]["loop"])
    if first["compiles"]["warmup"] is not None:
        lines.append(f"compiles: first prompt {first['compiles']['warmup']['lowered']}, later "
                     f"prompts {later}, in the loops {loop}")
    return "\n".join(lines)


main = command(build_parser, run, format_summary, ERRORS, lambda report: report["writer"])

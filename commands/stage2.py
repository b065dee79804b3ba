"""Stage 2 of the pipeline as a command: flags, checks, sampling, stage files, summary.

Order of work, so that bad input never costs a compile and never leaves output behind:
resolve flags -> read and check stage-1 files (or encode the prompt in-process on a model with a
built-in text encoder, or synthesize them) -> load the model(s) ->
build the backend -> warm up (every program compiles here) -> the timed loop -> (the uncached
comparison) -> write stage2_latents.safetensors and generation_config.json atomically.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import time

import torch

from cache import CMConfig, ConfigError
from cache.flags import add_cache_arguments, config_from_args
from cache.telemetry import trace_csv
from encoders import EncoderInputError
from encoders.word_table import FOLDER as WORD_TABLE
from modules import ops
from modules.checkpoint import (
    CheckpointError,
    cast_model,
    load_model,
    model_fingerprint,
    open_checkpoint,
    reader_fingerprint,
)
from modules.layers import ModelConfigError
from modules.registry import build_model, family_of
from sampling import platforms, progress
from sampling.budget import BudgetError
from sampling.budget import choose as budget_choose
from sampling.budget import load as budget_load
from sampling.cli import CommandParser, UsageError, as_int, as_number, command
from sampling.clips import decode_inputs, decode_metadata, sample_clips
from sampling.fidelity import fidelity
from sampling.one_writer import one_writer
from sampling.pipelines import (
    DEFAULT_PIPELINE,
    DEFAULT_PROMPT,
    MAX_GUIDANCE,
    MAX_STEPS,
    MAX_TOKENS,
    PIPELINES,
    SizeError,
    get_pipeline,
)
from sampling.run import layer_ideal, make_sample, noise_for, sample_once
from sampling.schedulers import SOLVERS, SchedulerError
from sampling.sinks import (
    SinkUnavailable,
    format_histograms,
    histograms,
    plot_traces,
    require_pyplot,
    require_tensorboard,
    write_tensorboard,
)
from sampling.stage_io import (
    CONFIG,
    EMBEDDINGS,
    LATENTS,
    STAGE3_FIELDS,
    Staged,
    StageFileError,
    check_distinct,
    check_tensors,
    check_writable,
    check_writable_file,
    read_config,
    read_stage1,
    write_stage2,
)
from sampling.stages import SignalPlan, check_remodulate

from .stage1 import check as check_request
from .stage1 import encode as encode_request
from .stage1 import request_of

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_SEED = 42


class OutputError(RuntimeError):
    """Sampling finished with latents that are not finite: nothing is written."""


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:,.1f} GiB"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"


def _hidden_bytes(pipe, tokens: int) -> int:
    dim = getattr(pipe.config, "dim", None) or pipe.config.hidden_size
    return tokens * dim * 4


def _check_host_memory(r, backend, args) -> None:
    """On the host CPU, refuse a size whose attention would not fit in the memory there (JAX's
    CPU attention holds every score; torch's CPU kernels stream them), before any compile."""
    if backend.platform() != "cpu":
        return
    pipe = r["pipe"]
    tokens = pipe.tokens(r["latent_shape"])
    heads = pipe.config.num_heads
    batch = 2 if r["config"].cfg_mode == "fused" else 1
    scores = batch * heads * tokens ** 2 * 4 if args.backend == "jax" else 0
    need = scores + 12 * batch * _hidden_bytes(pipe, tokens)  # a block's working set
    free = _available_memory()
    if free is not None and need > free:
        h, w, f = r["size"]
        raise UsageError(f"--height {h} --width {w} --video_length {f}: {tokens:,} tokens need "
                         f"about {_gib(need)} on the host CPU ({_gib(scores)} of attention "
                         f"scores); this host has {_gib(free)} available: expected a smaller "
                         "size")


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_finite(latents, r, args) -> None:
    """Non-finite latents are an error, with what most likely caused them (weights were checked
    at load, stage-1 tensors and guidance when read)."""
    bad = int((~torch.isfinite(latents)).sum())
    if not bad:
        return
    causes = []
    guidance = r["guidance"] if r["guidance"] is not None else r["pipe"].guidance
    scales = guidance if isinstance(guidance, tuple) else (guidance,)
    if max(scales) > 20:
        causes.append(f"guidance {guidance} (usual: 1-10)")
    peak = max((float(t.abs().max()) for t in r["tensors"].values()
                if t.is_floating_point() and t.numel()), default=0.0)
    if peak > 1e3:
        causes.append(f"stage-1 values up to {peak:.3g} (encoders give ~1-1e3)")
    if r["dtype"] == torch.bfloat16:
        causes.append("bf16 overflow (try --dtype fp32)")
    if not causes:
        causes.append("the checkpoint or the sampler settings (steps, shift)")
    raise OutputError(f"sampling gave non-finite latents ({bad:,} of {latents.numel():,} values "
                      f"NaN or Inf); likely cause: {'; '.join(causes)}; nothing was written, and "
                      "files of earlier runs are as they were")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("stage files")
    g.add_argument("--input_dir", help=f"stage-1 folder ({EMBEDDINGS}, generation_config.json); "
                   "default: encode --prompt in-process (models with a built-in text encoder, "
                   "the default one), else synthesize stage-1 inputs from --seed")
    g.add_argument("--output_dir", help="where stage2_latents.safetensors goes (default: "
                   "--input_dir, else ./stage_outputs)")
    g = parser.add_argument_group("model and sampling (defaults: the model's, see --model)")
    g.add_argument("--model", help=f"named pipeline, one of {', '.join(PIPELINES)} (default: the "
                   f"input config's `model` or `transformer_version`, else {DEFAULT_PIPELINE}, "
                   "the tiny model trained here)")
    g.add_argument("--model_path", help="checkpoint (file or folder); Wan2.2 I2V-A14B: the folder "
                   "holding high_noise_model/ and low_noise_model/")
    g.add_argument("--dtype", choices=tuple(DTYPES), help="weights (default bf16 with --model_path, "
                   "else fp32)")
    g.add_argument("--video_length", type=int, help="frames, 4k + 1 (default: the model's)")
    g.add_argument("--height", type=int, help="pixels (default: the model's)")
    g.add_argument("--width", type=int, help="pixels (default: the model's)")
    g.add_argument("--num_inference_steps", type=int, help="denoising steps (default: the model's)")
    g.add_argument("--guidance_scale", help="CFG scale, 'low,high' for Wan2.2 I2V-A14B's experts "
                   "(default: the model's)")
    g.add_argument("--sample_solver", choices=SOLVERS)
    g.add_argument("--sample_shift", type=float)
    g.add_argument("--seed", type=int, help=f"noise (and synthetic inputs) seed (default: the "
                   f"input config's, else {DEFAULT_SEED})")
    g.add_argument("--num_clips", type=int, help="speech-to-video: clips to sample, each "
                   "--video_length frames (default: all the audio holds)")
    g = parser.add_argument_group("backend and compile")
    g.add_argument("--backend", choices=("jax", "torch"), default="jax",
                   help="jax (torchax programs; TPU, GPU, CPU) or torch (CUDA, Ascend NPU, CPU)")
    g.add_argument("--device", help="torch backend: cuda, npu or cpu (default: the first present)")
    g.add_argument("--torch_compile", action="store_true",
                   help="torch backend: torch.compile each stage (the gate stays outside)")
    g.add_argument("--offload_model", action="store_true",
                   help="torch backend: keep weights on the host until their expert runs; cached "
                        "residuals then live on the host too (unless --cache_offload says otherwise)")
    g.add_argument("--attention", help="ops.attention implementation while tracing (default: "
                   "splash on TPU, jax_dpa elsewhere)")
    g.add_argument("--warmup_steps", type=int, default=1,
                   help="warm-up rounds before the timed loop; each runs every program once "
                        "(default 1)")
    g.add_argument("--compile_cache_dir", default=None,
                   help="persistent JAX compilation cache: a folder, or a bucket URL (gs://...) "
                        "that every host of a slice shares (default "
                        "~/.cache/dit-feature-cache/jax; 'none' turns it off)")
    g = parser.add_argument_group("parallel")
    g.add_argument("--ulysses_size", "--sp_size", dest="sp_size", type=int, default=1,
                   help="sequence-parallel group size: devices (JAX) or processes (torchrun) "
                        "that split the tokens, Ulysses attention (default 1)")
    g.add_argument("--cfg_parallel", action="store_true",
                   help="cond and uncond on two device groups in one call (implies --cfg_mode "
                        "fused); uses 2 x sp_size devices")
    g.add_argument("--multihost", action="store_true",
                   help="one process per host of a multi-host slice: start jax.distributed first "
                        "(on Cloud TPU it finds the other hosts itself); process 0 writes")
    g.add_argument("--coordinator_address", help="--multihost off Cloud TPU: host:port of "
                   "process 0 (default: JAX_COORDINATOR_ADDRESS or the cluster's environment)")
    g.add_argument("--num_processes", type=int, help="--multihost off Cloud TPU: processes in "
                   "the job")
    g.add_argument("--process_id", type=int, help="--multihost off Cloud TPU: this process's "
                   "index, 0 to num_processes - 1")
    g.add_argument("--weight_sharding", choices=("replicated", "fsdp"),
                   help="JAX on a mesh: fsdp splits the block weights over the devices, each block "
                        "gathering its own as it runs; replicated keeps every weight on every "
                        "device (default: fsdp when sp_size x cfg > 1)")
    g = parser.add_argument_group("budgeted mode (a target instead of a technique and threshold)")
    g.add_argument("--budget_profile", help="profile written by `python -m commands.calibrate "
                   "--budget` for this model and step count")
    g.add_argument("--budget_rel_err", type=float, help="final-latent relative L2 error to stay "
                   "within: the configuration computing the least whose calibrated error bound "
                   "is within it")
    g.add_argument("--accept_profile", action="store_true", help="use a calibrated profile "
                   "(--budget_profile, --teacache_policy poly:FILE) although it was measured on "
                   "other weights")
    g.add_argument("--budget_speedup", type=float, help="block-evaluation reduction to reach: the "
                   "configuration with the least error bound among those that reach it")
    g = parser.add_argument_group("outputs and reports")
    g.add_argument("--telemetry_json", help="write the summary and per-call decision trace here")
    g.add_argument("--telemetry_csv", help="write the per-call decision trace here as CSV")
    g.add_argument("--tensorboard_dir", help="write per-step signals, decisions and the rel "
                   "histograms as TensorBoard events here (needs the tensorboard package)")
    g.add_argument("--plot_png", help="draw per-step rel, accumulator and reused steps here")
    g.add_argument("--compare", action="store_true",
                   help="also run uncached from the same inputs; report speedup and fidelity")
    g.add_argument("--no_progress", action="store_true", help="no progress bar")
    add_cache_arguments(parser)


# --help shows these (one screen); --help_all every flag
COMMON = {"input_dir", "output_dir", "model", "model_path", "video_length", "height", "width",
          "num_inference_steps", "guidance_scale", "seed", "enable_cache", "cache_type", "preset",
          "budget_profile", "budget_rel_err", "sp_size", "cfg_parallel", "multihost",
          "telemetry_json", "compare", "backend"}
SECTIONS = {"stage files": "inputs and model",
            "model and sampling (defaults: the model's, see --model)": "inputs and model",
            "budgeted mode (a target instead of a technique and threshold)": "caching"}


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        common=COMMON | {"prompt"}, sections=SECTIONS,
        description="Stage 2 (the denoising loop) of a video DiT with feature caching, on JAX "
                    "through torchax.")
    add_arguments(parser)
    # here, not in add_arguments: the prompt-to-video command has its own --prompt
    parser.add_argument_group("stage files").add_argument(
        "--prompt", help=f"without --input_dir, on a model with a built-in text encoder: what "
        f"the video shows, encoded in-process (default {DEFAULT_PROMPT!r})")
    return parser


# --- resolution of flags and inputs (no device work) -----------------------------------------

def _guidance(text, pipe, label: str = "--guidance_scale"):
    """None (the pipeline's), one scale, or (low, high) for the two experts of Wan2.2 I2V-A14B;
    each a finite number >= 0."""
    if text is None:
        return None
    if isinstance(text, list | tuple):  # a (low, high) pair read back from a config file
        text = ",".join(str(v) for v in text)
    want = f"a number in [0, {MAX_GUIDANCE:g}]" + (" or 'low,high'" if pipe.moe else "")
    try:
        values = tuple(float(v) for v in str(text).split(","))
    except ValueError:
        raise UsageError(f"{label} {text!r}: expected {want}") from None
    if len(values) not in ((1, 2) if pipe.moe else (1,)):
        raise UsageError(f"{label} {text!r}: expected {want}")
    for v in values:
        as_number(label, v, minimum=0.0, maximum=MAX_GUIDANCE, expected=want)
    return values if len(values) == 2 else values[0]


def _pipeline_name(args, stage1: dict) -> str:
    if args.model is not None:
        return args.model
    if "model" in stage1:
        return str(stage1["model"])
    if "transformer_version" in stage1:  # the HunyuanVideo-1.5 TPU port's stage 1
        return f"hunyuanvideo-1.5-{stage1['transformer_version']}"
    return DEFAULT_PIPELINE


def _pick(flag: str, value, stage1: dict, key: str, default, source: str | None):
    """(value, label) of a setting: the flag's if given, else the stage-1 config's, else the
    default. Only None means "not given": a 0 is a value, checked like any other."""
    if value is not None:
        return value, flag
    if stage1.get(key) is not None:
        return stage1[key], f"{source}: {key}"
    return default, f"{flag} (default)"


def _check_flags(args) -> None:
    """The flags whose valid range does not depend on the model or the inputs."""
    as_int("--ulysses_size/--sp_size", args.sp_size, minimum=1)
    as_int("--warmup_steps", args.warmup_steps, minimum=0)
    if args.budget_rel_err is not None:
        as_number("--budget_rel_err", args.budget_rel_err, above=0.0)
    if args.budget_speedup is not None:
        as_number("--budget_speedup", args.budget_speedup, minimum=1.0,
                  expected="a finite number >= 1 (computed calls divided by this)")
    if args.budget_rel_err is not None and args.budget_speedup is not None:
        raise UsageError("--budget_rel_err and --budget_speedup are alternatives; give one")
    targeted = args.budget_rel_err is not None or args.budget_speedup is not None
    if targeted != (args.budget_profile is not None):
        raise UsageError("--budget_rel_err/--budget_speedup and --budget_profile go together: "
                         "the profile holds the calibration the target is met from"
                         if targeted else "--budget_profile needs a target: --budget_rel_err "
                         "or --budget_speedup")
    if targeted:
        chosen_by = [flag for flag, on in (
            ("--preset", args.preset), ("--enable_cache", args.enable_cache),
            ("--teacache", args.teacache), ("--fbcache", args.fbcache),
            ("--deepcache", args.deepcache), ("--magcache", args.magcache)) if on]
        if chosen_by:
            raise UsageError(f"budgeted mode chooses the technique; drop {', '.join(chosen_by)} "
                             "(or drop the budget)")
    if args.backend != "torch" and (args.torch_compile or args.offload_model or args.device):
        raise UsageError("--device, --torch_compile and --offload_model belong to --backend torch")
    if args.backend == "torch" and args.torch_compile and (args.sp_size > 1 or args.cfg_parallel):
        raise UsageError("--torch_compile does not combine with --sp_size > 1 or --cfg_parallel "
                         "(the parallel stages run eagerly)")
    if args.weight_sharding is not None and args.backend != "jax":
        raise UsageError("--weight_sharding places the JAX backend's weights; the torch backend "
                         "keeps them whole on every rank")
    if args.weight_sharding == "fsdp" and args.sp_size == 1 and not args.cfg_parallel:
        raise UsageError("--weight_sharding fsdp splits the weights over a mesh of several "
                         "devices; give --sp_size > 1 or --cfg_parallel")
    if not args.multihost and any(v is not None for v in (args.coordinator_address,
                                                          args.num_processes, args.process_id)):
        raise UsageError("--coordinator_address, --num_processes and --process_id belong to "
                         "--multihost")
    if args.multihost and args.backend != "jax":
        raise UsageError("--multihost starts JAX's distributed runtime; the torch backend runs "
                         "several processes under torchrun instead")
    if args.num_processes is not None:
        as_int("--num_processes", args.num_processes, minimum=1)
    if args.process_id is not None:
        as_int("--process_id", args.process_id, minimum=0,
               maximum=(args.num_processes - 1) if args.num_processes else None)
    if args.input_dir is not None and getattr(args, "prompt", None) is not None:
        raise UsageError("--prompt and --input_dir are alternatives: the stage-1 folder holds "
                         "its prompt's embeddings; give one")
    for flag in ("input_dir", "output_dir", "model_path", "compile_cache_dir", "budget_profile"):
        if getattr(args, flag) == "":
            raise UsageError(f"--{flag} '': expected a path")
    platforms.check_backend(args.backend, device=args.device, attention=args.attention,
                            multihost=args.multihost)


def _check_launch(args) -> None:
    """A torchrun world must fit the flags: only the torch backend runs as several processes,
    and then as exactly sp x cfg ranks. Checked on every rank alike (rank 0 says so)."""
    world = as_int("WORLD_SIZE (set by torchrun)", os.environ.get("WORLD_SIZE", "1"), minimum=1)
    if args.backend != "torch":
        if world > 1:
            raise UsageError(f"launched as {world} processes (torchrun), but --backend "
                             f"{args.backend} runs as one process per host (its devices split "
                             "the tokens with --sp_size; several hosts: --multihost); add "
                             "--backend torch, or run one process")
        return
    cfg = 2 if args.cfg_parallel else 1
    if world != args.sp_size * cfg:
        raise UsageError(
            f"{world} process(es) were launched, but --sp_size {args.sp_size}"
            f"{' x --cfg_parallel 2' if args.cfg_parallel else ''} needs {args.sp_size * cfg}: "
            f"run `torchrun --nproc_per_node {args.sp_size * cfg} ...` or change "
            "--sp_size/--cfg_parallel")


def _check_blocks(config: CMConfig, pipe, args) -> None:
    """Probe and tail blocks must fit in the model (a preset's bn_blocks included)."""
    blocks = pipe.config.num_layers
    fn, bn = config.probe_blocks, config.tail_blocks
    if config.enabled and fn + bn > blocks:
        given = [f"--{f} {getattr(args, f)}" for f in ("fn_blocks", "bn_blocks")
                 if getattr(args, f) is not None]
        source = " ".join(given) or (f"--preset {args.preset}" if args.preset else "the defaults")
        raise UsageError(f"{source}: probe blocks ({fn}) + tail blocks ({bn}) exceed the "
                         f"{pipe.name} model's {blocks} blocks; expected fn + bn <= {blocks}")
    if config.enabled and config.remodulate:
        try:
            check_remodulate(family_of(pipe.config).model_cls)
        except ValueError as exc:
            raise UsageError(f"{pipe.name}: {exc}") from None


def _budgeted(args, pipe) -> tuple[CMConfig, dict]:
    """The configuration budgeted mode picks from the profile for the target (uncached when
    nothing calibrated promises it), and what it promised."""
    try:
        calibrated = budget_load(args.budget_profile)
        choice = budget_choose(calibrated, rel_err=args.budget_rel_err,
                               speedup=args.budget_speedup)
    except BudgetError as exc:
        raise UsageError(str(exc)) from None
    if calibrated["model"] != pipe.name:
        raise UsageError(f"--budget_profile {args.budget_profile} was calibrated for "
                         f"{calibrated['model']}; this run is {pipe.name}: calibrate it for "
                         f"{pipe.name}")
    config = config_from_args(args, choice.fields if choice is not None else {})
    chosen = (dict.fromkeys(("choice", "config", "bound_rel_err", "predicted_computed_fraction"))
              if choice is None else
              {"choice": choice.label, "config": choice.fields, "bound_rel_err": choice.bound,
               "predicted_computed_fraction": choice.computed})
    return config, {"rel_err": args.budget_rel_err, "speedup": args.budget_speedup, **chosen,
                    "calibrated_steps": calibrated["steps"],
                    "calibrated_seeds": calibrated["seeds"]}


def resolve(args, given: tuple[dict, dict] | None = None) -> dict:
    """Everything the run needs, checked, before any model or device work. `given`: stage-1
    (tensors, config) made in this process (the prompt-to-video command), read as a stage-1
    folder's would be."""
    _check_flags(args)
    _check_launch(args)
    stage1, source = {}, None
    if given is not None:
        stage1, source = dict(given[1]), "stage 1"
    elif args.input_dir is not None:
        if not os.path.isdir(args.input_dir):
            raise StageFileError(f"--input_dir {args.input_dir} is not a directory")
        stage1 = read_config(args.input_dir)
        source = os.path.join(args.input_dir, CONFIG)
    name = _pipeline_name(args, stage1)
    if name not in PIPELINES:
        raise UsageError(f"unknown model {name!r}" + ("" if args.model else " (from the input "
                         "config)") + f"; expected one of {', '.join(PIPELINES)}")
    pipe = get_pipeline(name)
    config, budget = _budgeted(args, pipe) if args.budget_profile else (config_from_args(args),
                                                                      None)
    if args.offload_model and args.cache_offload is None:
        # Seed 000: with the model offloaded, residuals wait on the host and move on use.
        config = dataclasses.replace(config, offload="cpu")
    if args.cfg_parallel:
        if args.cfg_mode not in (None, "fused"):
            raise UsageError(f"--cfg_parallel runs cond and uncond as one fused call; it cannot "
                             f"run with --cfg_mode {args.cfg_mode}")
        config = dataclasses.replace(config, cfg_mode="fused")
    if pipe.task == "s2v" and args.backend == "torch" and (args.sp_size > 1 or args.cfg_parallel):
        # each rank holds a shard of the tokens, and the audio injection regroups all the noisy
        # tokens by frame; the JAX backend's global-view programs run it (--backend jax)
        raise UsageError(f"--model {pipe.name} runs sequence/CFG parallel on the JAX backend only; "
                         "drop --backend torch or --sp_size/--cfg_parallel")
    _check_blocks(config, pipe, args)
    value, label = _pick("--num_inference_steps", args.num_inference_steps, stage1,
                         "num_inference_steps", pipe.steps, source)
    steps = as_int(label, value, minimum=1, maximum=MAX_STEPS)
    shift = as_number("--sample_shift", args.sample_shift if args.sample_shift is not None
                      else pipe.shift, above=0.0, expected="a finite number > 0 (1.0 = no shift)")
    if budget is not None and budget["calibrated_steps"] != steps:
        raise UsageError(f"--budget_profile {args.budget_profile} was calibrated at "
                         f"{budget['calibrated_steps']} steps and the error a schedule makes "
                         f"depends on it; this run has {steps}: run at "
                         f"{budget['calibrated_steps']} or calibrate at {steps}")
    if args.model_path is None and pipe.builtin is None:
        builtin = ", ".join(n for n, p in PIPELINES.items() if p.builtin is not None)
        raise UsageError(f"--model {pipe.name} has no built-in weights; give --model_path "
                         f"(or pick a model with built-in weights: {builtin})")
    prompt, encoder = _prompt(args, pipe, given)
    if args.num_clips is not None and pipe.task != "s2v":
        raise UsageError(f"--num_clips belongs to speech-to-video models; {pipe.name} samples one "
                         "clip")
    value, label = _pick("--guidance_scale", args.guidance_scale, stage1, "guidance_scale", None,
                         source)
    guidance = _guidance(value, pipe, label)
    value, label = _pick("--seed", args.seed, stage1, "seed", DEFAULT_SEED, source)
    seed = as_int(label, value, minimum=-2 ** 63, maximum=2 ** 64 - 1)
    size, labels = [], {}
    for key, default in zip(("height", "width", "video_length"), pipe.size, strict=True):
        value, labels[key] = _pick(f"--{key}", getattr(args, key), stage1, key, default, source)
        size.append(as_int(labels[key], value, minimum=1, expected=f"a positive {key}"))
    try:
        latent_shape = pipe.latent_shape(*size)
    except SizeError as exc:
        raise UsageError(f"{labels[exc.name]} {exc.value}: expected {exc.expected}") from None
    tokens = pipe.tokens(latent_shape)
    if tokens > MAX_TOKENS:
        raise UsageError(
            f"{labels['height']} {size[0]}, {labels['width']} {size[1]}, {labels['video_length']} "
            f"{size[2]}: {tokens:,} tokens per model call ({_gib(_hidden_bytes(pipe, tokens))} "
            f"for one hidden state of the {pipe.name} model); expected at most {MAX_TOKENS:,} "
            "(9x HunyuanVideo-1.5 720p)")
    g_values = [pipe.guidance_for(e, guidance) for e, _ in pipe.experts]
    cfg_on = any(g != 1.0 for g in g_values)
    if config.cfg_mode == "fused" and 1.0 in g_values:
        raise UsageError(f"--{'cfg_parallel' if args.cfg_parallel else 'cfg_mode fused'} batches "
                         "cond and uncond in one call; it needs CFG "
                         f"(guidance != 1) for every expert, got guidance {g_values}")
    output_dir = _check_outputs(args)
    if given is not None:
        image = pipe.task == "i2v" or (pipe.task == "ti2v" and "image_latents" in given[0])
        tensors = given[0]
        check_tensors(tensors, pipe.stage1_specs(latent_shape, cfg_on, image), source)
    elif args.input_dir is not None:
        image = pipe.task == "i2v" or (pipe.task == "ti2v" and _has_image(args.input_dir))
        tensors, stage1 = read_stage1(args.input_dir, pipe.stage1_specs(latent_shape, cfg_on, image))
    elif prompt is not None:
        image = False
        tensors, stage1_fields = _encode_prompt(pipe, prompt, encoder, size)
        check_tensors(tensors, pipe.stage1_specs(latent_shape, cfg_on, image), "--prompt")
        stage1 = stage1_fields  # recorded as a stage-1 folder's config would be (the prompt)
    else:
        image = pipe.task == "i2v"
        tensors = pipe.synthesize(latent_shape, cfg_on, image, seed)
    clips = None
    if pipe.task == "s2v":
        try:
            available = pipe.clip_count(tensors, latent_shape)
        except ValueError as exc:
            raise StageFileError(str(exc)) from None
        value, label = _pick("--num_clips", args.num_clips, stage1, "num_clips", available, source)
        clips = as_int(label, value, minimum=1, maximum=available,
                       expected=f"1 to {available} (the audio holds {available} clips of "
                                f"{latent_shape[2] * pipe.vae_stride[0]} frames)")
    dtype = DTYPES[args.dtype or ("bf16" if args.model_path else "fp32")]
    return dict(pipe=pipe, config=config, steps=steps, seed=seed, budget=budget, shift=shift,
                guidance=guidance,
                solver=args.sample_solver or pipe.solver, latent_shape=latent_shape,
                size=tuple(size), tensors=tensors, stage1=stage1,
                image=image, output_dir=output_dir, dtype=dtype, clips=clips, prompt=prompt,
                synthetic=given is None and args.input_dir is None and prompt is None)


def _prompt(args, pipe, given) -> tuple[str | None, str | None]:
    """(prompt, encoder weights) stage 2 encodes itself: without stage-1 inputs, on a model whose
    text encoder is built in (the trained tiny models; with --model_path, the checkpoint's own).
    (None, None): the inputs come from elsewhere, or are synthesized from --seed."""
    if given is not None or args.input_dir is not None:
        return None, None
    if pipe.encoders is None:
        return None, None
    weights = args.model_path
    if weights is not None and not os.path.isdir(os.path.join(weights, WORD_TABLE)):
        return None, None
    prompt = getattr(args, "prompt", None)
    return (DEFAULT_PROMPT if prompt is None else prompt), weights


def _encode_prompt(pipe, prompt: str, weights, size) -> tuple[dict, dict]:
    """(stage-1 tensors, config fields) of `prompt`, as stage 1 encodes them (the model's text
    encoder, on the host)."""
    height, width, frames = size
    request = request_of(argparse.Namespace(
        negative_prompt=None, image=None, audio=None, height=height, width=width,
        video_length=frames, num_clips=None), prompt)
    try:
        check_request(pipe, request, weights)
        tensors, _, fields = encode_request(pipe, request, weights, "cpu")
    except EncoderInputError as exc:
        raise UsageError(str(exc)) from None
    return tensors, fields


def check_prompt_used(args, r) -> None:
    """Stage 2's own --prompt on a model it cannot encode prompts for is refused, not ignored."""
    if getattr(args, "prompt", None) is not None and r["prompt"] is None:
        raise UsageError(f"--prompt: stage 2 holds no text encoder for {r['pipe'].name} and "
                         "synthesizes its inputs from --seed; encode the prompt with "
                         "stage1_encode.py and pass --input_dir, or drop --prompt")


def _check_outputs(args) -> str:
    """Every path the run will write, checked before any work: the output folder (and that no
    folder holds a file name it writes), the report files, the optional sinks' packages and the
    compilation cache. Returns the output folder."""
    output_dir = next(d for d in (args.output_dir, args.input_dir, "stage_outputs") if d is not None)
    check_writable(output_dir, "--output_dir", (LATENTS, CONFIG))
    for flag in ("telemetry_json", "telemetry_csv", "plot_png"):
        check_writable_file(f"--{flag}", getattr(args, flag))
    policy = getattr(args, "teacache_policy", None) or ""
    inputs = {"--model_path": args.model_path, "--budget_profile": args.budget_profile,
              "--teacache_policy": policy.removeprefix("poly:")
              if policy.startswith("poly:") and policy.endswith(".json") else None}
    if args.input_dir is not None:
        inputs[f"--input_dir {EMBEDDINGS}"] = os.path.join(args.input_dir, EMBEDDINGS)
        if os.path.realpath(args.input_dir) != os.path.realpath(output_dir):
            # (in one folder, the config is read and then replaced, by design)
            inputs[f"--input_dir {CONFIG}"] = os.path.join(args.input_dir, CONFIG)
    outputs = {f"its {LATENTS} (--output_dir)": os.path.join(output_dir, LATENTS),
               f"its {CONFIG} (--output_dir)": os.path.join(output_dir, CONFIG),
               **{f"--{flag}": getattr(args, flag)
                  for flag in ("telemetry_json", "telemetry_csv", "plot_png")}}
    check_distinct(outputs, inputs)
    if args.tensorboard_dir is not None:
        check_writable(args.tensorboard_dir, "--tensorboard_dir")
        require_tensorboard()
    if args.plot_png is not None:
        require_pyplot()
    if args.backend == "jax":
        cache_dir = args.compile_cache_dir
        if cache_dir is None:
            from tpu.compile import DEFAULT_CACHE_DIR
            cache_dir = DEFAULT_CACHE_DIR
        from tpu.compile import check_remote, is_remote
        if is_remote(cache_dir):  # a bucket: JAX reaches it itself, if it can
            problem = check_remote(cache_dir)
            if problem is not None:
                raise UsageError(f"--compile_cache_dir {problem}")
        elif cache_dir.lower() != "none":
            check_writable(cache_dir, "--compile_cache_dir",
                           hint=" (or 'none' to run without the persistent compilation cache)")
    return output_dir


def _has_image(directory):
    from safetensors import safe_open
    try:
        with safe_open(os.path.join(directory, EMBEDDINGS), "pt") as f:
            return "image_latents" in f.keys()
    except Exception:  # noqa: BLE001 - read_stage1 reports the unreadable file properly
        return False


def _expert_path(pipe, model_path, expert) -> str:
    sub = pipe.checkpoint_dirs.get(expert)
    return os.path.join(model_path, sub) if sub else model_path


def load_models(pipe, model_path, dtype, seed: int = 0) -> dict:
    """expert -> model: from the checkpoint(s), or tiny random weights drawn from a fixed seed."""
    models = {}
    if model_path is None and pipe.builtin_path is not None:
        model_path = pipe.builtin_path
    for i, (expert, name) in enumerate(pipe.experts):
        if model_path is None:
            torch.manual_seed(seed + i)
            models[expert] = cast_model(build_model(name), dtype)
        else:
            models[expert], _ = load_model(_expert_path(pipe, model_path, expert), name, dtype=dtype)
    return models


def open_models(pipe, model_path, dtype) -> dict:
    """expert -> (model on the meta device, reader of its checkpoint): every check of a load
    (headers, keys, shapes) now, the weights later, read by the JAX backend a slice at a time
    (each host only the rows its devices keep)."""
    opened = {}
    try:
        for expert, name in pipe.experts:
            model, reader, _ = open_checkpoint(_expert_path(pipe, model_path, expert), name,
                                               dtype=dtype)
            opened[expert] = (model, reader)
    except BaseException:
        for _, reader in opened.values():
            reader.close()
        raise
    return opened


# --- the run ------------------------------------------------------------------------------------

def _cache_metadata(config: CMConfig) -> dict:
    dc = config.deepcache
    out = {"cache_enabled": config.enabled, "cache_modes": list(config.modes),
           "deepcache_enabled": dc is not None}
    if dc is not None:
        out.update(cache_start_step=dc.start, cache_end_step=dc.end, cache_step_interval=dc.interval)
    return out


def _torch_device(name):
    if name:
        return name
    if torch.cuda.is_available():
        return "cuda"
    npu = getattr(torch, "npu", None)
    return "npu" if npu is not None and npu.is_available() else "cpu"


def torch_parallel(args):
    """This rank's layout when run under torchrun with --sp_size/--cfg_parallel (torch backend);
    None for one process. A world that is not sp x cfg ranks stops here, before any loading."""
    if args.backend != "torch":
        return None
    from sharding.torch_sp import init_torch_parallel
    try:
        return init_torch_parallel(args.sp_size, args.cfg_parallel, device=args.device)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def backend_writer(args) -> bool:
    """Whether this process writes and prints: all but process 0 of a multi-host job stay quiet."""
    if not args.multihost:
        return True
    from tpu.distributed import is_writer
    return is_writer()


def make_backend(args, models, plan, layout=None, checkpoints=None):
    """The backend the flags ask for. The torch path never imports torchax: torchax renames
    torch's private device to 'jax', which breaks torch.compile in the same process.
    checkpoints (JAX): expert -> reader its weights are read from (`open_models`)."""
    if args.backend == "torch":
        from torch_backend.backend import TorchBackend
        if args.attention:
            ops.select(attention=args.attention)
        device = layout.device if layout is not None else _torch_device(args.device)
        return TorchBackend(models, plan, device, compile=args.torch_compile,
                            offload_model=args.offload_model, layout=layout)
    from tpu.backend import JaxBackend
    from tpu.compile import DEFAULT_CACHE_DIR, enable_compile_cache
    cache_dir = args.compile_cache_dir if args.compile_cache_dir is not None else DEFAULT_CACHE_DIR
    enable_compile_cache(None if cache_dir.lower() == "none" else cache_dir)
    mesh = None
    if args.sp_size > 1 or args.cfg_parallel or args.multihost:

        from sharding.jax_sp import make_mesh
        try:
            mesh = make_mesh(args.sp_size, 2 if args.cfg_parallel else 1)
        except ValueError as exc:
            raise UsageError(f"--sp_size {args.sp_size}"
                             f"{' --cfg_parallel' if args.cfg_parallel else ''}: {exc}") from None
    return JaxBackend(models, plan, attention_impl=args.attention, mesh=mesh,
                      weights=args.weight_sharding, checkpoints=checkpoints)


def run(args) -> dict:
    """The whole stage; returns the report printed and written as telemetry. Under torchrun
    every rank samples (the collectives need them all) and only rank 0 writes and prints."""
    r = resolve(args)
    check_prompt_used(args, r)
    if args.multihost:  # before anything touches JAX (importing the backend does)
        from tpu.distributed import initialize
        initialize(args.coordinator_address, args.num_processes, args.process_id)
    layout = torch_parallel(args)
    try:
        return _run(args, r, layout)
    finally:
        if layout is not None:
            from sharding.torch_sp import close_torch_parallel
            close_torch_parallel()


def _run(args, r, layout) -> dict:
    writer = layout.rank == 0 if layout is not None else backend_writer(args)
    # the writer holds the output folder for the run: a second run into it is refused up front
    with one_writer(r["output_dir"]) if writer else contextlib.nullcontext():
        backend, loaded = open_backend(args, r, layout)
        return sample_and_write(args, r, backend, writer, loaded)


def open_backend(args, r, layout=None):
    """(backend, what loading read or None): the models of `r`'s pipeline on the backend the
    flags ask for, with `r`'s programs' plan; one backend serves every run of the same pipeline
    and cache flags."""
    backend, loaded = _load(args, r, SignalPlan.from_config(r["config"]), layout)
    _check_host_memory(r, backend, args)
    return backend, loaded


def _profile_files(args, config: CMConfig) -> list[tuple[str, str]]:
    """(flag, path) of every calibrated profile file this run uses."""
    files = [("--budget_profile", args.budget_profile)] if args.budget_profile else []
    tc = config.teacache
    if tc is not None and tc.policy.startswith("poly:") and tc.policy.endswith(".json"):
        files.append(("--teacache_policy", tc.policy.removeprefix("poly:")))
    if config.magcache is not None and config.magcache.profile is not None:
        files.append(("--magcache_profile", config.magcache.profile))
    return files


def check_profile_weights(args, r, fingerprints_of) -> list[str]:
    """Refuse a calibrated profile measured on other weights than these (unless
    --accept_profile); warnings for a profile that records none (written before it did).
    `fingerprints_of()` -> expert -> fingerprint, asked only when a profile file is in use."""
    files = _profile_files(args, r["config"])
    if not files:
        return []
    notes = []
    # as a profile holds them (JSON keys: expert None -> "null")
    fingerprints = json.loads(json.dumps(fingerprints_of()))
    for flag, path in files:
        try:
            with open(path) as fh:
                recorded = json.load(fh).get("weights_fingerprint")
        except (OSError, ValueError, AttributeError):
            continue  # the profile's own loader has said what is wrong with it
        if recorded is None:
            notes.append(f"{flag} {path} records no weights fingerprint (calibrated before "
                         "profiles did); it is used as if measured on these weights")
        elif recorded != fingerprints and not args.accept_profile:
            raise UsageError(f"{flag} {path} was calibrated on other weights (fingerprint "
                             f"{recorded}, these are {fingerprints}); calibrate on these weights, "
                             "or pass --accept_profile to use it anyway")
        elif recorded != fingerprints:
            notes.append(f"{flag} {path} was calibrated on other weights; used as asked "
                         "(--accept_profile)")
    return notes


def sample_and_write(args, r, backend, writer: bool, loaded: dict | None = None) -> dict:
    """One resolved run on an open backend: sample (and the uncached comparison), check, report
    (with `loaded`, what opening the backend read), write (the writer only)."""
    pipe, config, plan = r["pipe"], r["config"], backend.plan
    sample = None  # speech-to-video builds its samples clip by clip
    if pipe.task != "s2v":
        sample = make_sample(backend, pipe, r["tensors"], r["latent_shape"], image=r["image"],
                             seed=r["seed"], guidance=r["guidance"],
                             fused_cfg=config.cfg_mode == "fused")
    began = time.perf_counter()
    # one bar over every step of every clip (speech-to-video samples its clips one by one)
    bar = progress.steps(r["steps"] * (r["clips"] if sample is None else 1)) \
        if writer and not args.no_progress else None
    try:
        latents, traj, noise = _sample(backend, config, r, sample, progress=bar,
                                       warmup_rounds=args.warmup_steps)
    finally:
        if bar is not None:
            bar.close()
    _check_finite(latents, r, args)
    report = _report(r, traj, backend, plan, args, time.perf_counter() - began)
    if args.compare:
        # caching off, same CFG pairing (a fused sample is called as one pair)
        reference, base, _ = _sample(backend, CMConfig(cfg_mode=config.cfg_mode), r, sample,
                                     warmup_rounds=0)
        report["compare"] = {
            "uncached_loop_seconds": base.stats.wall_seconds,
            "speedup": base.stats.wall_seconds / traj.stats.wall_seconds,
            "loop_compiles_uncached": _counts(base.loop_compiles),
            **fidelity(latents, reference, noise),
        }
        r["uncached_latents"] = reference  # for a caller that decodes both (generate --compare)
    report["warnings"] += speedup_remarks(report)
    if loaded is not None:
        report["load"] = loaded
    report["writer"] = writer
    if writer:
        _write(r, latents, report, args)
    return report


def _load(args, r, plan, layout):
    """(backend, what loading read or None). The JAX backend reads a checkpoint slice by slice
    as it places the weights (each host its own devices' rows); the torch backend, and the JAX
    backend's tiny random models, take whole models built first."""
    pipe = r["pipe"]
    if args.backend != "jax" or args.model_path is None:
        models = load_models(pipe, args.model_path, r["dtype"])
        r["warnings"] = check_profile_weights(
            args, r, lambda: {e: model_fingerprint(m) for e, m in models.items()})
        return make_backend(args, models, plan, layout), None
    began = time.perf_counter()
    opened = open_models(pipe, args.model_path, r["dtype"])
    opening = time.perf_counter() - began
    readers = {expert: reader for expert, (_, reader) in opened.items()}
    try:
        r["warnings"] = check_profile_weights(  # before any weight is placed
            args, r, lambda: {e: reader_fingerprint(m, rd) for e, (m, rd) in opened.items()})
        backend = make_backend(args, {e: model for e, (model, _) in opened.items()}, plan, layout,
                               checkpoints=readers)
    finally:
        for reader in readers.values():
            reader.close()
    return backend, {"seconds": opening + backend.placement_seconds,
                     "bytes_read": sum(c.bytes_read for c in readers.values()),
                     "checkpoint_bytes": sum(c.checkpoint_bytes for c in readers.values())}


def _sample(backend, config, r, sample, *, progress=None, warmup_rounds=1):
    """(host latents, trajectory, host initial noise) of one run of `sample`; speech-to-video
    (sample None) samples its clips one after another, their trajectories read as one."""
    pipe = r["pipe"]
    common = dict(solver=r["solver"], steps=r["steps"], shift=r["shift"], progress=progress,
                  warmup_rounds=warmup_rounds)
    if sample is None:
        clips = sample_clips(backend, config, pipe, r["tensors"], r["latent_shape"], seed=r["seed"],
                             guidance=r["guidance"], fused_cfg=config.cfg_mode == "fused",
                             clips=r["clips"], **common)
        noise = torch.cat([noise_for(r["latent_shape"], r["seed"] + c) for c in range(r["clips"])],
                          dim=2)
        return clips.latents, clips.merged(), noise
    traj = sample_once(backend, config, sample, **common)
    return backend.get(traj.latents), traj, backend.get(sample.noise)


def _counts(c):
    return None if c is None else {"lowered": c.lowered, "backend": c.backend, "cache_hits": c.cache_hits}


def estimate_speedup(step_seconds, step_computed, loop_seconds) -> float | None:
    """The loop's speedup over running every step as a computed one: steps x the median computed
    step over the loop's wall time (speech-to-video: every clip's steps over every clip's loop).
    The median, not the mean: one slow computed step (a stall of the host) would otherwise count
    once in the loop's time but steps / computed times over in the uncached estimate."""
    full = [s for s, c in zip(step_seconds, step_computed, strict=True) if c]
    if not full or loop_seconds <= 0:
        return None
    return median(full) * len(step_seconds) / loop_seconds


def _report(r, traj, backend, plan, args, seconds) -> dict:
    stats, gate = traj.stats, traj.gate
    full = [s for s, c in zip(stats.step_seconds, stats.step_computed, strict=True) if c]
    cached = [s for s, c in zip(stats.step_seconds, stats.step_computed, strict=True) if not c]
    summary = gate.summary()
    blocks = backend.template.num_blocks
    return {
        "model": r["pipe"].name, "steps": r["steps"], "solver": r["solver"], "shift": r["shift"],
        "guidance": r["guidance"] if r["guidance"] is not None else r["pipe"].guidance,
        "latent_shape": list(r["latent_shape"]), "tokens": r["pipe"].tokens(r["latent_shape"]),
        "num_clips": r["clips"],
        # where the stage-1 inputs came from: this prompt encoded here, synthetic, or given
        "prompt": r.get("prompt"), "synthetic_inputs": r.get("synthetic", False),
        "attention": backend.attention, "device": backend.device_name(), "backend": args.backend,
        "cache": {"modes": list(gate.config.modes), "preset": args.preset,
                  "probe_blocks": plan.fn_blocks,
                  "tail_blocks": plan.bn_blocks, "reuse_tail_blocks": plan.reuse_tail_blocks,
                  "config": gate.config.to_dict()},
        "branches": {b: {"computed": s["total"] - s["skipped"], "reused": s["skipped"]}
                     for b, s in summary["branches"].items()},
        "experts": {e: {b: {"computed": s["total"] - s["skipped"], "reused": s["skipped"]}
                        for b, s in br.items()} for e, br in summary.get("experts", {}).items()},
        "failsafes": {k: v for k, v in summary["failsafes"].items() if v},
        "compiles": {"warmup": _counts(traj.warmup_compiles), "loop": _counts(traj.loop_compiles),
                     "warmup_seconds": traj.warmup_seconds},
        "time": {"loop_seconds": stats.wall_seconds, "full_step_seconds": median(full),
                 "cached_step_seconds": median(cached), "full_steps": len(full),
                 "cached_steps": len(cached), "signal_reads": stats.signal_reads,
                 "stage_seconds": seconds,
                 # what the estimate is computed from (every clip's steps, one after another)
                 "step_seconds": list(stats.step_seconds),
                 "step_computed": list(stats.step_computed)},
        "speedup": {
            "schedule_ideal": layer_ideal(blocks, len(full), len(cached), plan.fn_blocks,
                                          plan.reuse_tail_blocks),
            # what the ideal counts a reused step as: its blocks (probe, tail, head as one) of
            # a computed step's
            "reused_step_share": (plan.fn_blocks + plan.reuse_tail_blocks + 1) / (blocks + 1),
            "estimated": estimate_speedup(stats.step_seconds, stats.step_computed,
                                          stats.wall_seconds),
        },
        "budget": r["budget"],
        "clips": summary.get("clips"),  # speech-to-video: computed/reused per clip and branch
        "warnings": r.get("warnings", []) + profile_warnings(gate.config, summary,
                                                             gate.telemetry.trace),
        "summary": summary,
        "histograms": histograms(gate.telemetry.trace, r["steps"]),
        "trace": gate.telemetry.trace,  # per model call: step, branch, expert, action, signals
    }


NOISE = 0.15  # a speedup off its schedule ideal by more than this has its cause stated


def speedup_remarks(report: dict) -> list[str]:
    """Why a speedup is off what the schedule allows: the estimate when it is more than NOISE
    above or below the ideal, and a --compare run's measured speedup when it is below 1 or more
    than NOISE above the ideal (a cached run cannot save more than the blocks it skips)."""
    remarks = _estimate_remarks(report)
    if "compare" not in report:
        return remarks
    t, ideal = report["time"], report["speedup"]["schedule_ideal"]
    measured = report["compare"]["speedup"]
    steps = t["full_steps"] + t["cached_steps"]
    uncached_step = report["compare"]["uncached_loop_seconds"] / steps
    if measured < 1:
        cached = t["cached_step_seconds"]
        cost = (f"a reused step took {_ms(cached)} against {_ms(t['full_step_seconds'])} for a "
                f"computed one" if cached is not None else "no step was reused")
        return remarks + [
            f"measured speedup {measured:.2f}x is below 1, slower than uncached: {cost}, and "
            f"{t['cached_steps']} of {steps} steps were reused (schedule ideal {ideal:.2f}x); "
            "the probe, signal reads and tail that every step runs outweigh the skipped "
            "blocks here (small models, busy hosts); reuse more (a larger --budget_speedup "
            "or threshold) or run uncached"]
    if measured > ideal * (1 + NOISE):
        return remarks + [
            f"measured speedup {measured:.2f}x is above the schedule ideal {ideal:.2f}x, "
            f"which bounds what skipping blocks can save: the uncached run's steps took "
            f"{_ms(uncached_step)} on average against {_ms(t['full_step_seconds'])} for the "
            "cached run's computed ones, so the host's speed changed between the runs "
            "(timing noise); trust the ideal and the estimate"]
    return remarks


def _estimate_remarks(report: dict) -> list[str]:
    """The estimate's cause when it is more than NOISE off the schedule ideal, from the run's
    recorded step times: loop compiles, the cost of a reused step against what the ideal counts
    for it, or steps whose times spread (the host's speed changed during the loop)."""
    t, s = report["time"], report["speedup"]
    est, ideal, share = s.get("estimated"), s["schedule_ideal"], s.get("reused_step_share")
    if est is None or ideal * (1 - NOISE) <= est <= ideal * (1 + NOISE):
        return []
    above = est > ideal
    head = (f"estimated speedup {est:.2f}x is {'above' if above else 'below'} the schedule ideal "
            f"{ideal:.2f}x by more than {NOISE:.0%}")
    loop = (report.get("compiles") or {}).get("loop") or {}
    if loop.get("lowered"):
        return [f"{head}: {loop['lowered']} program(s) compiled inside the timed loop's steps "
                "(the warm-up missed them), which the computed steps' times include; trust the "
                "ideal, and report the compile"]
    full, cached = t["full_step_seconds"], t["cached_step_seconds"]
    full_times = [x for x, c in zip(t.get("step_seconds", ()), t.get("step_computed", ()),
                                    strict=True) if c]
    spread = (f"computed steps took {_ms(min(full_times))} to {_ms(max(full_times))}"
              if full_times else "")
    if cached is None or share is None or not full:
        return [f"{head}: {spread or 'no step time recorded'} (timing noise)"]
    measured = cached / full
    cost = (f"a reused step took {_ms(cached)} against {_ms(full)} for a computed one "
            f"({measured:.0%}), where the ideal counts {share:.0%} (its probe and tail blocks, "
            "the head as one block)")
    if above and measured < share:
        return [f"{head}: {cost}: the embeddings and head cost less than a block here, so the "
                "ideal understates what a reuse saves"]
    if not above and measured > share:
        return [f"{head}: {cost}: the probe, signal reads and per-step dispatch that every step "
                "runs cost more than the blocks the ideal counts (small models, host-bound "
                "loops)"]
    return [f"{head}: {cost}; {spread}, so the host's speed changed during the loop (timing "
            "noise)"]


def profile_warnings(config: CMConfig, summary: dict, trace) -> list[str]:
    """One line when a poly: profile was evaluated outside the rel range it was fitted on (its
    polynomial extrapolates there), or when a rescaled change came out negative (counted as 0)."""
    notes = summary.get("notes", {})
    below, above = notes.get("profile_below_range", 0), notes.get("profile_above_range", 0)
    clamped = notes.get("rescale_clamped", 0)
    if not (below or above or clamped) or config.teacache is None:
        return []
    profile = config.teacache.profile
    measured = sum(row["rel"] is not None for row in trace)
    parts = []
    if below or above:
        low, high = profile.rel_range or next(iter(profile.expert_ranges.values()))
        parts.append(f"TeaCache profile {config.teacache.policy} was evaluated outside the rel "
                     f"range it was fitted on [{low:.3g}, {high:.3g}] on {below + above} of "
                     f"{measured} measured calls ({below} below, {above} above): its rescaled "
                     "change there is extrapolated; recalibrate on runs like this one")
    if clamped:
        parts.append(f"{clamped} rescaled changes came out negative and counted as 0")
    return ["; ".join(parts)]


def median(xs):
    return statistics.median(xs) if xs else None


def _ms(seconds):
    return "-" if seconds is None else f"{1000 * seconds:.1f} ms"


def _write(r, latents, report, args):
    pipe, size = r["pipe"], r["size"]
    # a config from a decoded folder: its stage-3 fields describe a video of other latents
    config = {k: v for k, v in r["stage1"].items() if k not in STAGE3_FIELDS}
    # speech-to-video: what stage 3 needs to decode each clip with the history it continued
    clips = decode_metadata(pipe, r["latent_shape"], r["clips"],
                            "motion_latents" in r["tensors"]) if r["clips"] else {}
    config.update(model=pipe.name, height=size[0], width=size[1], video_length=size[2],
                  num_inference_steps=r["steps"], guidance_scale=report["guidance"], seed=r["seed"],
                  sample_solver=r["solver"], sample_shift=r["shift"],
                  stage2_elapsed_time=round(report["time"]["stage_seconds"], 3),
                  synthetic_inputs=r["synthetic"], sp_size=args.sp_size,
                  **clips, cfg_parallel=args.cfg_parallel, **_cache_metadata(r["config"]))
    meta = {k: config[k] for k in ("height", "width", "video_length", "num_inference_steps",
                                   "guidance_scale", "seed", "model", *clips) if k in config}
    meta.update(elapsed_time=report["time"]["stage_seconds"], device=report["device"],
                **_cache_metadata(r["config"]))
    out = latents.to(r["dtype"]) if r["dtype"] == torch.bfloat16 else latents
    cfg = r["config"]
    title = f"{pipe.name} {'+'.join(cfg.modes) or 'off'}"
    tech = cfg.teacache or cfg.fbcache
    reports = (
        ("--telemetry_json", args.telemetry_json, "w",
         lambda f: json.dump(report, f, indent=1, default=str)),
        ("--telemetry_csv", args.telemetry_csv, "w", lambda f: trace_csv(f, report["trace"])),
        ("--plot_png", args.plot_png, "wb", lambda f: plot_traces(
            {title: report["trace"]}, f, {title: tech.threshold if tech is not None else None})),
    )
    # reports are prepared first and committed with the stage files (one journal): all of the
    # run's outputs or none of them, even under kill -9
    files = Staged()
    try:
        for flag, path, mode, write in reports:
            if path is not None:
                files.add(path, write, mode, flag)
        if args.tensorboard_dir is not None:
            files.add_folder(args.tensorboard_dir, lambda folder: write_tensorboard(
                folder, report["trace"], r["steps"]), "--tensorboard_dir")
        report["outputs"] = write_stage2(r["output_dir"], out, meta, config, also=files,
                                         extra=decode_inputs(pipe, r["tensors"]) if clips else None)
    finally:
        files.discard()  # (nothing left to remove once committed)


def format_summary(report: dict) -> str:
    t, s, c = report["time"], report["speedup"], report["compiles"]
    lines = [
        f"stage 2: {report['model']}  {report['steps']} steps {report['solver']} "
        f"(shift {report['shift']})  guidance {report['guidance']}  latents "
        f"{report['latent_shape']} ({report['tokens']} tokens)"
        + (f" x {report['num_clips']} clips" if report.get("num_clips") else "")
        + f"  {report['device']}, "
        f"attention {report['attention']}",
        *([f"inputs: prompt {report['prompt']!r} (encoded here)"] if report.get("prompt") else
          ["inputs: synthetic stage-1 tensors drawn from the seed (no prompt)"]
          if report.get("synthetic_inputs") else []),
        f"cache: {', '.join(report['cache']['modes']) or 'off'}"
        + (f"  preset {report['cache']['preset']}" if report["cache"]["preset"] else "")
        + f"  (probe {report['cache']['probe_blocks']} blocks, tail {report['cache']['tail_blocks']}"
        + (f", {report['cache']['reuse_tail_blocks']} of them on reuse (bn_ids)"
           if report["cache"]["reuse_tail_blocks"] != report["cache"]["tail_blocks"] else "") + ")",
    ]
    for b, v in report["branches"].items():
        lines.append(f"  {b:7s} computed {v['computed']:3d}  reused {v['reused']:3d}")
    for e, br in report["experts"].items():
        lines.append(f"  expert {e}: " + "; ".join(f"{b} {v['computed']}/{v['reused']}"
                                                    for b, v in br.items()))
    for i, br in enumerate(report.get("clips") or ()):
        lines.append(f"  clip {i}: " + "; ".join(f"{b} {v['computed']}/{v['reused']}"
                                                 for b, v in br.items()) + " (computed/reused)")
    if report["cache"]["preset"] or report["cache"]["config"].get("dry_run"):
        cfg = report["cache"]["config"]
        shown = {k: cfg[k] for k in ("teacache", "fbcache", "deepcache", "bn_blocks", "forecast",
                                     "noise_adapt", "cfg_sep_diff", "dry_run") if cfg.get(k)}
        lines.append(f"  resolved: {shown}, limits {cfg['limits']}")
    if report["failsafes"]:
        lines.append(f"  fail-safes: {report['failsafes']}")
    lines += [f"  warning: {w}" for w in report.get("warnings", [])]
    lines += format_histograms(report.get("histograms", {}))
    if report.get("load"):
        ld = report["load"]
        lines.append(f"weights: read {_bytes(ld['bytes_read'])} of the checkpoint's "
                     f"{_bytes(ld['checkpoint_bytes'])} (this host's shards) in {ld['seconds']:.1f} s")
    w, lp = c["warmup"], c["loop"]
    if w is None:
        lines.append(f"compiles: none (eager); warm-up {c['warmup_seconds']:.1f} s")
    else:
        lines.append(f"compiles: warm-up {w['lowered']} ({c['warmup_seconds']:.1f} s, "
                     f"{w['cache_hits']} from the persistent cache), loop {lp['lowered']}")
    lines.append(f"time: loop {t['loop_seconds']:.2f} s; full step {_ms(t['full_step_seconds'])} "
                 f"x{t['full_steps']}, cached step {_ms(t['cached_step_seconds'])} x{t['cached_steps']}"
                 f"; signal reads {t['signal_reads']}")
    est = s["estimated"]
    lines.append(f"speedup: {'-' if est is None else f'{est:.2f}x'} estimated (full-step rate), "
                 f"schedule ideal {s['schedule_ideal']:.2f}x (blocks run)")
    if report.get("budget"):
        b = report["budget"]
        target = (f"rel L2 <= {b['rel_err']:g}" if b["rel_err"] is not None
                  else f"speedup {b['speedup']:g}x")
        if b["choice"] is None:
            lines.append(f"budget: {target} -> no calibrated configuration promises it; "
                         "uncached")
        else:
            lines.append(f"budget: {target} -> {b['choice']} (calibration: rel L2 <= "
                         f"{b['bound_rel_err']:.2e} on an unseen draw, computed "
                         f"{b['predicted_computed_fraction']:.3f} of the blocks); --compare "
                         "measures it")
    if "compare" in report:
        cmp = report["compare"]
        lines.append(f"compare: uncached loop {cmp['uncached_loop_seconds']:.2f} s -> speedup "
                     f"{cmp['speedup']:.2f}x; PSNR {cmp['psnr_db']:.1f} dB, rel L2 "
                     f"{cmp['rel_l2']:.2e}, vs displacement {cmp['rel_to_displacement']:.2e}")
    if "outputs" in report:
        lines.append("wrote " + ", ".join(report["outputs"].values()))
    return "\n".join(lines)


ERRORS = (UsageError, OutputError, ConfigError, StageFileError, CheckpointError, ModelConfigError,
          SchedulerError, ops.OpError, BudgetError, SinkUnavailable)



# under torchrun, rank 0 speaks for the run
main = command(build_parser, run, format_summary, ERRORS, lambda report: report.get("writer", True))

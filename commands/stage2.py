"""Stage 2 of the pipeline as a command: flags, then the run of a resolved `RunSpec`.

Order of work, so that bad input never costs a compile and never leaves output behind:
resolve flags (`stage2_resolve`) -> read and check stage-1 files (or encode the prompt in-process
on a model with a built-in text encoder, or synthesize them) -> load the model(s)
(`stage2_backend`) -> build the backend -> warm up (every program compiles here) -> the timed
loop -> (the uncached comparison) -> the report (`stage2_report`) -> write
stage2_latents.safetensors and generation_config.json atomically.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass

import torch

from cache import CMConfig, ConfigError
from cache.telemetry import trace_csv
from modules import ops
from modules.checkpoint import model_fingerprint, reader_fingerprint
from modules.layers import ModelConfigError
from modules.layouts import CheckpointError
from sampling import progress
from sampling.budget import BudgetError
from sampling.cache_cli import add_cache_arguments
from sampling.cli import CommandParser, add_compile_cache_flag, command
from sampling.clips import decode_inputs, decode_metadata, sample_clips
from sampling.errors import StageFileError, UsageError
from sampling.journal import Staged
from sampling.one_writer import one_writer
from sampling.pipelines import DEFAULT_PIPELINE, DEFAULT_PROMPT, PIPELINES
from sampling.run import make_sample, noise_for, sample_once
from sampling.run_spec import DEFAULT_SEED, DIT_DTYPES, Launch, RunSpec
from sampling.schedulers import SOLVERS, SchedulerError
from sampling.sinks import SinkUnavailable, plot_traces, write_tensorboard
from sampling.stage_io import EMBEDDINGS, STAGE3_FIELDS, write_stage2
from sampling.stages import SignalPlan

from .stage2_backend import (
    backend_writer,
    check_host_memory,
    check_profile_weights,
    load_models,
    make_backend,
    open_models,
    torch_parallel,
)
from .stage2_report import Stage2Report, build_report, compare_report, compile_counts, format_summary
from .stage2_resolve import Stage2Request, check_prompt_used, request_of, resolve

LAUNCH = Launch()  # where a run executes unless its flags say otherwise


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
    g.add_argument("--dtype", choices=DIT_DTYPES, help="weights (default bf16 with --model_path, "
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
    g.add_argument("--backend", choices=("jax", "torch"), default=LAUNCH.backend,
                   help="jax (torchax programs; TPU, GPU, CPU) or torch (CUDA, Ascend NPU, CPU)")
    g.add_argument("--device", help="torch backend: cuda, npu or cpu (default: the first present)")
    g.add_argument("--torch_compile", action="store_true",
                   help="torch backend: torch.compile each stage (the gate stays outside)")
    g.add_argument("--offload_model", action="store_true",
                   help="torch backend: keep weights on the host until their expert runs; cached "
                        "residuals then live on the host too (unless --cache_offload says otherwise)")
    g.add_argument("--attention", help="ops.attention implementation while tracing (default: "
                   "splash on TPU, jax_dpa elsewhere)")
    g.add_argument("--warmup_steps", type=int, default=LAUNCH.warmup_steps,
                   help="warm-up rounds before the timed loop; each runs every program once "
                        "(default 1)")
    add_compile_cache_flag(g)
    g = parser.add_argument_group("parallel")
    g.add_argument("--ulysses_size", "--sp_size", dest="sp_size", type=int, default=LAUNCH.sp_size,
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
                   "configuration with the least typical error (geometric mean over every draw the "
                   "calibration ran) among those that reach it")
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


# --- the run ------------------------------------------------------------------------------------

class OutputError(RuntimeError):
    """Sampling finished with latents that are not finite: nothing is written."""


@dataclass(frozen=True)
class Opened:
    """What opening the backend found: the load's figures (the JAX backend reading a checkpoint
    slice by slice; None for whole models) and warnings about the calibrated profiles in use."""

    load: dict | None
    warnings: tuple[str, ...]


def run(args: argparse.Namespace) -> dict:
    return sample_stage(request_of(args)).as_dict()


def sample_stage(request: Stage2Request) -> Stage2Report:
    """The whole stage; returns the report printed and written as telemetry. Under torchrun
    every rank samples (the collectives need them all) and only rank 0 writes and prints."""
    spec = resolve(request)
    check_prompt_used(request, spec)
    launch = spec.launch
    if launch.multihost:  # before anything touches JAX (importing the backend does)
        from tpu.distributed import initialize
        initialize(launch.coordinator_address, launch.num_processes, launch.process_id)
    layout = torch_parallel(launch)
    try:
        writer = layout.rank == 0 if layout is not None else backend_writer(launch.multihost)
        # the writer holds the output folder for the run: a second run into it is refused up front
        with one_writer(spec.outputs.output_dir) if writer else contextlib.nullcontext():
            backend, opened = open_backend(spec, layout)
            return sample_and_write(spec, backend, writer, opened)[0]
    finally:
        if layout is not None:
            from sharding.torch_sp import close_torch_parallel
            close_torch_parallel()


def open_backend(spec: RunSpec, layout=None) -> tuple[object, Opened]:
    """(backend, what opening it found): the models of the spec's pipeline on the backend it asks
    for, with its programs' plan; one backend serves every run of the same pipeline and cache
    flags."""
    backend, opened = _load(spec, SignalPlan.from_config(spec.config), layout)
    check_host_memory(spec, backend)
    return backend, opened


def _load(spec: RunSpec, plan, layout) -> tuple[object, Opened]:
    """The JAX backend reads a checkpoint slice by slice as it places the weights (each host its
    own devices' rows); the torch backend, and the JAX backend's tiny random models, take whole
    models built first."""
    pipe = spec.pipe
    if spec.launch.backend != "jax" or spec.model_path is None:
        models = load_models(pipe, spec.model_path, spec.dtype)
        warnings = check_profile_weights(
            spec, lambda: {e: model_fingerprint(m) for e, m in models.items()})
        return make_backend(spec.launch, models, plan, layout), Opened(None, tuple(warnings))
    began = time.perf_counter()
    opened = open_models(pipe, spec.model_path, spec.dtype)
    opening = time.perf_counter() - began
    readers = {expert: reader for expert, (_, reader) in opened.items()}
    try:
        warnings = check_profile_weights(  # before any weight is placed
            spec, lambda: {e: reader_fingerprint(m, rd) for e, (m, rd) in opened.items()})
        backend = make_backend(spec.launch, {e: model for e, (model, _) in opened.items()}, plan,
                               layout, checkpoints=readers)
    finally:
        for reader in readers.values():
            reader.close()
    return backend, Opened({"seconds": opening + backend.placement_seconds,
                            "bytes_read": sum(c.bytes_read for c in readers.values()),
                            "checkpoint_bytes": sum(c.checkpoint_bytes for c in readers.values())},
                           tuple(warnings))


def sample_and_write(spec: RunSpec, backend, writer: bool,
                     opened: Opened | None = None) -> tuple[Stage2Report, torch.Tensor | None]:
    """One resolved run on an open backend: sample (and the uncached comparison), check, report
    (with `opened`, what opening the backend found), write (the writer only). Returns the report
    and, with --compare, the uncached latents (for a caller that decodes both)."""
    config, outputs = spec.config, spec.outputs
    sample = None  # speech-to-video builds its samples clip by clip
    if spec.pipe.task != "s2v":
        sample = make_sample(backend, spec.pipe, spec.tensors, spec.latent_shape, image=spec.image,
                             seed=spec.seed, guidance=spec.guidance,
                             fused_cfg=config.cfg_mode == "fused")
    began = time.perf_counter()
    # one bar over every step of every clip (speech-to-video samples its clips one by one)
    bar = progress.steps(spec.steps * (spec.clips if sample is None else 1)) \
        if writer and outputs.progress else None
    try:
        latents, traj, noise = _sample(backend, config, spec, sample, progress=bar,
                                       warmup_rounds=spec.launch.warmup_steps)
    finally:
        if bar is not None:
            bar.close()
    _check_finite(latents, spec)
    seconds = time.perf_counter() - began
    reference = compare = None
    if outputs.compare:
        # caching off, same CFG pairing (a fused sample is called as one pair)
        reference, base, _ = _sample(backend, CMConfig(cfg_mode=config.cfg_mode), spec, sample,
                                     warmup_rounds=0)
        compare = compare_report(traj, base, latents, reference, noise)
    report = build_report(
        spec, traj, backend, seconds, warnings=opened.warnings if opened is not None else (),
        compare=compare, load=opened.load if opened is not None else None, writer=writer,
        # everything this process compiled so far (loading, warm-up, loop, --compare), whose
        # `compiled` (not served by the persistent cache) a second run keeps at 0
        process=compile_counts(backend.compile_counts()))
    if writer:
        report = dataclasses.replace(report, outputs=_write(spec, latents, report))
    return report, reference


def _sample(backend, config, spec: RunSpec, sample, *, progress=None, warmup_rounds=1):
    """(host latents, trajectory, host initial noise) of one run of `sample`; speech-to-video
    (sample None) samples its clips one after another, their trajectories read as one."""
    common = dict(solver=spec.solver, steps=spec.steps, shift=spec.shift, progress=progress,
                  warmup_rounds=warmup_rounds)
    if sample is None:
        clips = sample_clips(backend, config, spec.pipe, spec.tensors, spec.latent_shape,
                             seed=spec.seed, guidance=spec.guidance,
                             fused_cfg=config.cfg_mode == "fused", clips=spec.clips, **common)
        noise = torch.cat([noise_for(spec.latent_shape, spec.seed + c) for c in range(spec.clips)],
                          dim=2)
        return clips.latents, clips.merged(), noise
    traj = sample_once(backend, config, sample, **common)
    return backend.get(traj.latents), traj, backend.get(sample.noise)


def _check_finite(latents, spec: RunSpec) -> None:
    """Non-finite latents are an error, with what most likely caused them (weights were checked
    at load, stage-1 tensors and guidance when read)."""
    bad = int((~torch.isfinite(latents)).sum())
    if not bad:
        return
    causes = []
    guidance = spec.shown_guidance
    scales = guidance if isinstance(guidance, tuple) else (guidance,)
    if max(scales) > 20:
        causes.append(f"guidance {guidance} (usual: 1-10)")
    peak = max((float(t.abs().max()) for t in spec.tensors.values()
                if t.is_floating_point() and t.numel()), default=0.0)
    if peak > 1e3:
        causes.append(f"stage-1 values up to {peak:.3g} (encoders give ~1-1e3)")
    if spec.dtype == torch.bfloat16:
        causes.append("bf16 overflow (try --dtype fp32)")
    if not causes:
        causes.append("the checkpoint or the sampler settings (steps, shift)")
    raise OutputError(f"sampling gave non-finite latents ({bad:,} of {latents.numel():,} values "
                      f"NaN or Inf); likely cause: {'; '.join(causes)}; nothing was written, and "
                      "files of earlier runs are as they were")


def _cache_metadata(config: CMConfig) -> dict:
    dc = config.deepcache
    out = {"cache_enabled": config.enabled, "cache_modes": list(config.modes),
           "deepcache_enabled": dc is not None}
    if dc is not None:
        out.update(cache_start_step=dc.start, cache_end_step=dc.end, cache_step_interval=dc.interval)
    return out


def _write(spec: RunSpec, latents, report: Stage2Report) -> dict:
    """The stage files and the report files, committed together; returns the stage files."""
    pipe, size, outputs = spec.pipe, spec.size, spec.outputs
    # a config from a decoded folder: its stage-3 fields describe a video of other latents
    config = {k: v for k, v in spec.stage1.items() if k not in STAGE3_FIELDS}
    # speech-to-video: what stage 3 needs to decode each clip with the history it continued
    clips = decode_metadata(pipe, spec.latent_shape, spec.clips,
                            "motion_latents" in spec.tensors) if spec.clips else {}
    config.update(model=pipe.name, height=size[0], width=size[1], video_length=size[2],
                  num_inference_steps=spec.steps, guidance_scale=report.guidance, seed=spec.seed,
                  sample_solver=spec.solver, sample_shift=spec.shift,
                  stage2_elapsed_time=round(report.time["stage_seconds"], 3),
                  synthetic_inputs=spec.synthetic, sp_size=spec.launch.sp_size,
                  **clips, cfg_parallel=spec.launch.cfg_parallel,
                  **_cache_metadata(spec.config))
    meta = {k: config[k] for k in ("height", "width", "video_length", "num_inference_steps",
                                   "guidance_scale", "seed", "model", *clips) if k in config}
    meta.update(elapsed_time=report.time["stage_seconds"], device=report.device,
                **_cache_metadata(spec.config))
    out = latents.to(spec.dtype) if spec.dtype == torch.bfloat16 else latents
    cfg = spec.config
    title = f"{pipe.name} {'+'.join(cfg.modes) or 'off'}"
    tech = cfg.teacache or cfg.fbcache
    reports = (
        ("--telemetry_json", outputs.telemetry_json, "w",
         lambda f: json.dump(report.as_dict(), f, indent=1, default=str)),
        ("--telemetry_csv", outputs.telemetry_csv, "w", lambda f: trace_csv(f, report.trace)),
        ("--plot_png", outputs.plot_png, "wb", lambda f: plot_traces(
            {title: report.trace}, f, {title: tech.threshold if tech is not None else None})),
    )
    # reports are prepared first and committed with the stage files (one journal): all of the
    # run's outputs or none of them, even under kill -9
    files = Staged()
    try:
        for flag, path, mode, write in reports:
            if path is not None:
                files.add(path, write, mode, flag)
        if outputs.tensorboard_dir is not None:
            files.add_folder(outputs.tensorboard_dir, lambda folder: write_tensorboard(
                folder, report.trace, spec.steps), "--tensorboard_dir")
        return write_stage2(outputs.output_dir, out, meta, config, also=files,
                            extra=decode_inputs(pipe, spec.tensors) if clips else None)
    finally:
        files.discard()  # (nothing left to remove once committed)


ERRORS = (UsageError, OutputError, ConfigError, StageFileError, CheckpointError, ModelConfigError,
          SchedulerError, ops.OpError, BudgetError, SinkUnavailable)

# under torchrun, rank 0 speaks for the run
main = command(build_parser, run, format_summary, ERRORS, lambda report: report.get("writer", True))

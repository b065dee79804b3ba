"""Stage 2's flags and inputs, resolved and checked into a `RunSpec` before any model or device
work: flags whose range needs no model, the torchrun world, the pipeline and its cache
configuration (a budget's choice), sampling settings (flag, else the stage-1 config, else the
model's), sizes, the stage-1 tensors (read, given, encoded from --prompt or synthesized) and every
path the run will write. Its input is `Stage2Request`, the command line typed (the prompt-to-video
command makes one a prompt); no Namespace reaches this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

from cache import CMConfig
from cache.flags import CacheFlags, config_of
from encoders import EncoderInputError
from encoders.word_table import FOLDER as WORD_TABLE
from modules.registry import family_of
from sampling import platforms
from sampling.budget import BudgetError
from sampling.budget import choose as budget_choose
from sampling.budget_profile import load as budget_load
from sampling.calibration import profile_files
from sampling.cli import as_int, as_number, typed
from sampling.errors import StageFileError, UsageError
from sampling.guidance import parse_guidance
from sampling.pipelines import DEFAULT_PIPELINE, DEFAULT_PROMPT, PIPELINES, get_pipeline
from sampling.run_spec import (
    DEFAULT_SEED,
    DTYPES,
    Launch,
    Outputs,
    RunSpec,
    check_cfg,
    check_path,
    pick,
    shift_of,
    size_of,
    steps_of,
    with_cfg_parallel,
)
from sampling.sinks import require_pyplot, require_tensorboard
from sampling.stage_io import (
    CONFIG,
    EMBEDDINGS,
    LATENTS,
    check_distinct,
    check_tensors,
    check_writable,
    check_writable_file,
    read_config,
    read_stage1,
)
from sampling.stages import check_remodulate

from .stage1 import check as check_request
from .stage1 import encode as encode_request
from .stage1 import encoder_request


@dataclass(frozen=True, kw_only=True)
class Stage2Request:
    """Stage 2's command line, typed: the flags as given (None: not given; the model's or the
    stage-1 config's value is chosen in `resolve`)."""

    input_dir: str | None
    output_dir: str | None
    prompt: str | None
    model: str | None
    model_path: str | None
    dtype: str | None
    video_length: int | None
    height: int | None
    width: int | None
    num_inference_steps: int | None
    guidance_scale: str | None  # one scale, or 'high,low' for two experts
    sample_solver: str | None
    sample_shift: float | None
    seed: int | None
    num_clips: int | None
    launch: Launch  # where it runs
    # budgeted mode
    budget_profile: str | None
    budget_rel_err: float | None
    budget_speedup: float | None
    accept_profile: bool
    # outputs
    telemetry_json: str | None
    telemetry_csv: str | None
    tensorboard_dir: str | None
    plot_png: str | None
    compare: bool
    no_progress: bool
    cache: CacheFlags


def request_of(args: argparse.Namespace) -> Stage2Request:
    """The command line's request: the one place stage 2 reads its Namespace."""
    return typed(Stage2Request, args)


def _pipeline_name(r: Stage2Request, stage1: dict) -> str:
    if r.model is not None:
        return r.model
    if "model" in stage1:
        return str(stage1["model"])
    if "transformer_version" in stage1:  # the HunyuanVideo-1.5 TPU port's stage 1
        return f"hunyuanvideo-1.5-{stage1['transformer_version']}"
    return DEFAULT_PIPELINE


def _check_flags(r: Stage2Request) -> None:
    """The flags whose valid range does not depend on the model or the inputs."""
    launch = r.launch
    as_int("--ulysses_size/--sp_size", launch.sp_size, minimum=1)
    as_int("--warmup_steps", launch.warmup_steps, minimum=0)
    if r.budget_rel_err is not None:
        as_number("--budget_rel_err", r.budget_rel_err, above=0.0)
    if r.budget_speedup is not None:
        as_number("--budget_speedup", r.budget_speedup, minimum=1.0,
                  expected="a finite number >= 1 (computed calls divided by this)")
    if r.budget_rel_err is not None and r.budget_speedup is not None:
        raise UsageError("--budget_rel_err and --budget_speedup are alternatives; give one")
    targeted = r.budget_rel_err is not None or r.budget_speedup is not None
    if targeted != (r.budget_profile is not None):
        raise UsageError("--budget_rel_err/--budget_speedup and --budget_profile go together: "
                         "the profile holds the calibration the target is met from"
                         if targeted else "--budget_profile needs a target: --budget_rel_err "
                         "or --budget_speedup")
    if targeted:
        chosen_by = [flag for flag, on in (
            ("--preset", r.cache.preset), ("--enable_cache", r.cache.enable_cache),
            ("--teacache", r.cache.teacache), ("--fbcache", r.cache.fbcache),
            ("--deepcache", r.cache.deepcache), ("--magcache", r.cache.magcache)) if on]
        if chosen_by:
            raise UsageError(f"budgeted mode chooses the technique; drop {', '.join(chosen_by)} "
                             "(or drop the budget)")
    if launch.backend != "torch" and (launch.torch_compile or launch.offload_model or launch.device):
        raise UsageError("--device, --torch_compile and --offload_model belong to --backend torch")
    if launch.backend == "torch" and launch.torch_compile and (launch.sp_size > 1 or launch.cfg_parallel):
        raise UsageError("--torch_compile does not combine with --sp_size > 1 or --cfg_parallel "
                         "(the parallel stages run eagerly)")
    if launch.weight_sharding is not None and launch.backend != "jax":
        raise UsageError("--weight_sharding places the JAX backend's weights; the torch backend "
                         "keeps them whole on every rank")
    if launch.weight_sharding == "fsdp" and launch.sp_size == 1 and not launch.cfg_parallel:
        raise UsageError("--weight_sharding fsdp splits the weights over a mesh of several "
                         "devices; give --sp_size > 1 or --cfg_parallel")
    if not launch.multihost and any(v is not None for v in (launch.coordinator_address,
                                                          launch.num_processes, launch.process_id)):
        raise UsageError("--coordinator_address, --num_processes and --process_id belong to "
                         "--multihost")
    if launch.multihost and launch.backend != "jax":
        raise UsageError("--multihost starts JAX's distributed runtime; the torch backend runs "
                         "several processes under torchrun instead")
    if launch.num_processes is not None:
        as_int("--num_processes", launch.num_processes, minimum=1)
    if launch.process_id is not None:
        as_int("--process_id", launch.process_id, minimum=0,
               maximum=(launch.num_processes - 1) if launch.num_processes else None)
    if r.input_dir is not None and r.prompt is not None:
        raise UsageError("--prompt and --input_dir are alternatives: the stage-1 folder holds "
                         "its prompt's embeddings; give one")
    for flag in ("input_dir", "output_dir", "model_path", "budget_profile"):
        check_path(f"--{flag}", getattr(r, flag))
    check_path("--compile_cache_dir", launch.compile_cache_dir)
    platforms.check_backend(launch.backend, device=launch.device, attention=launch.attention,
                            multihost=launch.multihost)


def _check_launch(r: Stage2Request) -> None:
    """A torchrun world must fit the flags: only the torch backend runs as several processes,
    and then as exactly sp x cfg ranks. Checked on every rank alike (rank 0 says so)."""
    launch = r.launch
    world = as_int("WORLD_SIZE (set by torchrun)", os.environ.get("WORLD_SIZE", "1"), minimum=1)
    if launch.backend != "torch":
        if world > 1:
            raise UsageError(f"launched as {world} processes (torchrun), but --backend "
                             f"{launch.backend} runs as one process per host (its devices split "
                             "the tokens with --sp_size; several hosts: --multihost); add "
                             "--backend torch, or run one process")
        return
    cfg = 2 if launch.cfg_parallel else 1
    if world != launch.sp_size * cfg:
        raise UsageError(
            f"{world} process(es) were launched, but --sp_size {launch.sp_size}"
            f"{' x --cfg_parallel 2' if launch.cfg_parallel else ''} needs {launch.sp_size * cfg}: "
            f"run `torchrun --nproc_per_node {launch.sp_size * cfg} ...` or change "
            "--sp_size/--cfg_parallel")


def _check_blocks(config: CMConfig, pipe, r: Stage2Request) -> None:
    """Probe and tail blocks must fit in the model (a preset's bn_blocks included)."""
    blocks = pipe.config.num_layers
    fn, bn = config.probe_blocks, config.tail_blocks
    if config.enabled and fn + bn > blocks:
        given = [f"--{f} {getattr(r.cache, f)}" for f in ("fn_blocks", "bn_blocks")
                 if getattr(r.cache, f) is not None]
        source = " ".join(given) or (f"--preset {r.cache.preset}" if r.cache.preset else "the defaults")
        raise UsageError(f"{source}: probe blocks ({fn}) + tail blocks ({bn}) exceed the "
                         f"{pipe.name} model's {blocks} blocks; expected fn + bn <= {blocks}")
    if config.enabled and config.remodulate:
        try:
            check_remodulate(family_of(pipe.config).model_cls)
        except ValueError as exc:
            raise UsageError(f"{pipe.name}: {exc}") from None


def _budgeted(r: Stage2Request, pipe) -> tuple[CMConfig, dict]:
    """The configuration budgeted mode picks from the profile for the target (uncached when
    nothing calibrated promises it), and what it promised."""
    try:
        calibrated = budget_load(r.budget_profile)
        choice = budget_choose(calibrated, rel_err=r.budget_rel_err,
                               speedup=r.budget_speedup)
    except BudgetError as exc:
        raise UsageError(str(exc)) from None
    if calibrated["model"] != pipe.name:
        raise UsageError(f"--budget_profile {r.budget_profile} was calibrated for "
                         f"{calibrated['model']}; this run is {pipe.name}: calibrate it for "
                         f"{pipe.name}")
    config = config_of(r.cache, choice.fields if choice is not None else {})
    chosen = (dict.fromkeys(("choice", "config", "bound_rel_err", "typical_rel_err",
                             "predicted_computed_fraction"))
              if choice is None else
              {"choice": choice.label, "config": choice.fields, "bound_rel_err": choice.bound,
               "typical_rel_err": choice.typical, "predicted_computed_fraction": choice.computed})
    return config, {"rel_err": r.budget_rel_err, "speedup": r.budget_speedup, **chosen,
                    "calibrated_steps": calibrated["steps"],
                    "calibrated_seeds": calibrated["seeds"]}


def resolve(r: Stage2Request, given: tuple[dict, dict] | None = None) -> RunSpec:
    """Everything the run needs, checked, before any model or device work. `given`: stage-1
    (tensors, config) made in this process (the prompt-to-video command), read as a stage-1
    folder's would be."""
    _check_flags(r)
    _check_launch(r)
    stage1, source = {}, None
    if given is not None:
        stage1, source = dict(given[1]), "stage 1"
    elif r.input_dir is not None:
        if not os.path.isdir(r.input_dir):
            raise StageFileError(f"--input_dir {r.input_dir} is not a directory")
        stage1 = read_config(r.input_dir)
        source = os.path.join(r.input_dir, CONFIG)
    name = _pipeline_name(r, stage1)
    if name not in PIPELINES:
        raise UsageError(f"unknown model {name!r}" + ("" if r.model else " (from the input "
                         "config)") + f"; expected one of {', '.join(PIPELINES)}")
    pipe = get_pipeline(name)
    config, budget = _budgeted(r, pipe) if r.budget_profile else (config_of(r.cache),
                                                                      None)
    if r.launch.offload_model and r.cache.cache_offload is None:
        # Seed 000: with the model offloaded, residuals wait on the host and move on use.
        config = dataclasses.replace(config, offload="cpu")
    config = with_cfg_parallel(config, r.launch.cfg_parallel, r.cache.cfg_mode)
    if pipe.task == "s2v" and r.launch.backend == "torch" and (r.launch.sp_size > 1 or r.launch.cfg_parallel):
        # each rank holds a shard of the tokens, and the audio injection regroups all the noisy
        # tokens by frame; the JAX backend's global-view programs run it (--backend jax)
        raise UsageError(f"--model {pipe.name} runs sequence/CFG parallel on the JAX backend only; "
                         "drop --backend torch or --sp_size/--cfg_parallel")
    _check_blocks(config, pipe, r)
    steps = steps_of(r.num_inference_steps, pipe, stage1, source)
    shift = shift_of(r.sample_shift, pipe)
    if budget is not None and budget["calibrated_steps"] != steps:
        raise UsageError(f"--budget_profile {r.budget_profile} was calibrated at "
                         f"{budget['calibrated_steps']} steps and the error a schedule makes "
                         f"depends on it; this run has {steps}: run at "
                         f"{budget['calibrated_steps']} or calibrate at {steps}")
    if r.model_path is None and pipe.builtin is None:
        builtin = ", ".join(n for n, p in PIPELINES.items() if p.builtin is not None)
        raise UsageError(f"--model {pipe.name} has no built-in weights; give --model_path "
                         f"(or pick a model with built-in weights: {builtin})")
    if r.model_path is not None and not os.path.exists(r.model_path):
        # here, before stage 1 runs (minutes with real encoders), not at the first load
        raise UsageError(f"--model_path {r.model_path} does not exist; expected the "
                         f"checkpoint folder of {pipe.name}")
    prompt, encoder = _prompt(r, pipe, given)
    if r.num_clips is not None and pipe.task != "s2v":
        raise UsageError(f"--num_clips belongs to speech-to-video models; {pipe.name} samples one "
                         "clip")
    value, label = pick("--guidance_scale", r.guidance_scale, stage1, "guidance_scale", None,
                        source)
    guidance = parse_guidance(value, pipe, label)
    value, label = pick("--seed", r.seed, stage1, "seed", DEFAULT_SEED, source)
    seed = as_int(label, value, minimum=-2 ** 63, maximum=2 ** 64 - 1)
    size, latent_shape = size_of(pipe, (r.height, r.width, r.video_length), stage1,
                                 source)
    cfg_on = check_cfg(config, pipe, guidance, r.launch.cfg_parallel)
    outputs = _check_outputs(r)
    tensors, stage1, image = _inputs(r, pipe, given, stage1, source, prompt, encoder,
                                     latent_shape, size, cfg_on, seed)
    clips = None
    if pipe.task == "s2v":
        try:
            available = pipe.clip_count(tensors, latent_shape)
        except ValueError as exc:
            raise StageFileError(str(exc)) from None
        value, label = pick("--num_clips", r.num_clips, stage1, "num_clips", available, source)
        clips = as_int(label, value, minimum=1, maximum=available,
                       expected=f"1 to {available} (the audio holds {available} clips of "
                                f"{latent_shape[2] * pipe.vae_stride[0]} frames)")
    return RunSpec(
        pipe=pipe, config=config, budget=budget, steps=steps, solver=r.sample_solver or pipe.solver,
        shift=shift, guidance=guidance, seed=seed, size=size, latent_shape=latent_shape,
        clips=clips, dtype=DTYPES[r.dtype or ("bf16" if r.model_path else "fp32")],
        model_path=r.model_path, tensors=tensors, stage1=stage1, image=image, prompt=prompt,
        synthetic=given is None and r.input_dir is None and prompt is None, preset=r.cache.preset,
        profile_files=profile_files(r.budget_profile, config),
        accept_profile=r.accept_profile, launch=r.launch, outputs=outputs)


def _inputs(r: Stage2Request, pipe, given, stage1, source, prompt, encoder, latent_shape, size,
            cfg_on, seed):
    """(stage-1 tensors, stage-1 config, image): given by the caller, read from --input_dir,
    encoded from the prompt, or synthesized from the seed; checked against the pipeline's
    specs."""
    if given is not None:
        image = pipe.task == "i2v" or (pipe.task == "ti2v" and "image_latents" in given[0])
        check_tensors(given[0], pipe.stage1_specs(latent_shape, cfg_on, image), source)
        return given[0], stage1, image
    if r.input_dir is not None:
        image = pipe.task == "i2v" or (pipe.task == "ti2v" and _has_image(r.input_dir))
        tensors, stage1 = read_stage1(r.input_dir, pipe.stage1_specs(latent_shape, cfg_on, image))
        return tensors, stage1, image
    if prompt is not None:
        tensors, stage1_fields = _encode_prompt(pipe, prompt, encoder, size)
        check_tensors(tensors, pipe.stage1_specs(latent_shape, cfg_on, False), "--prompt")
        # recorded as a stage-1 folder's config would be (the prompt)
        return tensors, stage1_fields, False
    image = pipe.task == "i2v"
    return pipe.synthesize(latent_shape, cfg_on, image, seed), stage1, image


def _prompt(r: Stage2Request, pipe, given) -> tuple[str | None, str | None]:
    """(prompt, encoder weights) stage 2 encodes itself: without stage-1 inputs, on a model whose
    text encoder is built in (the trained tiny models; with --model_path, the checkpoint's own).
    (None, None): the inputs come from elsewhere, or are synthesized from --seed."""
    if given is not None or r.input_dir is not None:
        return None, None
    if pipe.encoders is None:
        return None, None
    weights = r.model_path
    if weights is not None and not os.path.isdir(os.path.join(weights, WORD_TABLE)):
        return None, None
    prompt = r.prompt
    return (DEFAULT_PROMPT if prompt is None else prompt), weights


def _encode_prompt(pipe, prompt: str, weights, size) -> tuple[dict, dict]:
    """(stage-1 tensors, config fields) of `prompt`, as stage 1 encodes them (the model's text
    encoder, on the host)."""
    height, width, frames = size
    request = encoder_request(None, prompt, height=height, width=width, frames=frames)
    try:
        check_request(pipe, request, weights)
        tensors, _, fields = encode_request(pipe, request, weights, "cpu")
    except EncoderInputError as exc:
        raise UsageError(str(exc)) from None
    return tensors, fields


def check_prompt_used(r: Stage2Request, spec: RunSpec) -> None:
    """Stage 2's own --prompt on a model it cannot encode prompts for is refused, not ignored."""
    if r.prompt is not None and spec.prompt is None:
        raise UsageError(f"--prompt: stage 2 holds no text encoder for {spec.pipe.name} and "
                         "synthesizes its inputs from --seed; encode the prompt with "
                         "stage1_encode.py and pass --input_dir, or drop --prompt")


def _check_outputs(r: Stage2Request) -> Outputs:
    """Every path the run will write, checked before any work: the output folder (and that no
    folder holds a file name it writes), the report files, the optional sinks' packages and the
    compilation cache."""
    output_dir = next(d for d in (r.output_dir, r.input_dir, "stage_outputs") if d is not None)
    check_writable(output_dir, "--output_dir", (LATENTS, CONFIG))
    for flag in ("telemetry_json", "telemetry_csv", "plot_png"):
        check_writable_file(f"--{flag}", getattr(r, flag))
    policy = r.cache.teacache_policy or ""
    inputs = {"--model_path": r.model_path, "--budget_profile": r.budget_profile,
              "--teacache_policy": policy.removeprefix("poly:")
              if policy.startswith("poly:") and policy.endswith(".json") else None}
    if r.input_dir is not None:
        inputs[f"--input_dir {EMBEDDINGS}"] = os.path.join(r.input_dir, EMBEDDINGS)
        if os.path.realpath(r.input_dir) != os.path.realpath(output_dir):
            # (in one folder, the config is read and then replaced, by design)
            inputs[f"--input_dir {CONFIG}"] = os.path.join(r.input_dir, CONFIG)
    outputs = {f"its {LATENTS} (--output_dir)": os.path.join(output_dir, LATENTS),
               f"its {CONFIG} (--output_dir)": os.path.join(output_dir, CONFIG),
               **{f"--{flag}": getattr(r, flag)
                  for flag in ("telemetry_json", "telemetry_csv", "plot_png")}}
    check_distinct(outputs, inputs)
    if r.tensorboard_dir is not None:
        check_writable(r.tensorboard_dir, "--tensorboard_dir")
        require_tensorboard()
    if r.plot_png is not None:
        require_pyplot()
    if r.launch.backend == "jax":
        from tpu.compile import check_cache_dir
        check_cache_dir(r.launch.compile_cache_dir)
    return Outputs(output_dir=output_dir, telemetry_json=r.telemetry_json,
                   telemetry_csv=r.telemetry_csv, plot_png=r.plot_png,
                   tensorboard_dir=r.tensorboard_dir, compare=r.compare,
                   progress=not r.no_progress)


def _has_image(directory):
    from safetensors import safe_open
    try:
        with safe_open(os.path.join(directory, EMBEDDINGS), "pt") as f:
            return "image_latents" in f.keys()
    except Exception:  # noqa: BLE001 - read_stage1 reports the unreadable file properly
        return False

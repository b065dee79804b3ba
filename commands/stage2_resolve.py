"""Stage 2's flags and inputs, resolved and checked into a `RunSpec` before any model or device
work: flags whose range needs no model, the torchrun world, the pipeline and its cache
configuration (a budget's choice), sampling settings (flag, else the stage-1 config, else the
model's), sizes, the stage-1 tensors (read, given, encoded from --prompt or synthesized) and every
path the run will write. The Namespace is read here and nowhere below.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from cache import CMConfig
from cache.flags import config_of
from encoders import EncoderInputError
from encoders.word_table import FOLDER as WORD_TABLE
from modules.registry import family_of
from sampling import platforms
from sampling.budget import BudgetError
from sampling.budget import choose as budget_choose
from sampling.budget_profile import load as budget_load
from sampling.cache_cli import cache_flags
from sampling.calibration import profile_files
from sampling.cli import as_int, as_number
from sampling.errors import StageFileError, UsageError
from sampling.pipelines import DEFAULT_PIPELINE, DEFAULT_PROMPT, MAX_GUIDANCE, PIPELINES, get_pipeline
from sampling.run_spec import (
    DEFAULT_SEED,
    DTYPES,
    Launch,
    Outputs,
    RunSpec,
    check_cfg,
    check_path,
    from_flags,
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
from .stage1 import request_of


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
        check_path(f"--{flag}", getattr(args, flag))
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
    config = config_of(cache_flags(args), choice.fields if choice is not None else {})
    chosen = (dict.fromkeys(("choice", "config", "bound_rel_err", "typical_rel_err",
                             "predicted_computed_fraction"))
              if choice is None else
              {"choice": choice.label, "config": choice.fields, "bound_rel_err": choice.bound,
               "typical_rel_err": choice.typical, "predicted_computed_fraction": choice.computed})
    return config, {"rel_err": args.budget_rel_err, "speedup": args.budget_speedup, **chosen,
                    "calibrated_steps": calibrated["steps"],
                    "calibrated_seeds": calibrated["seeds"]}


def resolve(args, given: tuple[dict, dict] | None = None) -> RunSpec:
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
    config, budget = _budgeted(args, pipe) if args.budget_profile else (config_of(cache_flags(args)),
                                                                      None)
    if args.offload_model and args.cache_offload is None:
        # Seed 000: with the model offloaded, residuals wait on the host and move on use.
        config = dataclasses.replace(config, offload="cpu")
    config = with_cfg_parallel(config, args.cfg_parallel, args.cfg_mode)
    if pipe.task == "s2v" and args.backend == "torch" and (args.sp_size > 1 or args.cfg_parallel):
        # each rank holds a shard of the tokens, and the audio injection regroups all the noisy
        # tokens by frame; the JAX backend's global-view programs run it (--backend jax)
        raise UsageError(f"--model {pipe.name} runs sequence/CFG parallel on the JAX backend only; "
                         "drop --backend torch or --sp_size/--cfg_parallel")
    _check_blocks(config, pipe, args)
    steps = steps_of(args.num_inference_steps, pipe, stage1, source)
    shift = shift_of(args.sample_shift, pipe)
    if budget is not None and budget["calibrated_steps"] != steps:
        raise UsageError(f"--budget_profile {args.budget_profile} was calibrated at "
                         f"{budget['calibrated_steps']} steps and the error a schedule makes "
                         f"depends on it; this run has {steps}: run at "
                         f"{budget['calibrated_steps']} or calibrate at {steps}")
    if args.model_path is None and pipe.builtin is None:
        builtin = ", ".join(n for n, p in PIPELINES.items() if p.builtin is not None)
        raise UsageError(f"--model {pipe.name} has no built-in weights; give --model_path "
                         f"(or pick a model with built-in weights: {builtin})")
    if args.model_path is not None and not os.path.exists(args.model_path):
        # here, before stage 1 runs (minutes with real encoders), not at the first load
        raise UsageError(f"--model_path {args.model_path} does not exist; expected the "
                         f"checkpoint folder of {pipe.name}")
    prompt, encoder = _prompt(args, pipe, given)
    if args.num_clips is not None and pipe.task != "s2v":
        raise UsageError(f"--num_clips belongs to speech-to-video models; {pipe.name} samples one "
                         "clip")
    value, label = pick("--guidance_scale", args.guidance_scale, stage1, "guidance_scale", None,
                        source)
    guidance = _guidance(value, pipe, label)
    value, label = pick("--seed", args.seed, stage1, "seed", DEFAULT_SEED, source)
    seed = as_int(label, value, minimum=-2 ** 63, maximum=2 ** 64 - 1)
    size, latent_shape = size_of(pipe, (args.height, args.width, args.video_length), stage1,
                                 source)
    cfg_on = check_cfg(config, pipe, guidance, args.cfg_parallel)
    outputs = _check_outputs(args)
    tensors, stage1, image = _inputs(args, pipe, given, stage1, source, prompt, encoder,
                                     latent_shape, size, cfg_on, seed)
    clips = None
    if pipe.task == "s2v":
        try:
            available = pipe.clip_count(tensors, latent_shape)
        except ValueError as exc:
            raise StageFileError(str(exc)) from None
        value, label = pick("--num_clips", args.num_clips, stage1, "num_clips", available, source)
        clips = as_int(label, value, minimum=1, maximum=available,
                       expected=f"1 to {available} (the audio holds {available} clips of "
                                f"{latent_shape[2] * pipe.vae_stride[0]} frames)")
    return RunSpec(
        pipe=pipe, config=config, budget=budget, steps=steps, solver=args.sample_solver or pipe.solver,
        shift=shift, guidance=guidance, seed=seed, size=size, latent_shape=latent_shape,
        clips=clips, dtype=DTYPES[args.dtype or ("bf16" if args.model_path else "fp32")],
        model_path=args.model_path, tensors=tensors, stage1=stage1, image=image, prompt=prompt,
        synthetic=given is None and args.input_dir is None and prompt is None, preset=args.preset,
        profile_files=profile_files(args.budget_profile, config),
        accept_profile=args.accept_profile, launch=from_flags(Launch, args), outputs=outputs)


def _inputs(args, pipe, given, stage1, source, prompt, encoder, latent_shape, size, cfg_on, seed):
    """(stage-1 tensors, stage-1 config, image): given by the caller, read from --input_dir,
    encoded from the prompt, or synthesized from the seed; checked against the pipeline's
    specs."""
    if given is not None:
        image = pipe.task == "i2v" or (pipe.task == "ti2v" and "image_latents" in given[0])
        check_tensors(given[0], pipe.stage1_specs(latent_shape, cfg_on, image), source)
        return given[0], stage1, image
    if args.input_dir is not None:
        image = pipe.task == "i2v" or (pipe.task == "ti2v" and _has_image(args.input_dir))
        tensors, stage1 = read_stage1(args.input_dir, pipe.stage1_specs(latent_shape, cfg_on, image))
        return tensors, stage1, image
    if prompt is not None:
        tensors, stage1_fields = _encode_prompt(pipe, prompt, encoder, size)
        check_tensors(tensors, pipe.stage1_specs(latent_shape, cfg_on, False), "--prompt")
        # recorded as a stage-1 folder's config would be (the prompt)
        return tensors, stage1_fields, False
    image = pipe.task == "i2v"
    return pipe.synthesize(latent_shape, cfg_on, image, seed), stage1, image


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


def check_prompt_used(args, spec: RunSpec) -> None:
    """Stage 2's own --prompt on a model it cannot encode prompts for is refused, not ignored."""
    if getattr(args, "prompt", None) is not None and spec.prompt is None:
        raise UsageError(f"--prompt: stage 2 holds no text encoder for {spec.pipe.name} and "
                         "synthesizes its inputs from --seed; encode the prompt with "
                         "stage1_encode.py and pass --input_dir, or drop --prompt")


def _check_outputs(args) -> Outputs:
    """Every path the run will write, checked before any work: the output folder (and that no
    folder holds a file name it writes), the report files, the optional sinks' packages and the
    compilation cache."""
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
        from tpu.compile import check_cache_dir
        check_cache_dir(args.compile_cache_dir)
    return Outputs(output_dir=output_dir, telemetry_json=args.telemetry_json,
                   telemetry_csv=args.telemetry_csv, plot_png=args.plot_png,
                   tensorboard_dir=args.tensorboard_dir, compare=args.compare,
                   progress=not args.no_progress)


def _has_image(directory):
    from safetensors import safe_open
    try:
        with safe_open(os.path.join(directory, EMBEDDINGS), "pt") as f:
            return "image_latents" in f.keys()
    except Exception:  # noqa: BLE001 - read_stage1 reports the unreadable file properly
        return False

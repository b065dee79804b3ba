"""Stage 1: encode a prompt (and an image or speech file) into the files stage 2 reads.

    python stage1_encode.py --prompt "red circle moves right on blue"            # the tiny default
    python stage1_encode.py --model wan2.2-ti2v-5b --encoder_path /ckpts/Wan2.2-TI2V-5B \
        --prompt "..." --image first.png --output_dir stage_outputs

Writes `stage1_embeddings.safetensors` and `generation_config.json` (atomically, both or
neither) in the TPU port's format: the tensors `Pipeline.stage1_specs` names, the metadata
`prompt, negative_prompt, model_path, resolution, task_type`, and the config fields stage 2
reads (`model`, `height`, `width`, `video_length`, `num_clips` for speech-to-video). Every input
is checked before any model work (`encoders.<family>.check`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import encoders
from encoders import EncoderInputError, Request
from sampling.cli import CommandParser, as_int, command, typed
from sampling.errors import StageFileError, UsageError
from sampling.one_writer import one_writer
from sampling.pipelines import DEFAULT_PIPELINE, PIPELINES, get_pipeline
from sampling.stage_io import CONFIG, EMBEDDINGS, check_writable, write_stage

ERRORS = (UsageError, EncoderInputError, StageFileError)


# the stage-1 flags --help shows (one screen); --help_all every flag
COMMON = {"prompt", "negative_prompt", "image", "audio", "encoder_path", "model"}


def add_arguments(parser: argparse.ArgumentParser, *, sizes: bool = True) -> None:
    """The stage-1 flags (`sizes`: also --height/--width/--video_length/--num_clips/--model,
    which the prompt-to-video command takes from stage 2's flags)."""
    g = parser.add_argument_group("inputs and model")
    g.add_argument("--negative_prompt", help="default: the model's official negative prompt")
    g.add_argument("--image", help="first frame (image-to-video modes) or reference image (S2V)")
    g.add_argument("--audio", help="speech file (speech-to-video)")
    g.add_argument("--encoder_path", help="the release folder holding the encoders (official or "
                   "diffusers layout: Wan's models_t5_umt5-xxl-enc-bf16.pth + google/umt5-xxl/, "
                   "HunyuanVideo-1.5's text_encoder/ ...); default: the model's built-in or tiny "
                   "random encoders")
    g = parser.add_argument_group("advanced")
    g.add_argument("--encoder_device", default="cpu", help="where the encoders run (default cpu)")
    g.add_argument("--random_encoders", action="store_true",
                   help="a real model without --encoder_path: encode with tiny random encoders "
                   "anyway (its video is noise; for trying the commands without the release)")
    if sizes:
        g = parser.add_argument_group("inputs and model")
        g.add_argument("--model", default=None, help=f"named pipeline, one of {', '.join(PIPELINES)} "
                       f"(default {DEFAULT_PIPELINE})")
        g.add_argument("--height", type=int)
        g.add_argument("--width", type=int)
        g.add_argument("--video_length", type=int)
        g.add_argument("--num_clips", type=int)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="stage1_encode.py", common=COMMON | {"output_dir", "height", "width", "video_length"},
        description="Stage 1: encode a prompt (image, speech) into the stage files stage 2 reads.")
    g = parser.add_argument_group("inputs and model")
    g.add_argument("--prompt", required=True, help="what the video shows")
    g = parser.add_argument_group("outputs and reports")
    g.add_argument("--output_dir", default="stage_outputs",
                        help=f"where {EMBEDDINGS} and {CONFIG} go (default ./stage_outputs)")
    add_arguments(parser)
    return parser


@dataclass(frozen=True, kw_only=True)
class Inputs:
    """The stage-1 flags the prompt-to-video command shares: what conditions the prompt, and the
    encoders."""

    negative_prompt: str | None
    image: str | None
    audio: str | None
    encoder_path: str | None
    encoder_device: str
    random_encoders: bool


@dataclass(frozen=True, kw_only=True)
class Stage1Request:
    """Stage 1's command line, typed (None: not given)."""

    prompt: str
    output_dir: str
    model: str | None
    height: int | None
    width: int | None
    video_length: int | None
    num_clips: int | None
    inputs: Inputs


def request_of(args: argparse.Namespace) -> Stage1Request:
    """The command line's request: the one place stage 1 reads its Namespace."""
    return typed(Stage1Request, args)


def encoder_request(inputs: Inputs | None, prompt: str, *, height=None, width=None, frames=None,
                    clips=None, **override) -> Request:
    """What the encoders get for `prompt`: the size and the conditioning (`inputs`' flags, each
    replaced by a non-None `override`: a batch line's own image, say), checked."""
    given = {k: getattr(inputs, k) if inputs is not None else None
             for k in ("negative_prompt", "image", "audio")}
    fields = dict(prompt=prompt, **given, height=height, width=width, frames=frames, clips=clips)
    fields.update({k: v for k, v in override.items() if v is not None})
    for flag, key in (("--height", "height"), ("--width", "width"),
                      ("--video_length", "frames"), ("--num_clips", "clips")):
        if fields[key] is not None:
            as_int(flag, fields[key], minimum=1)
    for key in ("image", "audio"):
        if fields[key] == "":
            raise UsageError(f"--{key} '': expected a path")
    return Request(**fields)


def pipeline_of(model: str | None):
    try:
        return get_pipeline(model or DEFAULT_PIPELINE)
    except ValueError as exc:
        raise UsageError(f"--model: {exc}") from None


def check(pipe, request: Request, weights, random_encoders: bool = False) -> None:
    if weights is None and pipe.builtin is None and pipe.encoders is None and not random_encoders:
        # a real model's prompt through tiny random encoders is a video of noise (issue 62)
        raise UsageError(f"--encoder_path: not given; {pipe.name} would encode the prompt with "
                         "tiny random encoders and its video would be noise; expected the "
                         "release folder holding its encoders, or --random_encoders to mean it")
    if weights is not None and not os.path.isdir(weights):
        raise UsageError(f"--encoder_path {weights} is not a directory; expected the release "
                         "folder holding the encoders")
    if not request.prompt.strip() and pipe.encoders is not None:
        raise UsageError("--prompt '': expected a prompt")
    encoders.for_pipeline(pipe).check(pipe, request, weights)


def encode(pipe, request: Request, weights, device: str) -> tuple[dict, dict, dict]:
    """(tensors, metadata, config) of one request."""
    tensors, fields = encoders.for_pipeline(pipe).encode(pipe, request, weights, device=device)
    h, w, f = pipe.size
    config = {"model": pipe.name, "height": request.height or h, "width": request.width or w,
              "video_length": request.frames or f, **fields,
              "prompt": request.prompt, "negative_prompt": request.negative_prompt}
    metadata = {"prompt": request.prompt, "negative_prompt": request.negative_prompt or "",
                "model_path": weights or "", "task_type": pipe.task,
                "resolution": f"{config['height']}x{config['width']}"}
    return tensors, metadata, config


def run(args: argparse.Namespace) -> dict:
    return encode_stage(request_of(args))


def encode_stage(r: Stage1Request) -> dict:
    """The whole stage; returns the report."""
    pipe, inputs = pipeline_of(r.model), r.inputs
    request = encoder_request(inputs, r.prompt, height=r.height, width=r.width,
                              frames=r.video_length, clips=r.num_clips)
    check_writable(r.output_dir, "--output_dir", (EMBEDDINGS, CONFIG))
    check(pipe, request, inputs.encoder_path, inputs.random_encoders)
    with one_writer(r.output_dir):
        tensors, metadata, config = encode(pipe, request, inputs.encoder_path,
                                           inputs.encoder_device)
        outputs = write_stage(r.output_dir, tensors, EMBEDDINGS, metadata, config)
    return {"model": pipe.name, "prompt": request.prompt, "outputs": outputs,
            "tensors": {k: list(v.shape) for k, v in tensors.items()},
            "random_encoders": random_encoders_used(pipe, inputs.encoder_path)}


def random_encoders_used(pipe, encoder_path: str | None) -> bool:
    """A real model encoded by tiny random encoders (--random_encoders): the summary says so."""
    return pipe.builtin is None and pipe.encoders is None and encoder_path is None


RANDOM_NOTE = ("encoders: TINY RANDOM (--random_encoders, no --encoder_path): the embeddings, and "
               "the video made from them, show no prompt")


def format_summary(report: dict) -> str:
    shapes = ", ".join(f"{k} {v}" for k, v in report["tensors"].items())
    return (f"stage 1: {report['model']}  {report['prompt']!r}\n  {shapes}\n"
            + (f"{RANDOM_NOTE}\n" if report.get("random_encoders") else "")
            + f"wrote {', '.join(report['outputs'].values())}")


main = command(build_parser, run, format_summary, ERRORS)

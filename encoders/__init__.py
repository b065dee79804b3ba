"""Stage 1: text, image and audio encoders that write what stage 2 reads (issue 25).

One module per family (`wan`, `hunyuan`, and `word_table` for the embedded trained default), each
with the same two functions, which the stage-1 command (`commands/stage1.py`) dispatches to by
`Pipeline.encoders` or else `Pipeline.family` (`for_pipeline`):

    check(pipeline, request, weights) -> None
        Up-front checks before any model work: files named by the request exist and decode
        (image, audio), the weights folder holds every file its layout needs (official or
        diffusers), checkpoint headers name the expected model. Raises `EncoderInputError`.
    encode(pipeline, request, weights, device="cpu") -> (tensors, config)
        `tensors`: the stage-1 tensors named as `Pipeline.stage1_specs` names them (what
        `sampling.stage_io.write_stage` writes); `config`: the generation_config fields the
        encoding decides (height, width, video_length whenever an image decides the size,
        num_clips for S2V).

`weights` is a folder of real encoder checkpoints in an official or diffusers layout, or None:
then tiny random encoders and tokenizers are built locally (no hub), deterministic, with the
dimensions of the tiny pipelines, through the same code path as real checkpoints.

This room imports torch, transformers and `modules/` (the VAEs); never caching or sampling
internals beyond the pipeline's description (`sampling.pipelines.Pipeline`).
"""

import importlib

from .request import EncoderInputError, Request

__all__ = ["EncoderInputError", "Request", "for_pipeline"]

_MODULES = {"wan": "wan", "hunyuan_video15": "hunyuan", "word_table": "word_table"}


def for_pipeline(pipeline):
    """The module (with `check` and `encode`) that writes `pipeline`'s stage-1 tensors."""
    name = _MODULES[pipeline.encoders or pipeline.family]
    return importlib.import_module(f"{__name__}.{name}")

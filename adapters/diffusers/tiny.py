"""diffusers pipelines on our built-in trained tiny models, to try the adapter with no weights
and no hub: the transformer converted through the registry's diffusers layout, the prompt
embedded by the model's own stage 1 (its word table), the schedule our pipeline samples with.

    pipe, inputs = tiny_pipeline("red circle moves right on blue")
    latents = pipe(**inputs).frames        # [1, 3, 4, 16, 16], the latents our stage 2 makes
"""

from __future__ import annotations

import math
import types

import diffusers
import numpy as np
import torch

import encoders
from encoders.request import Request
from modules.checkpoint import load_model
from modules.layouts import DIFFUSERS
from modules.registry import family_of
from sampling.pipelines import get_pipeline
from sampling.run import noise_for

WAN_SIGMA_MAX = 0.999  # Wan's UniPC grid starts there (sampling/schedulers.py)
TINY = ("wan-tiny-trained", "hunyuanvideo-tiny-trained")


class WanGridUniPC(diffusers.UniPCMultistepScheduler):
    """diffusers' UniPC on Wan's sigma grid: diffusers' own `set_timesteps(n)` starts at sigma 1,
    the official Wan (and our `unipc`) at 0.999."""

    def set_timesteps(self, num_inference_steps=None, device=None, **kwargs):
        super().set_timesteps(sigmas=np.linspace(WAN_SIGMA_MAX, 0, num_inference_steps + 1)[:-1],
                              device=device)


class GeometryVAE(torch.nn.Module):
    """What HunyuanVideo15Pipeline reads off its VAE when it only samples latents."""

    def __init__(self, channels: int):
        super().__init__()
        self.config = types.SimpleNamespace(latent_channels=channels)
        self.temporal_compression_ratio = self.spatial_compression_ratio = 1
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    device = property(lambda self: self.anchor.device)
    dtype = property(lambda self: self.anchor.dtype)


def fit_fixed_widths(model: torch.nn.Module, state: dict) -> None:
    """diffusers' HunyuanVideo15Transformer3DModel fixes two widths the released model has (the
    token refiner's MLP at 4x, the byT5 projection's 2048), which the tiny models trained here
    set smaller (bench/fixtures/train.py). Each linear whose weight in `state` has another shape
    is rebuilt at that shape: the forward only applies them, so the maths is the one the weights
    were trained with."""
    for name, module in list(model.named_modules()):
        weight = state.get(f"{name}.weight")
        if not isinstance(module, torch.nn.Linear) or weight is None \
                or tuple(weight.shape) == tuple(module.weight.shape):
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf,
                torch.nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None))


def diffusers_transformer(model) -> torch.nn.Module:
    """diffusers' transformer with the weights of our `model` (Wan2.2 or HunyuanVideo-1.5)."""
    fmt = family_of(model.config).format
    cls = getattr(diffusers, fmt.config_to_json(model.config, DIFFUSERS)["_class_name"])
    theirs = cls(**fmt.diffusers_config(model.config))
    state = fmt.to_diffusers(model.state_dict())
    fit_fixed_widths(theirs, state)
    theirs.load_state_dict(state, strict=True)
    return theirs.eval()


def _wan_pipeline(ours, transformers: dict, boundary_ratio):
    scheduler = WanGridUniPC(prediction_type="flow_prediction", use_flow_sigmas=True,
                             num_train_timesteps=1000, flow_shift=ours.shift)
    parts = ({"transformer": transformers[None]} if None in transformers else
             {"transformer": transformers["high"], "transformer_2": transformers["low"],
              "boundary_ratio": boundary_ratio})
    return diffusers.WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=scheduler,
                                 **parts)


def _hunyuan_pipeline(ours, transformers: dict, boundary_ratio):
    from diffusers.guiders import ClassifierFreeGuidance
    return diffusers.HunyuanVideo15Pipeline(
        text_encoder=None, tokenizer=None, transformer=transformers[None],
        vae=GeometryVAE(ours.latent_channels),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=ours.shift),
        text_encoder_2=None, tokenizer_2=None,
        guider=ClassifierFreeGuidance(guidance_scale=ours.guidance))


def _wan_inputs(ours, tensors: dict, shape, text_len) -> dict:
    # the latents are given, so the pixel size only meets WanPipeline's checks (it rounds and
    # warns otherwise): sizes its VAE strides would give
    def pad(c):
        return torch.nn.functional.pad(c.float(), (0, 0, 0, text_len - c.shape[1]))
    return dict(prompt_embeds=pad(tensors["prompt_embeds"]),
                negative_prompt_embeds=pad(tensors["negative_prompt_embeds"]),
                guidance_scale=ours.guidance, height=32 * math.ceil(shape[3] / 32),
                width=32 * math.ceil(shape[4] / 32), num_frames=4 * (shape[2] - 1) + 1)


def _hunyuan_inputs(ours, tensors: dict, shape, text_len) -> dict:
    kw = {f"{p}prompt_embeds{s}": tensors[f"{p}prompt_embeds{s}"].float()
          for p in ("", "negative_") for s in ("", "_2")}
    kw.update({f"{p}prompt_embeds_mask{s}": tensors[f"{p}prompt_embeds_mask{s}"]
               for p in ("", "negative_") for s in ("", "_2")})
    return kw


# family -> (its diffusers pipeline around our transformers, its call's keywords)
PIPELINE_OF = {"wan": (_wan_pipeline, _wan_inputs),
               "hunyuan_video15": (_hunyuan_pipeline, _hunyuan_inputs)}


def make_pipeline(ours, transformers: dict, boundary_ratio: float | None = None):
    """A diffusers pipeline for our pipeline `ours` around `transformers` (expert -> diffusers
    transformer: None, or "high" and "low"), sampling latents only."""
    pipe = PIPELINE_OF[ours.family][0](ours, transformers, boundary_ratio)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_inputs(ours, tensors: dict, shape, seed: int = 0, text_len: int | None = None) -> dict:
    """The pipeline call's keywords for stage-1 `tensors`: embeddings in the pipeline's names,
    the noise our stage 2 draws for `seed`, latents out."""
    common = dict(latents=noise_for(shape, seed), num_inference_steps=ours.steps,
                  output_type="latent", height=shape[3], width=shape[4], num_frames=shape[2])
    return {**common, **PIPELINE_OF[ours.family][1](ours, tensors, shape, text_len)}


def tiny_pipeline(prompt: str, model: str = "wan-tiny-trained", seed: int = 0):
    """(a diffusers pipeline on one of our built-in trained models, the keywords of its call for
    `prompt`): what `generate.py --model MODEL --prompt PROMPT` samples, through diffusers."""
    if model not in TINY:
        raise ValueError(f"model {model!r}: expected one of {', '.join(TINY)}")
    ours = get_pipeline(model)
    weights = load_model(ours.builtin_path)[0].eval()
    shape = ours.latent_shape(*ours.size)
    tensors, _ = encoders.for_pipeline(ours).encode(ours, Request(prompt), None, device="cpu")
    pipe = make_pipeline(ours, {None: diffusers_transformer(weights)})
    return pipe, call_inputs(ours, tensors, shape, seed,
                             getattr(weights.config, "text_len", None))


def our_trajectory(ours, models: dict, tensors: dict, shape, config, seed: int = 0):
    """The same trajectory on our torch backend (sampling.run): what the adapter must equal."""
    from sampling.run import make_sample, sample_once
    from sampling.stages import SignalPlan
    from torch_backend.backend import TorchBackend
    backend = TorchBackend(dict(models), SignalPlan.from_config(config))
    sample = make_sample(backend, ours, tensors, shape, image=False, seed=seed)
    return sample_once(backend, config, sample, solver=ours.solver, steps=ours.steps,
                       shift=ours.shift)

"""Tiny diffusers pipelines on our trained weights (adapters/diffusers/tiny.py: converted through
the registry's diffusers layout, on the schedule our pipeline samples with), and the same
trajectory on our torch backend: what the adapter tests compare."""

from __future__ import annotations

import argparse
import dataclasses

import torch

from adapters.diffusers.tiny import (
    call_inputs,
    diffusers_transformer,
    make_pipeline,
    our_trajectory,
)
from cache.flags import config_of
from commands.stage2_backend import load_models
from modules.checkpoint import load_model
from sampling.cache_cli import add_cache_arguments, cache_flags
from sampling.pipelines import get_pipeline

SECOND = "bench/fixtures/heldout/tiny-wan-ti2v-seed7"  # a second Wan of the same shape


def cache_config(flags: list[str]):
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    return config_of(cache_flags(parser.parse_args(flags)))


def settings(flags: list[str]) -> dict:
    """enable_cache's keywords for CLI flags."""
    out, it = {}, iter(flags)
    for flag in it:
        key = flag[2:]
        if key in ("teacache", "fbcache", "deepcache", "enable_cache", "magcache"):
            out[key] = True
        else:
            out[key] = next(it)
    return out


@dataclasses.dataclass
class Case:
    """One pipeline (ours and diffusers') on the same weights and inputs."""

    ours: object  # our Pipeline
    models: dict  # expert -> our model
    tensors: dict
    shape: tuple
    boundary_ratio: float | None = None

    def make(self):
        return make_pipeline(self.ours, {e: diffusers_transformer(m)
                                         for e, m in self.models.items()}, self.boundary_ratio)

    def call(self, pipe, **kwargs):
        inputs = call_inputs(self.ours, self.tensors, self.shape,
                             text_len=getattr(self.ours.config, "text_len", None))
        if self.ours.moe:  # high above the boundary, low below (T6)
            low, high = self.ours.guidance
            inputs.update(guidance_scale=high, guidance_scale_2=low)
        return pipe(**inputs, **kwargs).frames

    def our_run(self, flags: list[str]):
        return our_trajectory(self.ours, self.models, self.tensors, self.shape,
                              cache_config(flags))


def _case(name: str, two_experts: bool = False) -> Case:
    ours = get_pipeline(name)
    if ours.builtin_path is None:  # tiny random weights, drawn as stage 2 draws them
        models = load_models(ours, None, torch.float32)
        shape = ours.latent_shape(*ours.size)
        return Case(ours, {e: m.eval() for e, m in models.items()},
                    ours.synthesize(shape, True, False, 0), shape)
    model = load_model(ours.builtin_path)[0].eval()
    models, ratio = {None: model}, None
    if two_experts:  # the A14B layout on two trained Wans of one shape
        models = {"high": load_model(SECOND)[0].eval(), "low": model}
        ours = dataclasses.replace(ours, experts=(("high", name), ("low", name)),
                                   boundary=875.0, guidance=(3.0, 5.0))
        ratio = 0.875
    shape = ours.latent_shape(*ours.size)
    return Case(ours, models, ours.synthesize(shape, True, False, 0), shape, ratio)


def wan_case(two_experts: bool = False) -> Case:
    return _case("wan-tiny-trained", two_experts)


def hunyuan_case() -> Case:
    return _case("hunyuanvideo-tiny-trained")


def random_case(name: str) -> Case:
    """A pipeline whose model has tiny random weights (wan-tiny-ti2v, hunyuanvideo-tiny)."""
    return _case(name)

"""Tiny image-to-video diffusers pipelines on our random-weight models, for the adapter's I2V
tests (tests/test_diffusers_i2v.py): everything a real call runs but the text encoders.

    WanImageToVideoPipeline            Wan2.2 I2V-A14B layout: "wan-tiny-i2v"'s two experts
                                       (transformer = high noise, transformer_2 = low noise,
                                       boundary_ratio), a tiny random AutoencoderKLWan encoding
                                       the image, no image encoder (A14B has none)
    HunyuanVideo15ImageToVideoPipeline HunyuanVideo-1.5 I2V: a tiny random
                                       AutoencoderKLHunyuanVideo15 encoding the image, a tiny
                                       random SigLIP giving its image tokens, the CFG guider

The transformers are our models converted (adapters/diffusers/tiny.diffusers_transformer); the
VAEs are the architectures stage 3 decodes with (modules.vae, small channel counts). The prompt
embeddings are passed directly, the latents too (the noise our stage 2 draws for the seed).
`conditioning` reads back what the pipeline handed its transformer (the image latent and mask
channels, the SigLIP tokens), so our torch backend can run the same trajectory (`our_run`).
"""

from __future__ import annotations

import dataclasses
import math

import diffusers
import numpy as np
import PIL.Image
import torch

from adapters.diffusers.tiny import WanGridUniPC, diffusers_transformer
from commands.stage2_backend import load_models
from modules.vae import spec_for
from sampling.pipelines import Pipeline, get_pipeline
from sampling.run import noise_for
from tests.diffusers_pipelines import cache_config

STEPS = 8  # few steps: a call is a fraction of a second on 2 CPU cores
SEED = 7  # the VAE's, SigLIP's and the image's


def random_image(width: int, height: int, seed: int = SEED) -> PIL.Image.Image:
    """A random RGB image of width x height pixels."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels)



def _seeded(build, seed: int = SEED):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().eval()


def wan_vae(ours: Pipeline) -> torch.nn.Module:
    """A tiny random AutoencoderKLWan of the Wan2.1 VAE's structure (strides 4, 8) with z_dim the
    model's latent channels, and latent statistics that are not the identity (the pipeline
    normalises the image latent with them)."""
    spec, z = spec_for(ours), ours.latent_channels
    cfg = {**spec.tiny_config(z), "latents_mean": [0.1 * (i - 1) for i in range(z)],
           "latents_std": [0.5 + 0.5 * i for i in range(z)]}
    return _seeded(lambda: diffusers.AutoencoderKLWan(**cfg))


def hunyuan_vae(ours: Pipeline) -> torch.nn.Module:
    """A tiny random AutoencoderKLHunyuanVideo15 (strides 4, 16) with the model's latent channels."""
    spec = spec_for(ours)
    return _seeded(lambda: diffusers.AutoencoderKLHunyuanVideo15(
        **spec.tiny_config(ours.latent_channels)))


def siglip(ours: Pipeline):
    """(a tiny random SiglipVisionModel giving the model's vision_len tokens of vision_dim, its
    image processor): the image encoder and feature extractor of HunyuanVideo-1.5 I2V."""
    from transformers import SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel
    cfg, patch = ours.config, 14
    size = patch * math.isqrt(cfg.vision_len)
    model = _seeded(lambda: SiglipVisionModel(SiglipVisionConfig(
        hidden_size=cfg.vision_dim, intermediate_size=2 * cfg.vision_dim, num_hidden_layers=1,
        num_attention_heads=2, image_size=size, patch_size=patch)))
    return model, SiglipImageProcessorPil(size={"height": size, "width": size},
                                          image_mean=[0.5] * 3, image_std=[0.5] * 3)


def target_size(height: int, width: int) -> int:
    """The transformer's `target_size` whose bucket list (the pipeline's
    calculate_default_height_width, 16-pixel patches) holds height x width: the image is then
    cropped to exactly that size instead of to a ~640 x 640 bucket."""
    return math.ceil(16 * math.sqrt(height * width / 256))


@dataclasses.dataclass
class I2VCase:
    """One tiny I2V pipeline: our pipeline and models, the stage-1 tensors its call passes (the
    prompt embeddings), the latent shape, the image and the parts the pipeline encodes with."""

    ours: Pipeline
    models: dict  # expert -> our model
    tensors: dict
    shape: tuple
    image: PIL.Image.Image
    parts: dict  # the VAE (and image encoder, feature extractor), shared by every make()
    boundary_ratio: float | None = None

    @property
    def pixels(self) -> tuple[int, int, int]:
        """(frames, height, width) of the video the latent shape decodes to."""
        (_, _, f, h, w), (st, ss) = self.shape, self.ours.vae_stride
        return st * (f - 1) + 1, ss * h, ss * w

    def transformers(self) -> dict:
        return {e: diffusers_transformer(m) for e, m in self.models.items()}

    def make(self):
        """A fresh pipeline (newly converted transformers, no gate)."""
        ours, t = self.ours, self.transformers()
        if ours.family == "wan":
            scheduler = WanGridUniPC(prediction_type="flow_prediction", use_flow_sigmas=True,
                                     num_train_timesteps=1000, flow_shift=ours.shift)
            pipe = diffusers.WanImageToVideoPipeline(
                tokenizer=None, text_encoder=None, vae=self.parts["vae"], scheduler=scheduler,
                image_processor=None, image_encoder=None, transformer=t["high"],
                transformer_2=t["low"], boundary_ratio=self.boundary_ratio)
        else:
            from diffusers.guiders import ClassifierFreeGuidance
            _, height, width = self.pixels
            t[None].register_to_config(target_size=target_size(height, width))
            pipe = diffusers.HunyuanVideo15ImageToVideoPipeline(
                text_encoder=None, tokenizer=None, transformer=t[None], vae=self.parts["vae"],
                scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=ours.shift),
                text_encoder_2=None, tokenizer_2=None,
                guider=ClassifierFreeGuidance(guidance_scale=ours.guidance),
                image_encoder=self.parts["image_encoder"],
                feature_extractor=self.parts["feature_extractor"])
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def inputs(self, seed: int = 0) -> dict:
        """The call's keywords: the image, the embeddings in the pipeline's names, our noise."""
        frames, height, width = self.pixels
        common = dict(image=self.image, latents=noise_for(self.shape, seed),
                      num_inference_steps=self.ours.steps, num_frames=frames,
                      output_type="latent")
        if self.ours.family == "wan":
            low, high = self.ours.guidance  # high above the boundary, low below (T6)
            text_len = self.ours.config.text_len

            def pad(c):
                return torch.nn.functional.pad(c.float(), (0, 0, 0, text_len - c.shape[1]))
            return dict(prompt_embeds=pad(self.tensors["prompt_embeds"]),
                        negative_prompt_embeds=pad(self.tensors["negative_prompt_embeds"]),
                        guidance_scale=high, guidance_scale_2=low, height=height, width=width,
                        **common)
        kw = {f"{p}prompt_embeds{s}": self.tensors[f"{p}prompt_embeds{s}"].float()
              for p in ("", "negative_") for s in ("", "_2")}
        kw.update({f"{p}prompt_embeds_mask{s}": self.tensors[f"{p}prompt_embeds_mask{s}"]
                   for p in ("", "negative_") for s in ("", "_2")})
        return {**kw, **common}

    def call(self, pipe, **kwargs) -> torch.Tensor:
        return pipe(**{**self.inputs(), **kwargs}).frames

    def conditioning(self) -> dict:
        """What a pipeline without the gate hands its transformer besides the noisy latent, as
        our stage-1 tensors: Wan "condition" ([mask 4 | image latent]); HunyuanVideo-1.5
        "image_latents" (frame 0 of the reference channels), "image_embeds" (the SigLIP
        tokens), and the mask channel it adds, for the caller to check."""
        seen = {}

        def record(module, args, kwargs):
            seen.setdefault("call", kwargs)

        pipe = self.make()
        for t in {pipe.transformer, getattr(pipe, "transformer_2", None)} - {None}:
            t.register_forward_pre_hook(record, with_kwargs=True)
        self.call(pipe, num_inference_steps=1)
        kw, c = seen["call"], self.ours.latent_channels
        x = kw["hidden_states"]
        if self.ours.family == "wan":
            return {"condition": x[:, c:].clone()}
        return {"image_latents": x[:, c:2 * c, :1].clone(), "mask": x[:, 2 * c:].clone(),
                "image_embeds": kw["image_embeds"].clone()}

    def our_run(self, flags: list[str]):
        """The same trajectory on our torch backend, given the conditioning the pipeline made."""
        from sampling.run import make_sample, sample_once
        from sampling.stages import SignalPlan
        from torch_backend.backend import TorchBackend
        config = cache_config(flags)
        tensors = {**self.tensors, **self.conditioning()}
        tensors.pop("mask", None)
        backend = TorchBackend(dict(self.models), SignalPlan.from_config(config))
        image = self.ours.family == "hunyuan_video15"  # Wan I2V reads "condition" either way
        sample = make_sample(backend, self.ours, tensors, self.shape, image=image, seed=0)
        return sample_once(backend, config, sample, solver=self.ours.solver,
                           steps=self.ours.steps, shift=self.ours.shift)


def _random(name: str, **replace) -> tuple[Pipeline, dict, dict, tuple]:
    ours = dataclasses.replace(get_pipeline(name), steps=STEPS, **replace)
    models = {e: m.eval() for e, m in load_models(ours, None, torch.float32).items()}
    shape = ours.latent_shape(*ours.size)
    return ours, models, ours.synthesize(shape, True, False, 0), shape


def wan_a14b_case() -> I2VCase:
    """Wan2.2 I2V-A14B's layout on "wan-tiny-i2v": two random experts, the switch at t = 900
    (boundary_ratio 0.9: 3 high-noise steps of 8, then 5 low-noise), CFG 5 above and 3 below."""
    ours, models, tensors, shape = _random("wan-tiny-i2v", guidance=(3.0, 5.0))
    (_, _, h, w), st = shape[1:], ours.vae_stride[1]
    return I2VCase(ours, models, tensors, shape, random_image(st * w, st * h),
                   {"vae": wan_vae(ours)}, boundary_ratio=ours.boundary / 1000)


def hunyuan_i2v_case(name: str = "hunyuanvideo-tiny-meanflow") -> I2VCase:
    """HunyuanVideo-1.5 I2V on a tiny random model: "hunyuanvideo-tiny-meanflow" (the
    step-distilled 480p_i2v's architecture: meanflow's timestep_r, no CFG), or
    "hunyuanvideo-tiny" run as 480p_i2v is (task i2v, CFG 6: both branches)."""
    ours, models, tensors, shape = _random(name, task="i2v")
    (_, _, h, w), st = shape[1:], ours.vae_stride[1]
    encoder, extractor = siglip(ours)
    return I2VCase(ours, models, tensors, shape, random_image(st * w, st * h),
                   {"vae": hunyuan_vae(ours), "image_encoder": encoder,
                    "feature_extractor": extractor})

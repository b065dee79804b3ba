"""HunyuanVideo-1.5 stage 1, the i2v image: its bucket and crop, the SigLIP states and the
first-frame VAE latent, with the checks of both models' files."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from .hunyuan_weights import (
    Layout,
    compare_shapes,
    finite,
    hf_load,
    meta_shapes,
    quiet,
    read_json,
    stored_shapes,
    strip_prefix,
)
from .request import EncoderInputError

BUCKET_STRIDE = 16
# target_size_config: bucket base size per resolution (480p: 640, 720p: 960)
BUCKET_BASE = {(480, 848): 640, (720, 1280): 960}


def bucket_base(pipeline) -> int:
    """The bucket base size of a pipeline's resolution (official target_size_config); for other
    sizes sqrt(H x W) rounded to a multiple of 8, which gives 640 and 960 for 480p and 720p too."""
    height, width = pipeline.size[:2]
    return BUCKET_BASE.get((height, width), round(math.sqrt(height * width) / 8) * 8)


def crop_size_list(base: int, stride: int = BUCKET_STRIDE, max_ratio: float = 4.0):
    """(height, width) buckets of about base^2 pixels (official generate_crop_size_list)."""
    patches = round((base / stride) ** 2)
    sizes, wp, hp = [], patches, 1
    while wp > 0:
        if max(wp, hp) / min(wp, hp) <= max_ratio:
            sizes.append((wp * stride, hp * stride))
        if (hp + 1) * wp <= patches:
            hp += 1
        else:
            wp -= 1
    return sizes


def image_size(width: int, height: int, base: int) -> tuple[int, int]:
    """(H, W) of the bucket whose h/w ratio is nearest the image's, the first on a tie (official
    get_closest_ratio; diffusers only considers one side of the ratio)."""
    buckets = crop_size_list(base)
    ratios = [round(h / w, 5) for h, w in buckets]
    aspect = height / width
    best = min(range(len(buckets)), key=lambda i: abs(ratios[i] - aspect))
    return buckets[best]


def cover_crop(image, height: int, width: int):
    """The image LANCZOS-resized to cover (height, width) with rounded sizes, centre-cropped
    (official resize_and_center_crop for SigLIP and the Resize + CenterCrop of the VAE input:
    both crop the same box)."""
    from PIL import Image

    if image.size == (width, height):
        return image
    scale = max(width / image.width, height / image.height)
    size = (int(round(image.width * scale)), int(round(image.height * scale)))
    resized = image.resize(size, Image.LANCZOS)
    left, top = int(round((size[0] - width) / 2.0)), int(round((size[1] - height) / 2.0))
    return resized.crop((left, top, left + width, top + height))


def open_image(path: str):
    """The request's image as RGB, decoded in full; EncoderInputError when it cannot be."""
    from PIL import Image, UnidentifiedImageError

    if not os.path.isfile(path):
        raise EncoderInputError("--image", f"{path} does not exist" if not os.path.exists(path)
                                else f"{path} is not a file", "an image file (PNG, JPEG, WebP, ...)")
    try:
        with Image.open(path) as img:
            img.load()
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise EncoderInputError("--image", f"{path} cannot be decoded ({type(exc).__name__}: "
                                f"{' '.join(str(exc).split())})",
                                "an image file PIL can read (PNG, JPEG, WebP, ...)") from None


def check_siglip(layout: Layout, root: Path, pipeline) -> None:
    from transformers import SiglipVisionConfig, SiglipVisionModel

    folder = root / layout.image_encoder
    raw = read_json(folder / "config.json", "the SigLIP image encoder's config.json")
    if raw.get("model_type") != "siglip_vision_model":
        raise EncoderInputError(str(folder / "config.json"), f"describes a "
                                f"{raw.get('model_type')!r} model", "a SigLIP vision model "
                                "(model_type siglip_vision_model)")
    config = hf_load(SiglipVisionConfig.from_pretrained, folder, "a SigLIP vision config.json")
    cfg = pipeline.config
    tokens = (config.image_size // config.patch_size) ** 2
    if config.hidden_size != cfg.vision_dim or tokens != cfg.vision_len:
        raise EncoderInputError(str(folder / "config.json"), f"describes a SigLIP of width "
                                f"{config.hidden_size} giving {tokens} tokens",
                                f"width {cfg.vision_dim} and {cfg.vision_len} tokens (what the "
                                f"{pipeline.name} DiT reads)")
    stored = {strip_prefix(k, ("vision_model.",)): v for k, v in stored_shapes(folder, "SigLIP").items()}
    expected = {strip_prefix(k, ("vision_model.",)): v
                for k, v in meta_shapes(SiglipVisionModel, config).items()}
    compare_shapes(str(folder), "SigLIP", expected, stored)
    read_json(root / layout.feature_extractor / "preprocessor_config.json",
               "the SigLIP feature extractor's preprocessor_config.json")


def check_vae(layout: Layout, root: Path, pipeline) -> None:
    folder = root / layout.vae
    config = read_json(folder / "config.json", "the HunyuanVideo-1.5 VAE's config.json")
    channels = config.get("latent_channels")
    if channels != pipeline.latent_channels:
        raise EncoderInputError(str(folder / "config.json"), f"describes a VAE of "
                                f"{channels} latent channels", f"the HunyuanVideo-1.5 VAE of "
                                f"{pipeline.latent_channels} latent channels")


def load_siglip(root: Path, layout: Layout, dtype, device):
    # the PIL processor, as the official transformers 4.57.1 runs it (5.x picks a torchvision
    # backend when torchvision is installed: another resize)
    from transformers import SiglipImageProcessorPil, SiglipVisionModel
    quiet()
    folder = root / layout.image_encoder
    model = SiglipVisionModel.from_pretrained(str(folder), dtype=dtype)
    processor = SiglipImageProcessorPil.from_pretrained(str(root / layout.feature_extractor))
    return finite(model, str(folder)).to(device).eval(), processor


def load_vae(root: Path, layout: Layout, pipeline, dtype, device):
    from diffusers.utils import logging

    from modules.vae import VaeError, load_vae, spec_for

    logging.set_verbosity_error()  # from_pretrained's advice to install accelerate
    try:
        vae = load_vae(spec_for(pipeline), str(root / layout.vae), dtype=dtype)
    except VaeError as exc:
        raise EncoderInputError(str(root / layout.vae), str(exc).removeprefix("--vae_path "),
                                "the HunyuanVideo-1.5 VAE (diffusers or official layout)") from None
    return vae.to(device)


@torch.no_grad()
def siglip_states(model, processor, image, device="cpu"):
    """[1, tokens, width] float32: SigLIP last_hidden_state of the cropped image."""
    import numpy as np
    pixels = processor.preprocess(images=np.array(image), return_tensors="pt")["pixel_values"]
    return model(pixel_values=pixels.to(device, model.dtype)).last_hidden_state.float().cpu()


@torch.no_grad()
def first_frame_latent(vae, image, device="cpu"):
    """[1, C, 1, H/16, W/16] float32: the VAE latent mode of the cropped image in [-1, 1],
    times scaling_factor (official get_image_condition_latents)."""
    import numpy as np
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).float().div(255)
    pixels = ((pixels - 0.5) / 0.5)[None, :, None]  # ToTensor + Normalize([0.5], [0.5])
    latent = vae.encode(pixels.to(device, vae.dtype)).latent_dist.mode()
    return (latent * vae.config.scaling_factor).float().cpu()

"""Stage 1 of the Wan2.2 pipelines: umT5 prompt embeddings for every task, TI2V-5B's first-frame
latent, I2V-A14B's condition; S2V's audio features and reference latent come from `wan_audio`.

`weights` is a release folder (official layout: models_t5_umt5-xxl-enc-bf16.pth, google/umt5-xxl/,
Wan2.1_VAE.pth or Wan2.2_VAE.pth) or a diffusers pipeline folder (text_encoder/, tokenizer/,
vae/); None builds tiny random encoders once per process in a temporary diffusers-layout folder
and loads them from there like any other.

Official preprocessing (Wan-Video/Wan2.2@42bf4cf; stage1_encoders.md section 2):
- text: `encoders.umt5` (cleaning, text_len padding and truncation, the real-length rows);
  negative prompt "" or absent -> the config's `sample_neg_prompt`.
- TI2V image (textimage2video.py `i2v`): the output size from `best_output_size` within the
  requested area (the image decides the aspect), LANCZOS resize to cover, centre crop,
  [-1, 1], Wan2.2 VAE mean, normalised per channel.
- I2V (image2video.py): size from the area and the image's aspect floored to 16 px, the image
  stretched to it by bicubic interpolation on the tensor (no crop), followed by F-1 zero frames
  through the Wan2.1 VAE; the 4-channel mask marks latent frame 0.
Tensor names and shapes are `Pipeline.stage1_specs`'. Text is bf16 (the official t5_dtype);
latents are fp32.
"""

from __future__ import annotations

import atexit
import json
import math
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from modules.layouts import CheckpointError
from modules.safetensors_reader import read_header
from modules.vae import (
    TINY_VAE_SEED,
    VaeError,
    build_tiny,
    from_vae_latents,
    latent_channels,
    load_vae,
    one_line,
    spec_for,
)
from sampling.pipelines import SizeError

from . import umt5
from .request import EncoderInputError

# The official default negative prompts (used when the negative prompt is absent or ""):
# wan/configs/shared_config.py (T2V, I2V, TI2V) and wan/configs/wan_s2v_14B.py (S2V).
NEGATIVE_PROMPT = (
    "色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，"
    "JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的"
    "肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走")
S2V_NEGATIVE_PROMPT = (
    "画面模糊，最差质量，画面模糊，细节模糊不清，情绪激动剧烈，手快速抖动，字幕，丑陋的，残缺的，多余的手指，"
    "画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，"
    "三条腿，背景人很多，倒着走")

# the VAE files of the official releases (wan/configs/*.py vae_checkpoint); diffusers: vae/
OFFICIAL_VAES = {"wan2.1-vae": "Wan2.1_VAE.pth", "wan2.2-vae": "Wan2.2_VAE.pth"}
DIFFUSERS_VAE = "vae"

# what the tiny tokenizer's vocabulary is counted from (encoders.umt5._tiny_tokenizer)
_TINY_CORPUS = (
    "a red circle moves to the left on a white background",
    "a blue square moves right, a green triangle moves up and a yellow star moves down",
    "a person speaks to the camera in a bright room; the cat sat on the mat",
    NEGATIVE_PROMPT, S2V_NEGATIVE_PROMPT)


def default_negative_prompt(pipeline) -> str:
    return S2V_NEGATIVE_PROMPT if pipeline.task == "s2v" else NEGATIVE_PROMPT


def negative_prompt(pipeline, request) -> str:
    """The negative prompt encoded: the request's, or the official default when it is absent
    or "" (the official `if n_prompt == "": n_prompt = sample_neg_prompt`)."""
    return request.negative_prompt or default_negative_prompt(pipeline)


# --- sizes ----------------------------------------------------------------------------------------

def _max_area(pipeline, request) -> int:
    if (request.height is None) != (request.width is None):
        given, other = ("--height", "--width") if request.width is None else ("--width", "--height")
        raise EncoderInputError(given, f"given without {other}",
                                "both or neither: with an image they set the area it is fitted into")
    height, width = ((request.height, request.width) if request.height is not None
                     else pipeline.size[:2])
    if height <= 0 or width <= 0:
        raise EncoderInputError("--height" if height <= 0 else "--width", "is not positive",
                                "a positive size")
    return height * width


def best_output_size(w: int, h: int, dw: int, dh: int, expected_area: int) -> tuple[int, int]:
    """(width, height) as wan/utils/utils.py `best_output_size`: multiples of (dw, dh) within
    the area, width-first or height-first, whichever keeps the aspect better. None where the
    official function divides by zero (an aspect no such size approaches)."""
    ratio = w / h
    ow = (expected_area * ratio) ** 0.5
    oh = expected_area / ow
    ow1 = int(ow // dw * dw)
    oh1 = int(expected_area / ow1 // dh * dh) if ow1 else 0
    oh2 = int(oh // dh * dh)
    ow2 = int(expected_area / oh2 // dw * dw) if oh2 else 0
    if 0 in (ow1, oh1, oh2, ow2):
        return None
    ratio1, ratio2 = ow1 / oh1, ow2 / oh2
    if max(ratio / ratio1, ratio1 / ratio) < max(ratio / ratio2, ratio2 / ratio):
        return ow1, oh1
    return ow2, oh2


def output_size(pipeline, request, image_width: int, image_height: int) -> tuple[int, int]:
    """(height, width) of the video for an image of the given size, as the official code
    derives it from the requested area (`--size` H*W; default the pipeline's)."""
    area = _max_area(pipeline, request)
    stride, patch = pipeline.vae_stride[1], pipeline.config.patch_size[1]
    if pipeline.task == "ti2v":
        size = best_output_size(image_width, image_height, stride * patch, stride * patch, area)
        if size is None:
            raise EncoderInputError("--image", f"a {image_width}x{image_height} image has no "
                                    f"size of multiples of {stride * patch} px within {area} px",
                                    "an image of a less extreme aspect ratio")
        return size[1], size[0]
    ratio = image_height / image_width
    lat_h = round(math.sqrt(area * ratio) // stride // patch * patch)
    lat_w = round(math.sqrt(area / ratio) // stride // patch * patch)
    return lat_h * stride, lat_w * stride


# --- images ---------------------------------------------------------------------------------------

def load_image(path: str):
    """The image as the official generate.py opens it (`Image.open(path).convert("RGB")`),
    decoded in full so a truncated file fails here."""
    from PIL import Image, UnidentifiedImageError

    expected = "an image file PIL decodes (PNG, JPEG, WebP, ...)"
    if not Path(path).is_file():
        problem = "is a folder" if Path(path).is_dir() else "does not exist"
        raise EncoderInputError("--image", f"{path} {problem}", expected)
    try:
        with Image.open(path) as image:
            image.load()
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as exc:
        reason = one_line(exc) or type(exc).__name__
        raise EncoderInputError("--image", f"{path} cannot be decoded ({reason})", expected) \
            from None


def _to_tensor(image) -> torch.Tensor:
    """torchvision's `to_tensor` of an RGB image: [3, H, W] float in [0, 1]."""
    data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return data.view(image.height, image.width, 3).permute(2, 0, 1).float().div(255)


def ti2v_frame(image, height: int, width: int) -> torch.Tensor:
    """[1, 3, 1, H, W] in [-1, 1]: LANCZOS-resized to cover (H, W), centre-cropped."""
    from PIL import Image

    scale = max(width / image.width, height / image.height)
    image = image.resize((round(image.width * scale), round(image.height * scale)), Image.LANCZOS)
    x1, y1 = (image.width - width) // 2, (image.height - height) // 2
    image = image.crop((x1, y1, x1 + width, y1 + height))
    return _to_tensor(image).sub_(0.5).div_(0.5)[None, :, None]


def i2v_video(image, height: int, width: int, frames: int) -> torch.Tensor:
    """[1, 3, F, H, W]: the image in [-1, 1] stretched to (H, W) by bicubic interpolation,
    then F-1 zero frames."""
    first = F.interpolate(_to_tensor(image).sub_(0.5).div_(0.5)[None], size=(height, width),
                          mode="bicubic")
    return torch.cat([first[:, :, None], torch.zeros(1, 3, frames - 1, height, width)], dim=2)


def vae_encode(vae, video: torch.Tensor) -> torch.Tensor:
    """The normalised VAE mean of a [1, 3, F, H, W] video, fp32 on the CPU."""
    device = next(vae.parameters()).device
    with torch.no_grad():
        latents = vae.encode(video.to(device)).latent_dist.mode().float()
    return from_vae_latents(vae, latents).cpu()


def i2v_condition(latents: torch.Tensor, frames: int, temporal_stride: int) -> torch.Tensor:
    """[mask 4 | latents]: the mask is 1 on the pixel frames of the image (frame 0, repeated
    to fill latent frame 0's `temporal_stride` frames), 0 elsewhere."""
    _, _, _, lat_h, lat_w = latents.shape
    mask = torch.ones(1, frames, lat_h, lat_w)
    mask[:, 1:] = 0
    mask = torch.cat([mask[:, :1].repeat_interleave(temporal_stride, dim=1), mask[:, 1:]], dim=1)
    mask = mask.view(1, mask.shape[1] // temporal_stride, temporal_stride, lat_h, lat_w)
    return torch.cat([mask.transpose(1, 2), latents], dim=1)


# --- what a request needs -------------------------------------------------------------------------

def _takes_image(pipeline, request) -> bool:
    return pipeline.task in ("ti2v", "i2v") and request.image is not None


def _image_plan(pipeline, request):
    if pipeline.task == "s2v":  # the reference image is wan_audio's
        return None, None
    if request.audio is not None:
        raise EncoderInputError("--audio", f"given to {pipeline.name}, a {pipeline.task} "
                                "pipeline", "no audio (speech drives the s2v pipelines only)")
    if request.image is None:
        if pipeline.task == "i2v":
            raise EncoderInputError("--image", "is missing", f"the first frame that "
                                    f"{pipeline.name} animates (image-to-video)")
        return None, None
    if not _takes_image(pipeline, request):
        raise EncoderInputError("--image", f"given to {pipeline.name}, a {pipeline.task} "
                                "pipeline", "no image")
    image = load_image(request.image)
    height, width = output_size(pipeline, request, image.width, image.height)
    frames = pipeline.size[2] if request.frames is None else request.frames
    try:
        pipeline.latent_shape(height, width, frames)
    except SizeError as exc:
        flag = "--video_length" if exc.name == "video_length" else "--image"
        raise EncoderInputError(flag, f"a {image.width}x{image.height} image gives a "
                                f"{width}x{height} video of {frames} frames, and {exc.name} "
                                f"{exc.value} does not fit", exc.expected) from None
    return image, (height, width, frames)


def _check_vae_folder(pipeline, folder: Path) -> None:
    spec = spec_for(pipeline)
    expected = f"a diffusers {spec.class_name} folder of {pipeline.latent_channels} latent channels"
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EncoderInputError(str(folder), f"has no readable config.json ({type(exc).__name__})",
                                expected) from None
    if not isinstance(config, dict) or config.get("_class_name") != spec.class_name \
            or config.get("z_dim") != pipeline.latent_channels:
        found = (config.get("_class_name"), config.get("z_dim")) if isinstance(config, dict) else None
        raise EncoderInputError(str(folder), f"holds a VAE (class, z_dim) {found}", expected)
    try:
        for file in sorted(folder.glob("*.safetensors")):
            read_header(file)
    except CheckpointError as exc:
        raise EncoderInputError(str(folder), one_line(exc), expected) from None


def _vae_path(pipeline, weights: Path, layout: str) -> Path:
    spec = spec_for(pipeline)
    if layout == umt5.OFFICIAL:
        path = weights / OFFICIAL_VAES[spec.name]
        if not path.is_file():
            raise EncoderInputError(str(path), "is missing", f"the {spec.name} weights of the "
                                    f"release, which encode the {pipeline.name} image")
        return path
    path = weights / DIFFUSERS_VAE
    if not path.is_dir():
        raise EncoderInputError(str(path), "is missing", f"the {spec.name} folder of the "
                                f"diffusers pipeline, which encodes the {pipeline.name} image")
    _check_vae_folder(pipeline, path)
    return path


def _check_family(pipeline) -> None:
    if pipeline.family != "wan":
        raise ValueError(f"encoders.wan encodes for the Wan pipelines, not {pipeline.name}")


def _weight_files(pipeline, weights, image: bool) -> tuple[umt5.TextFiles, Path | None]:
    """The text encoder files and (for an image) the VAE of a weights folder, checked."""
    text = umt5.locate(weights)
    umt5.check_files(text, pipeline.config.text_dim)
    return text, _vae_path(pipeline, Path(weights), text.layout) if image else None


# --- tiny weights ---------------------------------------------------------------------------------

_TINY: dict[tuple, Path] = {}


def tiny_weights(pipeline, image: bool = False) -> Path:
    """A diffusers-layout folder of tiny random encoders for `pipeline` (umT5 of its text_dim;
    with `image`, its VAE with its latent channels), built once per process."""
    spec, channels = spec_for(pipeline), pipeline.latent_channels
    key = (pipeline.config.text_dim, spec.name, channels)
    root = _TINY.get(key)
    if root is None:
        root = Path(tempfile.mkdtemp(prefix="wan-tiny-encoders-"))
        atexit.register(shutil.rmtree, root, True)
        umt5.write_tiny(root, pipeline.config.text_dim, _TINY_CORPUS)
        _TINY[key] = root
    if image and not (root / DIFFUSERS_VAE).is_dir():
        # the tiny VAE stage 3 decodes with
        build_tiny(spec, channels, seed=TINY_VAE_SEED).save_pretrained(str(root / DIFFUSERS_VAE))
    return root


# --- the family contract --------------------------------------------------------------------------

def check(pipeline, request, weights) -> None:
    """Everything that can be refused before model work: the image (present where required,
    decodable, a size that fits), the tokenizer folder's files, the text encoder's and VAE's
    headers; S2V's audio and reference image through `wan_audio.check`."""
    _check_family(pipeline)
    _, size = _image_plan(pipeline, request)
    if weights is not None:
        _weight_files(pipeline, weights, image=size is not None)
    if pipeline.task == "s2v":
        from . import wan_audio

        wan_audio.check(pipeline, request, weights)


def _load_vae(pipeline, path: Path, device):
    spec = spec_for(pipeline)
    try:
        vae = load_vae(spec, str(path))
    except VaeError as exc:
        raise EncoderInputError(str(path), one_line(exc).removeprefix("--vae_path "),
                                f"the {spec.name} weights") from None
    if latent_channels(vae) != pipeline.latent_channels:
        raise EncoderInputError(str(path), f"encodes {latent_channels(vae)} latent channels",
                                f"{pipeline.latent_channels}, the {pipeline.name} latents'")
    return vae.to(device)


def _text_tensors(pipeline, request, files: umt5.TextFiles, device) -> dict:
    tokenizer = umt5.load_tokenizer(files.tokenizer)
    model = umt5.load_encoder(files, pipeline.config.text_dim, umt5.TEXT_DTYPE, device,
                              tokens=len(tokenizer))
    text_len = pipeline.config.text_len
    return {"prompt_embeds": umt5.encode(tokenizer, model, request.prompt, text_len),
            "negative_prompt_embeds": umt5.encode(tokenizer, model,
                                                  negative_prompt(pipeline, request), text_len)}


def encode(pipeline, request, weights, device="cpu") -> tuple[dict, dict]:
    """(stage-1 tensors, the generation-config fields the image decides) for one request."""
    _check_family(pipeline)
    image, size = _image_plan(pipeline, request)
    root = weights if weights is not None else tiny_weights(pipeline, image=size is not None)
    text, vae_path = _weight_files(pipeline, root, image=size is not None)
    vae = _load_vae(pipeline, vae_path, device) if vae_path is not None else None
    tensors, config = _text_tensors(pipeline, request, text, device), {}
    if size is not None:
        height, width, frames = size
        config = {"height": height, "width": width, "video_length": frames}
        if pipeline.task == "ti2v":
            tensors["image_latents"] = vae_encode(vae, ti2v_frame(image, height, width))
        else:
            latents = vae_encode(vae, i2v_video(image, height, width, frames))
            tensors["condition"] = i2v_condition(latents, frames, pipeline.vae_stride[0])
    if pipeline.task == "s2v":
        from . import wan_audio

        audio, config = wan_audio.encode(pipeline, request, weights, device)
        clash = sorted(set(audio) & set(tensors))
        if clash:
            raise ValueError(f"wan_audio.encode returned text tensors {clash}")
        tensors.update(audio)
    return tensors, dict(config)

"""Wan2.2 S2V stage-1 inputs other than text: the speech's wav2vec2 features, resampled to the
video's 16 fps and bucketed into whole clips (`audio_embeds`), and the reference image's Wan2.1
VAE latent (`ref_latents`), as the official code makes them (Wan-Video/Wan2.2@42bf4cf
`wan/speech2video.py` `encode_audio`, `get_size_less_than_area`, `generate`;
`wan/modules/s2v/audio_encoder.py`).

    audio   librosa.load(sr=16000): soundfile decode to float32, channel mean, soxr HQ resample to
            16 kHz, fixed to ceil(N * 16000 / sr) samples
         -> Wav2Vec2FeatureExtractor (zero mean, unit variance) -> wav2vec2, fp32, all 25 hidden
            states [25, T, D], T = 50 per second (the last one after the encoder's final
            LayerNorm, as transformers <= 5.0 returns it: reference trap 1)
         -> linear interpolation (align_corners) to T30 = int(T / 50 * 30) rows at 30 fps
         -> clips = int(T30 / (F * 30 / 16)) + 1 (F frames a clip), video frame k takes row
            round_half_even(k * 30 / 16) or zeros past the audio -> [1, 25, D, clips * F], bf16
    image   size = the largest 64-multiple size (H, W) whose area fits height x width (the
            official --size; the image decides the aspect), shorter side resized to min(H, W)
            (PIL bilinear), centre crop to (H, W) padding black, [-1, 1] -> Wan2.1 VAE mean,
            normalised per channel -> [1, 16, 1, H/8, W/8], fp32

Weights: the Wan2.2-S2V-14B release folder (official layout): `wav2vec2-large-xlsr-53-english/`
(config.json, preprocessor_config.json, model.safetensors or pytorch_model.bin) and
`Wan2.1_VAE.pth`; a diffusers `vae/` folder (AutoencoderKLWan) may stand for the .pth. diffusers
(0.42.1) has no S2V pipeline, so there is no diffusers layout for the audio encoder. weights=None:
a tiny random wav2vec2 (the large layout, the tiny pipeline's dims) and tiny VAE are written in
that layout to a temporary folder and loaded from it like a real one.

Two deliberate differences from the official code, both refusals of input it would accept:
`clips` beyond what the audio holds is refused (official: silently lowered), and silent audio
(RMS below -80 dBFS, where the zero-mean unit-variance normalisation amplifies noise or divides
by ~0) is refused.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from modules.vae import TINY_VAE_SEED  # the seed stage 3 builds its tiny VAE with

from .request import EncoderInputError, Request

WAV2VEC_DIR = "wav2vec2-large-xlsr-53-english"  # wan/configs/wan_s2v_14B.py `wav2vec`
WAV2VEC_WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # transformers' order of preference
VAE_FILE = "Wan2.1_VAE.pth"  # wan_s2v_14B.py `vae_checkpoint`
VAE_DIR = "vae"  # diffusers layout of the same VAE

SAMPLE_RATE = 16000  # librosa.load(sr=16000)
FEATURE_FPS = 50  # wav2vec2 frames a second at 16 kHz (convolution stride 320)
BUCKET_FPS = 30  # AudioEncoder.video_rate
VIDEO_FPS = 16  # wan shared config sample_fps; get_audio_embed_bucket_fps(fps=16)
SIZE_DIVISOR = 64  # get_size_less_than_area(divisor=64)
SILENCE_RMS = 1e-4  # -80 dBFS: below one 16-bit LSB of dither, the file holds no speech
TINY_SEED = 0  # the tiny wav2vec2's weights
TINY_MAX_DIM = 64  # weights=None builds random encoders only this small (the tiny pipelines)
AUDIO_DTYPE = torch.bfloat16  # encode_audio casts to param_dtype (bf16)


# --- reading the inputs ----------------------------------------------------------------------------

def _check_file(path: str, flag: str, expected: str) -> None:
    if not os.path.exists(path):
        raise EncoderInputError(flag, "no such file", expected)
    if not os.path.isfile(path):
        raise EncoderInputError(flag, "not a regular file", expected)


def read_audio(path: str) -> np.ndarray:
    """The speech as librosa.load(path, sr=16000) gives it: float32 mono at 16 kHz."""
    import soundfile as sf
    import soxr

    flag = f"--audio {path}"
    expected = "a speech recording libsndfile decodes (WAV, FLAC, OGG or MP3)"
    _check_file(path, flag, expected)
    try:
        with sf.SoundFile(path) as f:
            rate = f.samplerate
            samples = f.read(frames=-1, dtype="float32", always_2d=False).T
    except Exception as exc:  # noqa: BLE001 - any decode failure is the same user error
        raise EncoderInputError(flag, f"cannot be decoded ({_one_line(exc)})", expected) from None
    if samples.size == 0:
        raise EncoderInputError(flag, "holds no samples", expected)
    if not np.isfinite(samples).all():  # librosa.util.valid_audio refuses these too
        raise EncoderInputError(flag, "holds NaN or Inf samples", expected)
    if samples.ndim > 1:  # librosa.to_mono: the mean over channels
        samples = np.mean(samples, axis=tuple(range(samples.ndim - 1)))
    if rate != SAMPLE_RATE:  # librosa.resample(res_type="soxr_hq", fix=True)
        length = int(np.ceil(samples.shape[-1] * float(SAMPLE_RATE) / rate))
        samples = soxr.resample(samples, rate, SAMPLE_RATE, quality="soxr_hq")
        samples = samples[:length] if samples.shape[-1] >= length else \
            np.pad(samples, (0, length - samples.shape[-1]))
    return np.ascontiguousarray(samples, dtype=np.float32)


def read_image(path: str):
    """The reference image as RGB (official: Image.open(path).convert('RGB'))."""
    from PIL import Image

    flag = f"--image {path}"
    expected = "the reference image (a file PIL decodes: PNG, JPEG, ...)"
    _check_file(path, flag, expected)
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except Exception as exc:  # noqa: BLE001
        raise EncoderInputError(flag, f"cannot be decoded ({_one_line(exc)})", expected) from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# --- the official size and reference-image preprocessing ------------------------------------------

def size_less_than_area(height: int, width: int, target_area: int, divisor: int = SIZE_DIVISOR):
    """(H, W): official WanS2V.get_size_less_than_area, the largest scale of the image whose size
    padded up to multiples of 64 fits `target_area` (its b**2 - 2ac is kept as released)."""
    if height * width <= target_area:
        max_upper_area, min_scale, max_scale = target_area, 0.1, 1.0
    else:
        max_upper_area = target_area
        d = divisor - 1
        b = d * (height + width)
        a = height * width
        c = d ** 2 - max_upper_area
        min_scale = (-b + math.sqrt(b ** 2 - 2 * a * c)) / (2 * a)
        max_scale = math.sqrt(max_upper_area / (height * width))
    for i in range(100):
        scale = max_scale - (max_scale - min_scale) * i / 100
        new_height, new_width = int(height * scale), int(width * scale)
        padded_height = new_height + (64 - new_height % 64) % 64
        padded_width = new_width + (64 - new_width % 64) % 64
        if padded_height * padded_width <= max_upper_area:
            return padded_height, padded_width
    aspect_ratio = width / height
    target_width = int((target_area * aspect_ratio) ** 0.5 // divisor * divisor)
    target_height = int((target_area / aspect_ratio) ** 0.5 // divisor * divisor)
    if target_width >= width or target_height >= height:
        target_width = int(width // divisor * divisor)
        target_height = int(height // divisor * divisor)
    return target_height, target_width


def reference_pixels(image, height: int, width: int) -> torch.Tensor:
    """[1, 3, 1, H, W] in [-1, 1]: torchvision Resize(min(H, W)) (shorter side, PIL bilinear),
    CenterCrop((H, W)) (black padding where the resized image is smaller), ToTensor() * 2 - 1,
    as official `generate` does, written on PIL (torchvision is not a dependency)."""
    from PIL import Image

    w, h = image.size
    size = min(height, width)
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    if (new_h, new_w) != (h, w):
        image = image.resize((new_w, new_h), Image.BILINEAR)
    if width > new_w or height > new_h:  # torchvision pads left/top by floor(half), then crops
        left = (width - new_w) // 2 if width > new_w else 0
        top = (height - new_h) // 2 if height > new_h else 0
        right = (width - new_w + 1) // 2 if width > new_w else 0
        bottom = (height - new_h + 1) // 2 if height > new_h else 0
        padded = Image.new("RGB", (new_w + left + right, new_h + top + bottom), (0, 0, 0))
        padded.paste(image, (left, top))
        image, new_w, new_h = padded, padded.size[0], padded.size[1]
    if (new_h, new_w) != (height, width):
        top, left = int(round((new_h - height) / 2.0)), int(round((new_w - width) / 2.0))
        image = image.crop((left, top, left + width, top + height))
    pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)
    pixels = pixels.float().div(255.0) * 2.0 - 1.0
    return pixels[None, :, None]


# --- the official audio interpolation and bucketing -----------------------------------------------

def feature_frames(samples: int, conv_kernel, conv_stride) -> int:
    """wav2vec2 frames of `samples` samples (the feature encoder's valid convolutions)."""
    for kernel, stride in zip(conv_kernel, conv_stride, strict=True):
        samples = (samples - kernel) // stride + 1 if samples >= kernel else 0
    return samples


def frames_at_30fps(frames: int) -> int:
    """official linear_interpolation: output_len = int(T / 50 * 30)."""
    return int(frames / float(FEATURE_FPS) * BUCKET_FPS)


def clips_for(rows_30fps: int, frames_per_clip: int) -> int:
    """official get_audio_embed_bucket_fps: min_batch_num = int(T30 / (F * 30 / 16)) + 1, the
    last clip padded with silent frames (an exact multiple adds a whole silent clip)."""
    return int(rows_30fps / (frames_per_clip * (BUCKET_FPS / VIDEO_FPS))) + 1


def to_30fps(states_LTD: torch.Tensor) -> torch.Tensor:
    """[L, T, D] at 50 fps -> [L, int(T * 0.6), D] at 30 fps (official linear_interpolation)."""
    rows = frames_at_30fps(states_LTD.shape[1])
    out = torch.nn.functional.interpolate(states_LTD.transpose(1, 2), size=rows,
                                          align_corners=True, mode="linear")
    return out.transpose(1, 2)


def bucket(states_LTD: torch.Tensor, frames_per_clip: int) -> tuple[torch.Tensor, int]:
    """([1, L, D, clips * F], clips) from 30-fps states: official get_audio_embed_bucket_fps with
    m = 0 (one row a frame: np.round of linspace times, zeros past the audio), then
    encode_audio's unsqueeze/permute."""
    layers, rows, dim = states_LTD.shape
    clips = clips_for(rows, frames_per_clip)
    n = clips * frames_per_clip
    times = np.linspace(0.0, n / VIDEO_FPS, n, endpoint=False)  # get_sample_indices, start 0
    index = np.round(times * BUCKET_FPS).astype(int)
    out = states_LTD.new_zeros((n, layers, dim))
    inside = index < rows
    out[torch.from_numpy(inside)] = states_LTD[:, torch.from_numpy(index[inside])].transpose(0, 1)
    return out.permute(1, 2, 0).unsqueeze(0), clips


def hidden_states(model, extractor, audio: np.ndarray) -> torch.Tensor:
    """[L, T, D] fp32: the processor's normalisation, then every hidden state of the model, the
    last one after the final LayerNorm (`last_hidden_state`), as transformers 4.51.3 (the
    official pin) returns hidden_states[-1]; 5.24 returns it before (reference trap 1)."""
    values = extractor(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_values
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(values.to(device), output_hidden_states=True)
    states = (*out.hidden_states[:-1], out.last_hidden_state)
    return torch.cat(states).float()


# --- weights -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Weights:
    wav2vec: Path  # the wav2vec2 folder
    wav2vec_config: dict
    vae: Path  # Wan2.1_VAE.pth or a diffusers vae/ folder


def _expect_wav2vec(pipeline) -> str:
    cfg = pipeline.config
    return (f"the {WAV2VEC_DIR} wav2vec2 of the release (large layout: stable layer norm, "
            f"{cfg.audio_layers - 1} layers, hidden size {cfg.audio_dim})")


def _read_json(path: Path, expected: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise EncoderInputError(str(path), f"not readable JSON ({_one_line(exc)})", expected) from None
    if not isinstance(value, dict):
        raise EncoderInputError(str(path), "not a JSON object", expected)
    return value


def _tensor_shapes(path: Path, expected: str) -> dict[str, tuple]:
    """name -> shape from a checkpoint's header (safetensors) or pickle index (torch.load with
    mmap: no tensor data is read)."""
    from modules.layouts import CheckpointError
    from modules.safetensors_reader import read_header

    if path.suffix == ".safetensors":
        try:
            return {k: v.shape for k, v in read_header(path).items()}
        except CheckpointError as exc:  # its message starts with the path
            text = _one_line(exc).removeprefix(f"{path}: ")
            raise EncoderInputError(str(path), text, expected) from None
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise EncoderInputError(str(path), f"not a readable checkpoint ({_one_line(exc)})",
                                expected) from None
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise EncoderInputError(str(path), "holds no state dict of tensors", expected)
    return {k: tuple(v.shape) for k, v in state.items()}


def _check_wav2vec(pipeline, folder: Path) -> dict:
    cfg, expected = pipeline.config, _expect_wav2vec(pipeline)
    if not folder.is_dir():
        raise EncoderInputError(str(folder), "no such folder", expected)
    files = {"config.json": folder / "config.json",
             "preprocessor_config.json": folder / "preprocessor_config.json"}
    missing = [name for name, path in files.items() if not path.is_file()]
    weights = next((folder / n for n in WAV2VEC_WEIGHTS if (folder / n).is_file()), None)
    if weights is None:
        missing.append(" or ".join(WAV2VEC_WEIGHTS))
    if missing:
        raise EncoderInputError(str(folder), f"lacks {', '.join(missing)}", expected)
    config = _read_json(files["config.json"], expected)
    model_type = config.get("model_type")
    if model_type != "wav2vec2":
        raise EncoderInputError(str(files["config.json"]), f"describes a {model_type!r} model",
                                expected)
    found = dict(hidden_size=config.get("hidden_size", 768),
                 num_hidden_layers=config.get("num_hidden_layers", 12),
                 do_stable_layer_norm=config.get("do_stable_layer_norm", False),
                 feat_extract_norm=config.get("feat_extract_norm", "group"))
    want = dict(hidden_size=cfg.audio_dim, num_hidden_layers=cfg.audio_layers - 1,
                do_stable_layer_norm=True, feat_extract_norm="layer")
    if found != want:
        got = ", ".join(f"{k} {v}" for k, v in found.items())
        raise EncoderInputError(str(files["config.json"]), f"describes a wav2vec2 with {got}",
                                expected)
    extractor = _read_json(files["preprocessor_config.json"], "a Wav2Vec2FeatureExtractor config")
    if extractor.get("sampling_rate") != SAMPLE_RATE or extractor.get("feature_size", 1) != 1:
        raise EncoderInputError(str(files["preprocessor_config.json"]),
                                f"sampling_rate {extractor.get('sampling_rate')}, feature_size "
                                f"{extractor.get('feature_size', 1)}",
                                f"a wav2vec2 feature extractor at {SAMPLE_RATE} Hz, feature_size 1")
    _check_wav2vec_tensors(weights, config, want["hidden_size"], want["num_hidden_layers"], expected)
    return config


def _check_wav2vec_tensors(path: Path, config: dict, hidden: int, layers: int, expected: str):
    """The checkpoint's names and shapes are the configured wav2vec2's (a config.json beside
    another model's weights is refused before loading)."""
    shapes = _tensor_shapes(path, expected)
    prefix = "wav2vec2." if any(k.startswith("wav2vec2.") for k in shapes) else ""
    conv = list(config.get("conv_dim", (512,) * 7))
    want = {"feature_projection.projection.weight": (hidden, conv[-1]),
            "encoder.layer_norm.weight": (hidden,),
            f"encoder.layers.{layers - 1}.final_layer_norm.weight": (hidden,)}
    wrong = [f"{k} {list(shapes[prefix + k]) if prefix + k in shapes else 'missing'}"
             for k, shape in want.items() if shapes.get(prefix + k) != shape]
    extra = [k for k in shapes if k.startswith(f"{prefix}encoder.layers.{layers}.")]
    if wrong or extra:
        what = "; ".join(wrong) if wrong else f"a layer {layers} ({extra[0]})"
        raise EncoderInputError(str(path), f"holds other weights than its config.json describes "
                                f"({what})", expected)


def _check_vae(pipeline, root: Path) -> Path:
    """Wan2.1_VAE.pth (official) or vae/ (diffusers), checked by header: a Wan VAE with the
    pipeline's latent channels and RGB input (not the Wan2.2 VAE, z 48 on 12 patchified channels)."""
    z = pipeline.latent_channels
    expected = (f"{root / VAE_FILE} (official) or {root / VAE_DIR}/ (diffusers AutoencoderKLWan): "
                f"the Wan2.1 VAE, {z} latent channels")
    if (root / VAE_FILE).is_file():
        path = root / VAE_FILE
        shapes = _tensor_shapes(path, expected)
    elif (root / VAE_DIR).is_dir():
        path = root / VAE_DIR
        config = _read_json(path / "config.json", expected)
        if config.get("_class_name") != "AutoencoderKLWan":
            raise EncoderInputError(str(path / "config.json"),
                                    f"names class {config.get('_class_name')!r}", expected)
        weights = path / "diffusion_pytorch_model.safetensors"
        if not weights.is_file():
            raise EncoderInputError(str(path), "lacks diffusion_pytorch_model.safetensors", expected)
        shapes = _tensor_shapes(weights, expected)
    else:
        raise EncoderInputError(str(root), f"has neither {VAE_FILE} nor {VAE_DIR}/", expected)
    # official keys, or diffusers ones (load_vae takes either from either container)
    names = next((n for n in (("encoder.conv1.weight", "decoder.conv1.weight"),
                              ("encoder.conv_in.weight", "decoder.conv_in.weight"))
                  if n[0] in shapes and n[1] in shapes), None)
    if names is None:
        raise EncoderInputError(str(path), "holds no Wan VAE (no encoder.conv1 / conv_in weight; "
                                f"first keys {sorted(shapes)[:3]})", expected)
    enc, dec = shapes[names[0]], shapes[names[1]]
    if enc[1] != 3 or dec[1] != z:
        raise EncoderInputError(str(path), f"holds a VAE of {enc[1]} input and {dec[1]} latent "
                                "channels", expected)
    return path


def _check_weights(pipeline, weights) -> _Weights:
    root = Path(weights)
    expected = (f"the Wan2.2-S2V-14B release folder ({WAV2VEC_DIR}/ and {VAE_FILE})")
    if not root.is_dir():
        raise EncoderInputError(str(root), "no such folder", expected)
    config = _check_wav2vec(pipeline, root / WAV2VEC_DIR)
    return _Weights(root / WAV2VEC_DIR, config, _check_vae(pipeline, root))


def tiny_wav2vec_config(pipeline) -> dict:
    """The large layout (layer-normed convolutions, stable layer norm, the 7 default convolutions
    of stride 320) with the tiny pipeline's dims: audio_layers - 1 layers of audio_dim."""
    cfg = pipeline.config
    return dict(hidden_size=cfg.audio_dim, num_hidden_layers=cfg.audio_layers - 1,
                num_attention_heads=2, intermediate_size=2 * cfg.audio_dim, conv_dim=(8,) * 7,
                feat_extract_norm="layer", do_stable_layer_norm=True, conv_bias=True,
                num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, vocab_size=32)


@contextmanager
def _quiet_transformers():
    """transformers' load reports and progress bars off (the command prints one line a stage)."""
    from transformers.utils import logging

    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


def _check_tiny(pipeline) -> None:
    dim = pipeline.config.audio_dim
    if dim > TINY_MAX_DIM:
        raise EncoderInputError("weights", f"none given for {pipeline.name}, whose wav2vec2 has "
                                f"hidden size {dim}",
                                f"the Wan2.2-S2V-14B release folder ({WAV2VEC_DIR}/, {VAE_FILE}); "
                                "tiny random encoders are built only for the tiny pipelines")


def write_tiny_weights(pipeline, folder) -> Path:
    """A release-layout folder with a tiny random wav2vec2 (Wav2Vec2ForCTC + feature extractor,
    seeded) and the tiny Wan2.1 VAE stage 3 builds (diffusers vae/ folder: a .pth holds no
    config for the tiny sizes). Deterministic: the same pipeline gives the same weights."""
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2ForCTC

    from modules.vae import build_tiny, spec_for

    _check_tiny(pipeline)
    root = Path(folder)
    with _quiet_transformers(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = Wav2Vec2ForCTC(Wav2Vec2Config(**tiny_wav2vec_config(pipeline))).eval()
        model.save_pretrained(root / WAV2VEC_DIR)
        Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=SAMPLE_RATE, padding_value=0.0,
                                 do_normalize=True, return_attention_mask=True
                                 ).save_pretrained(root / WAV2VEC_DIR)
    vae = build_tiny(spec_for(pipeline), pipeline.latent_channels, seed=TINY_VAE_SEED)
    vae.save_pretrained(root / VAE_DIR)
    return root


# --- inputs ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    audio: np.ndarray  # 16 kHz mono float32
    image: object  # PIL RGB
    height: int
    width: int
    frames: int  # of one clip
    clips_held: int  # clips the audio fills (the last one padded)
    clips: int  # clips to sample


def _conv(config: dict):
    kernel = config.get("conv_kernel", (10, 3, 3, 3, 3, 2, 2))  # Wav2Vec2Config defaults
    stride = config.get("conv_stride", (5, 2, 2, 2, 2, 2, 2))
    return kernel, stride


def _plan(pipeline, request: Request, wav2vec_config: dict) -> _Plan:
    if pipeline.task != "s2v":
        raise EncoderInputError("--model", f"{pipeline.name} is a {pipeline.task} pipeline",
                                "a speech-to-video pipeline for the audio encoder")
    for name, value, what in (("--image", request.image, "the reference image to animate"),
                              ("--audio", request.audio, "the speech file that drives it")):
        if not value:
            raise EncoderInputError(name, f"not given; {pipeline.name} needs it", what)
    image = read_image(request.image)
    height = pipeline.size[0] if request.height is None else request.height
    width = pipeline.size[1] if request.width is None else request.width
    frames = pipeline.size[2] if request.frames is None else request.frames
    if height < 1 or width < 1:
        raise EncoderInputError("--height/--width", f"{height} x {width}",
                                "a positive area for the video")
    h, w = size_less_than_area(image.size[1], image.size[0], height * width)
    try:
        pipeline.latent_shape(h, w, frames)
    except ValueError as exc:  # sampling.pipelines.SizeError
        name = getattr(exc, "name", "size")  # the area decides the size: --height/--width
        flag = "--video_length" if name == "video_length" else "--height/--width"
        what = f"{frames}" if name == "video_length" else (
            f"{height} x {width} (height x width) leaves a {image.size[1]} x {image.size[0]} "
            f"image {h} x {w}")
        raise EncoderInputError(flag, what, getattr(exc, "expected", str(exc))) from None
    audio = read_audio(request.audio)
    flag = f"--audio {request.audio}"
    seconds = audio.shape[0] / SAMPLE_RATE
    minimum = math.ceil(SAMPLE_RATE / VIDEO_FPS)  # one video frame
    rows = frames_at_30fps(feature_frames(audio.shape[0], *_conv(wav2vec_config)))
    if audio.shape[0] < minimum or rows < 1:
        raise EncoderInputError(flag, f"{seconds:.3f} s of audio is too short for a clip",
                                f"at least one video frame of speech (1/{VIDEO_FPS} s, "
                                f"{minimum} samples at {SAMPLE_RATE} Hz)")
    rms = float(np.sqrt(np.mean(np.square(audio, dtype=np.float64))))
    if rms < SILENCE_RMS:
        raise EncoderInputError(flag, f"silent (RMS {rms:.2g} of full scale over {seconds:.2f} s)",
                                f"speech louder than RMS {SILENCE_RMS:g} (-80 dBFS)")
    held = clips_for(rows, frames)
    clips = held if request.clips is None else request.clips
    if not 1 <= clips <= held:
        raise EncoderInputError("--num_clips", f"{request.clips}",
                                f"1 to {held} (the {seconds:.2f} s of audio fills {held} clips "
                                f"of {frames} frames at {VIDEO_FPS} fps)")
    return _Plan(audio, image, h, w, frames, held, clips)


# --- the room's two functions ------------------------------------------------------------------

def check(pipeline, request: Request, weights) -> None:
    """Every refusal before model work: weights folder files, configs and checkpoint headers;
    the image and audio decode; the size, clip length and clip count fit."""
    if weights is None:
        _check_tiny(pipeline)
        config = tiny_wav2vec_config(pipeline)
    else:
        config = _check_weights(pipeline, weights).wav2vec_config
    _plan(pipeline, request, config)


def encode(pipeline, request: Request, weights, device="cpu"):
    """(tensors, config): `audio_embeds` [1, 25, D, clips * F] bf16, `ref_latents`
    [1, 16, 1, H/8, W/8] fp32; config height, width, video_length (F), num_clips, fps."""
    if weights is None:
        check(pipeline, request, None)  # refusals before anything is built
        with tempfile.TemporaryDirectory(prefix="tiny-s2v-") as folder:
            return encode(pipeline, request, write_tiny_weights(pipeline, folder), device)
    found = _check_weights(pipeline, weights)
    plan = _plan(pipeline, request, found.wav2vec_config)
    audio = encode_audio(found.wav2vec, plan.audio, plan.frames, device)
    ref = encode_reference(pipeline, found.vae, plan.image, plan.height, plan.width, device)
    config = dict(height=plan.height, width=plan.width, video_length=plan.frames,
                  num_clips=plan.clips, fps=VIDEO_FPS)
    return {"audio_embeds": audio, "ref_latents": ref}, config


def load_wav2vec(folder, device="cpu"):
    """(model, feature extractor) from a wav2vec2 folder: the CTC checkpoint's base model in
    fp32 (its lm_head is not used)."""
    from transformers import Wav2Vec2FeatureExtractor, Wav2Vec2Model

    with _quiet_transformers():
        extractor = Wav2Vec2FeatureExtractor.from_pretrained(folder)
        model = Wav2Vec2Model.from_pretrained(folder, torch_dtype=torch.float32)
    return model.to(device).eval(), extractor


def encode_audio(folder, audio: np.ndarray, frames_per_clip: int, device="cpu") -> torch.Tensor:
    """[1, 25, D, clips * F] in bf16 from 16 kHz mono speech (official encode_audio)."""
    model, extractor = load_wav2vec(folder, device)
    states = hidden_states(model, extractor, audio).cpu()
    del model
    embeds, _ = bucket(to_30fps(states), frames_per_clip)
    return embeds.to(AUDIO_DTYPE)


def encode_reference(pipeline, vae_path, image, height: int, width: int, device="cpu"):
    """[1, z, 1, H/8, W/8] fp32: the VAE's mean of the preprocessed reference image, normalised
    per channel (the official Wan2_1_VAE.encode; diffusers mode() then (z - mean) / std)."""
    from diffusers.utils import logging

    from modules.vae import VaeError, load_vae, spec_for

    level = logging.get_verbosity()
    logging.set_verbosity_error()  # its note that `accelerate` would load faster
    try:
        vae = load_vae(spec_for(pipeline), str(vae_path)).to(device)
    except VaeError as exc:
        raise EncoderInputError(str(vae_path), _one_line(exc), "the Wan2.1 VAE") from None
    finally:
        logging.set_verbosity(level)
    pixels = reference_pixels(image, height, width).to(device)
    with torch.no_grad():
        z = vae.encode(pixels).latent_dist.mode().float()
    cfg = vae.config
    mean = torch.tensor(cfg.latents_mean, dtype=z.dtype, device=z.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std, dtype=z.dtype, device=z.device).view(1, -1, 1, 1, 1)
    return ((z - mean) / std).cpu()

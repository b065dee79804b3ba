"""The video VAEs of stage 3, as diffusers modules: which VAE a pipeline decodes with, a tiny
random-weight one of the same architecture, and loading a checkpoint (diffusers folder, or one
.safetensors/.pth file in the diffusers or the official layout).

    Wan2.1 VAE  (wan2.2-i2v-a14b)  AutoencoderKLWan, z 16, 4x temporal, 8x spatial
    Wan2.2 VAE  (wan2.2-ti2v-5b)   AutoencoderKLWan, z 48, 4x temporal, 16x spatial = 8x convs and
                                   a 2x2 patchify (is_residual, patch_size 2, 12 in/out channels)
    HunyuanVideo-1.5 VAE           AutoencoderKLHunyuanVideo15, z 32, 4x temporal, 16x spatial
    pixels (the tiny models        `PixelLatents`: the latent is the clip itself in [-1, 1], or its
    trained here)                  causal form, or plus a position anchor (Pipeline.latent)

diffusers is imported only when a VAE is built, so a bad path fails before that 5 s import.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from modules.checkpoint import all_finite, nonfinite_message
from modules.layouts import CheckpointError
from modules.safetensors_reader import read_header


class VaeError(ValueError):
    """A VAE that cannot be built or loaded as asked; the message says what and what was expected."""


# Wan2.2 VAE per-channel latent statistics (the official vae2_2.py constants, also in diffusers'
# convert_wan_to_diffusers.py `vae22_diffusers_config`); a single .pth carries no config.
_WAN22_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813,
    0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108,
    -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313,
    -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944,
    0.3573, -0.0548, -0.1681, -0.0667]
_WAN22_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744]


@dataclass(frozen=True)
class VaeSpec:
    """One VAE architecture: its diffusers class, the released config, and a tiny variant."""

    name: str
    class_name: str  # in diffusers
    z_dim: int
    stride: tuple[int, int]  # (temporal, spatial), as Pipeline.vae_stride
    config: dict  # the released checkpoint's diffusers config (diffusers defaults left out)
    tiny: dict = field(default_factory=dict)  # small channel counts; z filled in by tiny_config

    def tiny_config(self, z_dim: int) -> dict:
        """Same block structure and strides, a few channels: the tiny pipelines' 9-frame clips
        decode in about a second on 2 CPU cores."""
        cfg = dict(self.tiny)
        if self.class_name == "AutoencoderKLWan":
            # identity latent statistics: random weights have none of their own
            cfg.update(z_dim=z_dim, latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim)
        else:
            # decoder conv_in adds the latent repeated (block_out_channels[-1] / z) times, the
            # encoder averages groups of block_out_channels[-1] / (2 z), and a temporal upsample
            # repeats its input 8 * out / in times, halved for the first frame: all must divide
            cfg.update(latent_channels=z_dim,
                       block_out_channels=(4, 4, 8, max(8, z_dim // 2), 2 * z_dim))
        return cfg


VAES = {
    "wan2.1-vae": VaeSpec(
        "wan2.1-vae", "AutoencoderKLWan", 16, (4, 8),
        config={},  # diffusers' AutoencoderKLWan defaults are the Wan2.1 VAE
        tiny=dict(base_dim=4, num_res_blocks=1)),
    "wan2.2-vae": VaeSpec(
        "wan2.2-vae", "AutoencoderKLWan", 48, (4, 16),
        config=dict(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12,
                    out_channels=12, patch_size=2, scale_factor_temporal=4,
                    scale_factor_spatial=16, latents_mean=_WAN22_MEAN, latents_std=_WAN22_STD),
        tiny=dict(base_dim=4, decoder_base_dim=4, num_res_blocks=1, is_residual=True,
                  in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16)),
    "hunyuanvideo-1.5-vae": VaeSpec(
        "hunyuanvideo-1.5-vae", "AutoencoderKLHunyuanVideo15", 32, (4, 16),
        config={},  # diffusers' defaults are the released VAE (scaling_factor 1.03682)
        tiny=dict(layers_per_block=1)),
}


class _Config(dict):
    """Attribute access like diffusers' FrozenDict, which the helpers below read."""

    __getattr__ = dict.__getitem__


def pixels_to_deltas(video: torch.Tensor) -> torch.Tensor:
    """[..., C, F, H, W] in [-1, 1] -> the causal latent: frame 0 as it is, then each frame's
    change from the one before, halved (so it stays in [-1, 1]). Like a causal video VAE (whose
    first latent frame is the first frame alone), it makes time run one way: reversed, the
    latent is not one the data holds, and a motion is a signed pair of blobs within one
    latent frame, not only an order between frames."""
    first = video[..., :1, :, :]
    return torch.cat([first, 0.5 * (video[..., 1:, :, :] - video[..., :-1, :, :])], dim=-3)


def deltas_to_pixels(z: torch.Tensor) -> torch.Tensor:
    """The inverse of `pixels_to_deltas` (a running sum over frames)."""
    first, changes = z[..., :1, :, :], 2.0 * z[..., 1:, :, :]
    return torch.cat([first, first + torch.cumsum(changes, dim=-3)], dim=-3)


def position_anchor(channels: int, frames: int, height: int, width: int, cell: int,
                    dtype=torch.float32) -> torch.Tensor:
    """[C, F, H, W]: where each cell of `cell` x `cell` pixels sits in the clip, as ramps from -1
    to 1: channel 0 over the frames, 1 over the cell rows, 2 over the cell columns (further
    channels zero). A DiT whose only positions are relative (RoPE, a patch embedding without
    padding) cannot tell the first frame or the left edge from the data; a latent holding this
    fixed pattern tells it at every noise level where the pattern shows through the noise."""
    def ramp(n):
        return torch.linspace(-1.0, 1.0, n, dtype=dtype) if n > 1 else torch.zeros(1, dtype=dtype)
    rows, cols = -(-height // cell), -(-width // cell)
    out = torch.zeros((channels, frames, height, width), dtype=dtype)
    grids = (ramp(frames)[:, None, None].expand(frames, height, width),
             ramp(rows).repeat_interleave(cell)[:height][None, :, None].expand(frames, height, width),
             ramp(cols).repeat_interleave(cell)[:width][None, None, :].expand(frames, height, width))
    for c, grid in enumerate(grids[:channels]):
        out[c] = grid
    return out


class PixelLatents(torch.nn.Module):
    """The trivially invertible latent mappings of the tiny models trained in pixel space
    (issue 28): the clip, channels first, in [-1, 1]; with `deltas`, its causal form
    (`pixels_to_deltas`); with `anchor` (a cell size in pixels), plus the `position_anchor`
    pattern. Decode inverts it and clamps to [-1, 1]."""

    def __init__(self, channels: int = 3, deltas: bool = False, anchor: int = 0):
        super().__init__()
        self.deltas, self.anchor = deltas, anchor
        self.config = _Config(z_dim=channels, scaling_factor=1.0, scale_factor_spatial=1,
                              scale_factor_temporal=1, deltas=deltas, anchor=anchor)

    def _pattern(self, z: torch.Tensor) -> torch.Tensor:
        return position_anchor(*z.shape[-4:], self.anchor, dtype=z.dtype).to(z.device)

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        video = video.clamp(-1.0, 1.0)
        z = pixels_to_deltas(video) if self.deltas else video
        return z + self._pattern(z) if self.anchor else z

    def decode(self, z: torch.Tensor, return_dict: bool = False):
        if self.anchor:
            z = z - self._pattern(z)
        return ((deltas_to_pixels(z) if self.deltas else z).clamp(-1.0, 1.0),)


PIXELS = VaeSpec("pixels", "PixelLatents", 3, (1, 1), config={})
PIXEL_DELTAS = VaeSpec("pixel-deltas", "PixelLatents", 3, (1, 1), config={"deltas": True})
PIXEL_ANCHORED = VaeSpec("pixel-anchored", "PixelLatents", 3, (1, 1), config={"anchor": 4})
PIXEL_SPECS = {spec.name: spec for spec in (PIXELS, PIXEL_DELTAS, PIXEL_ANCHORED)}  # by Pipeline.latent


# family -> spatial stride -> its VAE: Wan2.1's VAE (stride 8) serves Wan2.2 I2V-A14B and S2V,
# Wan2.2's (stride 16) TI2V-5B
FAMILY_VAES = {"hunyuan_video15": {16: "hunyuanvideo-1.5-vae"},
               "wan": {8: "wan2.1-vae", 16: "wan2.2-vae"}}


def spec_for(pipe) -> VaeSpec:
    """The VAE a sampling.pipelines.Pipeline decodes with (by family and spatial stride)."""
    if tuple(pipe.vae_stride) == PIXELS.stride:  # the tiny models trained in pixel space
        spec = PIXEL_SPECS[pipe.latent or PIXELS.name]
    elif pipe.family in FAMILY_VAES:
        by_stride = FAMILY_VAES[pipe.family]
        if pipe.vae_stride[1] not in by_stride:
            raise VaeError(f"pipeline {pipe.name} has spatial VAE stride {pipe.vae_stride[1]}; "
                           f"the {pipe.family} VAEs have {' or '.join(map(str, by_stride))}")
        spec = VAES[by_stride[pipe.vae_stride[1]]]
    else:
        raise VaeError(f"pipeline {pipe.name}: family {pipe.family!r} has no VAE; expected "
                       f"{' or '.join(FAMILY_VAES)}")
    if tuple(pipe.vae_stride) != spec.stride:
        raise VaeError(f"pipeline {pipe.name} has VAE stride {pipe.vae_stride}; the {spec.name} "
                       f"has {spec.stride} (temporal, spatial)")
    return spec


def _diffusers_class(spec: VaeSpec):
    import diffusers
    return getattr(diffusers, spec.class_name)


# The seed of the tiny random VAEs: stage 3 decodes with the one stage 1 encodes with.
TINY_VAE_SEED = 0


def build_tiny(spec: VaeSpec, z_dim: int, seed: int = TINY_VAE_SEED, dtype=torch.float32):
    """A random-weight VAE of the spec's architecture; the same seed gives the same weights."""
    if spec.name in PIXEL_SPECS:
        return PixelLatents(z_dim, **spec.config)
    cls = _diffusers_class(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = cls(**spec.tiny_config(z_dim))
    return _cast(vae.eval(), dtype)


def _cast(vae, dtype):
    # ModelMixin.to(dtype) warns even when nothing changes; skip the no-op
    return vae if dtype == torch.float32 else vae.to(dtype)


# --- checkpoints ----------------------------------------------------------------------------------

WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")
_CONFIG = "config.json"


def load_vae(spec: VaeSpec, path: str, dtype=torch.float32):
    """A VAE from a diffusers folder (config.json + weights) or a single weights file."""
    if spec.name in PIXEL_SPECS:
        raise VaeError(f"--vae_path {path}: this model samples in pixel space (its latent is the "
                       "clip itself); expected no --vae_path")
    if not os.path.exists(path):
        raise VaeError(f"--vae_path {path} does not exist; expected a diffusers VAE folder "
                       f"({_CONFIG} + diffusion_pytorch_model.safetensors) or one "
                       f"{'/'.join(WEIGHT_SUFFIXES)} file of the {spec.name}")
    if os.path.isdir(path):
        return _load_folder(spec, path, dtype)
    if not path.endswith(WEIGHT_SUFFIXES):
        raise VaeError(f"--vae_path {path}: unknown file type; expected one of "
                       f"{', '.join(WEIGHT_SUFFIXES)}")
    return _load_file(spec, path, dict(spec.config), dtype)


def _load_folder(spec, path, dtype):
    config_path = os.path.join(path, _CONFIG)
    weights = sorted(f for f in os.listdir(path) if f.endswith(WEIGHT_SUFFIXES))
    if not os.path.isfile(config_path):
        raise VaeError(f"--vae_path {path} has no {_CONFIG}; expected a diffusers VAE folder, or "
                       "pass the weights file itself")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise VaeError(f"{config_path} is not valid JSON: {exc}") from None
    if config.get("_class_name") == spec.class_name:
        if not weights:
            raise VaeError(f"--vae_path {path} holds no weights; expected "
                           "diffusion_pytorch_model.safetensors next to config.json")
        for name in weights:
            if name.endswith(".safetensors"):
                _check_header(os.path.join(path, name))
        try:
            vae = _diffusers_class(spec).from_pretrained(path, torch_dtype=dtype)
        except (OSError, ValueError, RuntimeError) as exc:
            raise VaeError(f"--vae_path {path}: diffusers could not load it: {one_line(exc)}") from None
        for key, value in vae.state_dict().items():  # diffusers checks neither dtype nor values
            _check_weight(path, key, value, value)
        return vae.eval()
    # An official release folder (e.g. HunyuanVideo-1.5 vae/): its weights, the released config.
    if len(weights) != 1:
        raise VaeError(f"--vae_path {path}: config.json names class "
                       f"{config.get('_class_name')!r}, not {spec.class_name}, and the folder holds "
                       f"{len(weights)} weight files; expected one official-layout file")
    base = dict(spec.config)
    if "scaling_factor" in config and spec.class_name == "AutoencoderKLHunyuanVideo15":
        base["scaling_factor"] = float(config["scaling_factor"])
    return _load_file(spec, os.path.join(path, weights[0]), base, dtype)


def one_line(exc: BaseException) -> str:
    """An exception's text as one line (the commands print errors as one); for a refused
    torch.load(weights_only=True), its reason without the paragraph of advice."""
    text = str(exc)
    # torch.load(weights_only=True) wraps the reason in a paragraph of advice: keep the reason
    reason = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n\s*\n|$)", text, re.S)
    return " ".join((reason.group(1) if reason else text).split())


def _check_header(path):
    """The DiT loader's header check (as strict as the safetensors format) for a VAE file."""
    try:
        read_header(Path(path))
    except CheckpointError as exc:
        raise VaeError(f"--vae_path {exc}") from None


def _check_weight(path, key, stored, value):
    """`value` (`stored` as loaded in the run's dtype) is a finite float weight."""
    if not value.is_floating_point():
        raise VaeError(f"--vae_path {path}: tensor {key!r} is {value.dtype}; expected a float "
                       "weight")
    if not all_finite(value):
        raise VaeError("--vae_path " + nonfinite_message(f"{path}: tensor {key!r}", stored,
                                                         value.dtype))


def _cast_checked(path, key, stored, dtype):
    value = stored.to(dtype) if stored.is_floating_point() else stored
    _check_weight(path, key, stored, value)
    return value


def _read_state_dict(path):
    if path.endswith(".safetensors"):
        _check_header(path)  # the library's refusals name no tensor and pass integer dtypes
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file
            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise VaeError(f"--vae_path {path} is not a readable checkpoint ({type(exc).__name__}: "
                       f"{one_line(exc)})") from None
    for key in ("state_dict", "model"):  # training checkpoints wrap the weights
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict):
        raise VaeError(f"--vae_path {path} holds an object of type {type(state).__name__}; "
                       "expected a state dict (a flat dict of tensors)")
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise VaeError(f"--vae_path {path}: entry {key!r} is of type {type(value).__name__}; "
                           "expected a state dict (a flat dict of tensors)")
    return state


def _load_file(spec, path, config, dtype):
    state = _read_state_dict(path)
    state = to_diffusers_keys(spec, state, path)
    z_in = _decoder_in_channels(spec, state)
    if z_in is not None and z_in != config.get("z_dim", config.get("latent_channels", spec.z_dim)):
        raise VaeError(f"--vae_path {path}: its decoder reads {z_in} latent channels; the "
                       f"{spec.name} has {spec.z_dim}")
    cls = _diffusers_class(spec)
    with torch.device("meta"):
        vae = cls(**config)
    expected = vae.state_dict()
    missing, unexpected = _key_diff(expected, state)
    misshaped = [f"{k}: checkpoint {list(state[k].shape)}, model {list(expected[k].shape)}"
                 for k in sorted(set(expected) & set(state)) if state[k].shape != expected[k].shape]
    if missing or unexpected or misshaped:
        raise VaeError(f"--vae_path {path} does not fit the {spec.name}: missing "
                       f"{len(missing)} keys {missing[:4]}, unexpected {len(unexpected)} "
                       f"{unexpected[:4]}, mis-shaped {len(misshaped)} {misshaped[:4]}")
    for key in sorted(state):  # in place: each stored tensor is freed as its cast replaces it
        state[key] = _cast_checked(path, key, state[key], dtype)
    try:
        vae.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise VaeError(f"--vae_path {path} does not fit the {spec.name}: {one_line(exc)}") from None
    return vae.eval()


def _key_diff(expected, got):
    return sorted(set(expected) - set(got)), sorted(set(got) - set(expected))


def _decoder_in_channels(spec, state):
    key = "decoder.conv_in.weight" if spec.class_name == "AutoencoderKLWan" else "decoder.conv_in.conv.weight"
    return state[key].shape[1] if key in state else None


# Official -> diffusers key renames. Wan2.2 and HunyuanVideo-1.5 are plain renames (facts from
# diffusers' convert_wan_to_diffusers.py::convert_vae_22 and convert_hunyuan_video1_5_to_diffusers.py);
# the Wan2.1 layout is converted by diffusers' own single-file function.
_WAN_RESIDUAL = [(r"\.residual\.0\.", ".norm1."), (r"\.residual\.2\.", ".conv1."),
                 (r"\.residual\.3\.", ".norm2."), (r"\.residual\.6\.", ".conv2."),
                 (r"\.shortcut\.", ".conv_shortcut.")]
_WAN22_RENAMES = [
    (r"^conv1\.", "quant_conv."), (r"^conv2\.", "post_quant_conv."),
    (r"^(encoder|decoder)\.conv1\.", r"\1.conv_in."),
    (r"^(encoder|decoder)\.head\.0\.", r"\1.norm_out."), (r"^(encoder|decoder)\.head\.2\.", r"\1.conv_out."),
    (r"^(encoder|decoder)\.middle\.0\.", r"\1.mid_block.resnets.0."),
    (r"^(encoder|decoder)\.middle\.1\.", r"\1.mid_block.attentions.0."),
    (r"^(encoder|decoder)\.middle\.2\.", r"\1.mid_block.resnets.1."),
    (r"^encoder\.downsamples\.(\d+)\.downsamples\.\d+\.(resample|time_conv)\.",
     r"encoder.down_blocks.\1.downsampler.\2."),
    (r"^encoder\.downsamples\.(\d+)\.downsamples\.(\d+)\.", r"encoder.down_blocks.\1.resnets.\2."),
    (r"^decoder\.upsamples\.(\d+)\.upsamples\.\d+\.(resample|time_conv)\.",
     r"decoder.up_blocks.\1.upsampler.\2."),
    (r"^decoder\.upsamples\.(\d+)\.upsamples\.(\d+)\.", r"decoder.up_blocks.\1.resnets.\2."),
    *_WAN_RESIDUAL,
]
_HY_RENAMES = [
    (r"^encoder\.down\.(\d+)\.block\.(\d+)\.", r"encoder.down_blocks.\1.resnets.\2."),
    (r"^encoder\.down\.(\d+)\.downsample\.", r"encoder.down_blocks.\1.downsamplers.0."),
    (r"^decoder\.up\.(\d+)\.block\.(\d+)\.", r"decoder.up_blocks.\1.resnets.\2."),
    (r"^decoder\.up\.(\d+)\.upsample\.", r"decoder.up_blocks.\1.upsamplers.0."),
    (r"\.mid\.block_1\.", ".mid_block.resnets.0."), (r"\.mid\.block_2\.", ".mid_block.resnets.1."),
    (r"\.mid\.attn_1\.(q|k|v)\.", r".mid_block.attentions.0.to_\1."),
    (r"\.mid\.attn_1\.", ".mid_block.attentions.0."),
]
_OFFICIAL_MARKERS = {"AutoencoderKLWan": "decoder.middle.0.residual.0.gamma",
                     "AutoencoderKLHunyuanVideo15": "decoder.mid.block_1.norm1.gamma"}


def rename_keys(state: dict, rules: list[tuple[str, str]]) -> dict:
    """The state dict with every (pattern, replacement) rule applied to each key, in order."""
    out = {}
    for key, value in state.items():
        for pattern, repl in rules:
            key = re.sub(pattern, repl, key)
        out[key] = value
    return out


def to_diffusers_keys(spec: VaeSpec, state: dict, source: str = "checkpoint") -> dict:
    """The state dict in diffusers names, whichever layout it came in."""
    if any(k.startswith("decoder.mid_block.") for k in state):
        return state
    if _OFFICIAL_MARKERS[spec.class_name] not in state:
        raise VaeError(f"{source}: neither diffusers nor official {spec.name} keys (first keys: "
                       f"{sorted(state)[:4]}); expected e.g. decoder.mid_block.* or "
                       f"{_OFFICIAL_MARKERS[spec.class_name]}")
    if spec.name == "wan2.1-vae":
        from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
        return convert_wan_vae_to_diffusers(state)
    return rename_keys(state, _WAN22_RENAMES if spec.name == "wan2.2-vae" else _HY_RENAMES)


# --- latents in, video out ----------------------------------------------------------------------

def latent_channels(vae) -> int:
    cfg = vae.config
    return cfg.z_dim if "z_dim" in cfg else cfg.latent_channels


def to_vae_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Undo the latent normalisation the DiT works in, as the diffusers pipelines do before
    decode: Wan `z * std + mean` per channel; HunyuanVideo-1.5 `z / scaling_factor`."""
    cfg = vae.config
    if "latents_mean" in cfg:
        shape = (1, -1, 1, 1, 1)
        mean = torch.tensor(cfg.latents_mean, dtype=latents.dtype).view(shape)
        std = torch.tensor(cfg.latents_std, dtype=latents.dtype).view(shape)
        return latents * std.to(latents.device) + mean.to(latents.device)
    return latents / cfg.scaling_factor


def from_vae_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_vae_latents`, for what an encode returns (stage 1's image latents):
    Wan `(z - mean) * (1 / std)` per channel, as the official vae2_1.py / vae2_2.py scale it;
    HunyuanVideo-1.5 `z * scaling_factor`."""
    cfg = vae.config
    if "latents_mean" in cfg:
        shape = (1, -1, 1, 1, 1)
        mean = torch.tensor(cfg.latents_mean, dtype=latents.dtype).view(shape)
        inv_std = 1.0 / torch.tensor(cfg.latents_std, dtype=latents.dtype).view(shape)
        return (latents - mean.to(latents.device)) * inv_std.to(latents.device)
    return latents * cfg.scaling_factor


def spatial_ratio(vae) -> int:
    cfg = vae.config
    return int(cfg.scale_factor_spatial if "scale_factor_spatial" in cfg else cfg.spatial_compression_ratio)


def enable_tiling(vae, tile_size: int | None = None) -> None:
    """diffusers' tiled decode (the single-device memory fallback); `tile_size` in pixels
    (default: diffusers' 256), tiles overlapping by a quarter."""
    if not hasattr(vae, "enable_tiling"):
        raise VaeError(f"{type(vae).__name__} offers no tiled decode")
    if tile_size is None:
        vae.enable_tiling()
        return
    ratio = spatial_ratio(vae)
    if tile_size < 2 * ratio or tile_size % ratio:
        raise VaeError(f"--tile_size {tile_size}: expected a multiple of the VAE's spatial stride "
                       f"{ratio}, at least {2 * ratio}")
    latent = tile_size // ratio
    if type(vae).__name__ == "AutoencoderKLWan":
        stride = max(1, latent * 3 // 4) * ratio  # tiles step in whole latent pixels
        vae.enable_tiling(tile_size, tile_size, stride, stride)
    else:
        vae.enable_tiling(tile_sample_min_height=tile_size, tile_sample_min_width=tile_size,
                          tile_latent_min_height=latent, tile_latent_min_width=latent)

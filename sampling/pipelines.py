"""Named pipelines: which DiT(s) a `--model` name runs, its sampling defaults, its latent geometry,
and the stage-1 tensors it reads. The one place these defaults live (model_spec 2.5-2.7, 3.7).

A pipeline turns stage-1 tensors into per-branch keyword arguments of the model's `prepare`
(`conditions`), and says how a timestep is fed (`timestep_input`, per token for TI2V image mode).
Speech-to-video (`task` "s2v") samples clip by clip (`sampling/clips.py`): `clip_inputs` cuts
one clip's tensors out of the stage-1 ones, and `conditions` maps those.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from modules.registry import get_config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANDOM = "random"

# Stage-1 tensor names as the existing TPU port writes them (tpu_notes 1.2), plus our image keys.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MASK_DTYPES = (torch.bool, torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.float16)

# Input limits of a sampling run, shared by stage 2 and the deviceless compile.
# CFG scales in use are 1-10; far above, cond - uncond is amplified until the latents overflow
MAX_GUIDANCE = 100.0
MAX_STEPS = 1000  # schedules in use take 4-100 steps; each step keeps a trace row and timings
MAX_TOKENS = 1 << 20


class SizeError(ValueError):
    """A clip size the VAE and patch strides cannot take; `name` is the setting at fault
    (height, width or video_length), `expected` what would fit."""

    def __init__(self, name: str, value, expected: str):
        super().__init__(f"{name} {value}: expected {expected}")
        self.name, self.value, self.expected = name, value, expected


@dataclass(frozen=True)
class TensorSpec:
    """Expected shape (None = any size) and dtypes of one stage-1 tensor."""

    shape: tuple[int | None, ...]
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    required: bool = True
    doc: str = ""
    most: tuple[int | None, ...] | None = None  # upper bounds of the shape's free (None) sizes
    needs_token: bool = False  # a mask: every row marks at least one valid token


class WanInputs:
    """What a Wan2.2 model reads of stage 1 (TI2V-5B, each I2V-A14B expert, S2V-14B): umT5 text
    of any length up to text_len, the image as latents or an I2V condition, speech clip by clip."""

    @staticmethod
    def latent_channels(cfg) -> int:
        return cfg.out_dim

    @staticmethod
    def per_token_image(task: str, image: bool) -> bool:
        """TI2V with a first frame: per-token timesteps and frame write-back (T10)."""
        return task == "ti2v" and image

    @staticmethod
    def stage1_specs(pipe, latent_shape, neg, image: bool) -> dict[str, TensorSpec]:
        cfg, (_, c, f, h, w) = pipe.config, latent_shape
        specs = {f"{p}prompt_embeds": TensorSpec((1, None, cfg.text_dim), doc="umT5",
                                                 most=(None, cfg.text_len, None)) for p in neg}
        if pipe.task == "s2v":
            specs.update({
                "ref_latents": TensorSpec((1, c, 1, h, w), doc="VAE latent of the reference image"),
                "audio_embeds": TensorSpec(
                    (1, cfg.audio_layers, cfg.audio_dim, None),
                    doc="wav2vec2 hidden states per video frame at 16 fps for every clip, as the "
                        "official encode_audio returns them"),
                "motion_latents": TensorSpec(
                    (1, c, None, h, w), required=False,
                    doc="VAE latents of the motion history (the last 73 frames); absent: the first "
                        "clip drops its motion tokens (official drop_first_motion)"),
                "pose_latents": TensorSpec((1, cfg.cond_dim, None, h, w), required=False,
                                           doc="VAE latents of a pose video, F per clip"),
            })
        elif pipe.task == "i2v":
            specs["condition"] = TensorSpec((1, cfg.in_dim - c, f, h, w),
                                            doc="[mask 4 | image latent] (trap T9)")
        elif image:
            specs["image_latents"] = TensorSpec((1, c, 1, h, w), doc="first-frame VAE latent")
        return specs

    @staticmethod
    def conditions(pipe, tensors: dict, p: str, branch: str, image: bool,
                   latent_shape) -> tuple[dict, dict]:
        # Zero-padded to text_len, as the model pads it itself (official WanModel): the same
        # numbers, and both CFG branches of one shape: one set of programs, and a batch-2 pair
        # for fused or cfg-parallel CFG when the negative prompt is longer or shorter
        context = tensors[f"{p}prompt_embeds"].float()
        pad = pipe.config.text_len - context.shape[1]
        kw = {"context": torch.nn.functional.pad(context, (0, 0, 0, pad)) if pad > 0 else context}
        if pipe.task == "s2v":  # one clip's tensors (clip_inputs); no speech for uncond (official)
            audio = tensors["audio"].float()
            kw.update(ref_latent=tensors["ref_latents"].float(),
                      motion_latents=tensors["motion_latents"].float(),
                      audio=torch.zeros_like(audio) if branch == "uncond" else audio,
                      motion_mask=tensors["motion_mask"].float())
            if "pose" in tensors:
                kw["pose"] = tensors["pose"].float()
            return kw, {}
        if pipe.task == "i2v":
            kw["y"] = tensors["condition"].float()
        return kw, {}


class HunyuanInputs:
    """What a HunyuanVideo-1.5 model reads of stage 1: MLLM and byT5 text with their masks, and
    for image-to-video the SigLIP tokens and the first frame's latent (a [latent | mask]
    condition)."""

    @staticmethod
    def latent_channels(cfg) -> int:
        return cfg.in_channels

    @staticmethod
    def per_token_image(task: str, image: bool) -> bool:
        return False

    @staticmethod
    def stage1_specs(pipe, latent_shape, neg, image: bool) -> dict[str, TensorSpec]:
        cfg, (_, c, _, h, w) = pipe.config, latent_shape
        specs = {}
        for p in neg:
            specs[f"{p}prompt_embeds"] = TensorSpec((1, cfg.text_len, cfg.text_dim), doc="MLLM")
            specs[f"{p}prompt_embeds_mask"] = TensorSpec((1, cfg.text_len), MASK_DTYPES,
                                                         needs_token=True)
            specs[f"{p}prompt_embeds_2"] = TensorSpec((1, cfg.byt5_len, cfg.byt5_dim), doc="byT5")
            specs[f"{p}prompt_embeds_mask_2"] = TensorSpec((1, cfg.byt5_len), MASK_DTYPES)
        if image:
            specs["image_embeds"] = TensorSpec((1, cfg.vision_len, cfg.vision_dim), doc="SigLIP")
            specs["image_latents"] = TensorSpec((1, c, 1, h, w), doc="first-frame VAE latent")
        return specs

    @staticmethod
    def conditions(pipe, tensors: dict, p: str, branch: str, image: bool,
                   latent_shape) -> tuple[dict, dict]:
        cfg = pipe.config
        kw = dict(text=tensors[f"{p}prompt_embeds"].float(),
                  text_mask=tensors[f"{p}prompt_embeds_mask"].bool(),
                  byt5=tensors[f"{p}prompt_embeds_2"].float(),
                  byt5_mask=tensors[f"{p}prompt_embeds_mask_2"].bool())
        if image:
            z = tensors["image_latents"].float()
            cond = torch.zeros((1, cfg.in_channels + 1, *latent_shape[2:]))
            cond[:, : cfg.in_channels, :1] = z  # reference latent at frame 0, then the mask
            cond[:, cfg.in_channels, 0] = 1.0
            kw.update(cond=cond, vision=tensors["image_embeds"].float())
        return kw, {"i2v": image}


# family (modules.registry's name) -> what its models read of stage 1 and how
FAMILY_INPUTS = {"wan": WanInputs, "hunyuan_video15": HunyuanInputs}


@dataclass(frozen=True)
class Pipeline:
    name: str
    family: str  # "wan" or "hunyuan_video15"
    experts: tuple[tuple[str | None, str], ...]  # (expert, model config name); None = one model
    task: str  # "t2v", "i2v" (image conditioning), "ti2v" (text, optionally a first frame), "s2v"
    solver: str
    shift: float
    guidance: float | tuple[float, float]  # Wan2.2 I2V-A14B: (low-noise, high-noise) (trap T7)
    steps: int
    size: tuple[int, int, int]  # default (height, width, frames); S2V: frames of one clip
    vae_stride: tuple[int, int]  # (temporal, spatial)
    boundary: float | None = None  # expert switch: "high" while t >= boundary (trap T6)
    checkpoint_dirs: dict = field(default_factory=dict)  # expert -> subfolder of --model_path
    clips: int = 1  # S2V: clips of synthetic audio (stage files: as many as the audio holds)
    # Weights without --model_path: None (real models: the flag is required), RANDOM (tiny
    # random weights from a fixed seed) or a checkpoint folder under the repository.
    builtin: str | None = None
    fps: float = 24.0  # of the decoded video (the official sample_fps)
    enlarge: int = 1  # stage 3 writes the video this many times larger (nearest neighbour)
    encoders: str | None = None  # stage 1's module in encoders/ (None: the family's)
    latent: str | None = None  # pixel-space models: "pixels", "pixel-deltas", "pixel-anchored"

    @property
    def builtin_path(self) -> str | None:
        """The committed checkpoint folder this pipeline loads without --model_path, if any."""
        if self.builtin in (None, RANDOM):
            return None
        return os.path.join(REPO_ROOT, self.builtin)

    @property
    def config(self):
        return get_config(self.experts[0][1])

    @property
    def moe(self) -> bool:
        return self.boundary is not None

    @property
    def meanflow(self) -> bool:
        """The step-distilled HunyuanVideo-1.5 reads the next timestep too (T23)."""
        return getattr(self.config, "use_meanflow", False)

    @property
    def inputs(self):
        """What this pipeline's family reads of stage 1 (FAMILY_INPUTS)."""
        return FAMILY_INPUTS[self.family]

    def ti2v_image(self, image: bool) -> bool:
        """Wan2.2 TI2V with a first frame: per-token timesteps and frame write-back (T10)."""
        return self.inputs.per_token_image(self.task, image)

    def expert_at(self, t: float) -> str | None:
        if not self.moe:
            return self.experts[0][0]
        return "high" if t >= self.boundary else "low"

    def guidance_for(self, expert: str | None, guidance=None) -> float:
        g = self.guidance if guidance is None else guidance
        if isinstance(g, tuple):
            return g[1] if expert == "high" else g[0]
        return float(g)

    # --- geometry ---------------------------------------------------------------------------

    @property
    def latent_channels(self) -> int:
        return self.inputs.latent_channels(self.config)

    def latent_shape(self, height: int, width: int, frames: int) -> tuple[int, int, int, int, int]:
        """[1, C, F, H, W] for a clip, checked against the VAE and patch strides."""
        st, ss = self.vae_stride
        patch = self.config.patch_size
        if self.task == "s2v":
            return self._s2v_latent_shape(height, width, frames)
        if frames < 1 or (frames - 1) % st:
            raise SizeError("video_length", frames, f"{st}k + 1 frames, k >= 0 (the VAE is causal "
                            f"with temporal stride {st}), e.g. {max(frames - 1, 0) // st * st + 1}")
        for name, value in (("height", height), ("width", width)):
            unit = ss * patch[1]
            if value < unit or value % unit:
                raise SizeError(name, value, f"a positive multiple of {unit} (VAE stride {ss} x "
                                f"patch {patch[1]})")
        return 1, self.latent_channels, (frames - 1) // st + 1, height // ss, width // ss

    def _s2v_latent_shape(self, height, width, frames):
        # official: infer_frames = 4n, each clip continuing 73 motion frames, so its latent has
        # (frames + 3 + 73) // 4 - 19 = frames / 4 frames; the 4x motion bucket needs H, W / 8
        st, ss = self.vae_stride
        if frames < st or frames % st:
            raise SizeError("video_length", frames, f"a multiple of {st} frames (S2V clips: the "
                            "official infer_frames, e.g. 80 or 48)")
        unit = ss * 8
        for name, value in (("height", height), ("width", width)):
            if value < unit or value % unit:
                raise SizeError(name, value, f"a positive multiple of {unit} (VAE stride {ss} x "
                                "the 8-latent-pixel motion packing)")
        return 1, self.latent_channels, frames // st, height // ss, width // ss

    # --- stage-1 tensors ----------------------------------------------------------------------

    def stage1_specs(self, latent_shape, cfg_on: bool, image: bool) -> dict[str, TensorSpec]:
        """What stage1_embeddings.safetensors must hold for this pipeline."""
        neg = ("", "negative_") if cfg_on else ("",)
        return self.inputs.stage1_specs(self, latent_shape, neg, image)

    def clip_count(self, tensors: dict, latent_shape) -> int:
        """S2V: the clips the audio holds; raises ValueError on lengths that do not fit."""
        per_clip = latent_shape[2] * self.vae_stride[0]
        frames = tensors["audio_embeds"].shape[-1]
        if frames < per_clip or frames % per_clip:
            raise ValueError(f"audio_embeds has {frames} frames; expected a positive multiple of "
                             f"the {per_clip} frames of a clip (the official audio bucketing pads "
                             "the audio to whole clips)")
        clips = frames // per_clip
        pose = tensors.get("pose_latents")
        if pose is not None and pose.shape[2] < clips * latent_shape[2]:
            raise ValueError(f"pose_latents has {pose.shape[2]} frames; {clips} clips need "
                             f"{clips * latent_shape[2]}")
        return clips

    def clip_inputs(self, tensors: dict, clip: int, motion, latent_shape) -> dict:
        """The stage-1 tensors of clip `clip`: its audio (and pose) window, the motion history
        to continue (None: the first clip without one, whose motion tokens are hidden)."""
        frames = latent_shape[2]
        per_clip = frames * self.vae_stride[0]
        out = {k: tensors[k] for k in ("prompt_embeds", "negative_prompt_embeds", "ref_latents")
               if k in tensors}
        out["audio"] = tensors["audio_embeds"][..., clip * per_clip: (clip + 1) * per_clip]
        hidden = motion is None
        if hidden:  # any values: the key mask hides them
            motion = torch.zeros((*latent_shape[:2], self.config.motion_latent_frames,
                                  *latent_shape[3:]))
        out["motion_latents"] = motion
        out["motion_mask"] = torch.tensor([0.0 if hidden else 1.0])
        if "pose_latents" in tensors:
            out["pose"] = tensors["pose_latents"][:, :, clip * frames: (clip + 1) * frames]
        return out

    def synthesize(self, latent_shape, cfg_on: bool, image: bool, seed: int) -> dict:
        """Stage-1 tensors of the right shapes, drawn from `seed` (no text encoder needed)."""
        gen = torch.Generator().manual_seed(seed)
        cfg, out = self.config, {}
        for name, spec in self.stage1_specs(latent_shape, cfg_on, image).items():
            if not spec.required:
                continue
            if name == "audio_embeds":  # wav2vec2 features of every clip's frames
                shape = (*spec.shape[:3], self.clips * latent_shape[2] * self.vae_stride[0])
                out[name] = torch.randn(shape, generator=gen)
                continue
            shape = tuple(cfg.text_len // 2 if d is None else d for d in spec.shape)
            if "mask" in name:
                mask = torch.zeros(shape, dtype=torch.int64)
                mask[:, : max(1, shape[1] // 2)] = 1
                if name.endswith("_2"):  # no quoted text in the prompt: an all-zero byT5 mask
                    mask.zero_()
                out[name] = mask
            else:
                out[name] = torch.randn(shape, generator=gen)
        if "condition" in out:  # a real mask: latent frame 0 is the image (trap T9)
            out["condition"][:, :4] = 0.0
            out["condition"][:, :4, 0] = 1.0
        return out

    def conditions(self, tensors: dict, branch: str, image: bool, latent_shape) -> tuple[dict, dict]:
        """(tensor kwargs, static kwargs) of `prepare` for one CFG branch, batch 1."""
        p = "negative_" if branch == "uncond" else ""
        return self.inputs.conditions(self, tensors, p, branch, image, latent_shape)

    def first_frame(self, tensors: dict, image: bool):
        """TI2V image mode: the clean first-frame latent written back after every step (T10)."""
        if self.ti2v_image(image):
            return tensors["image_latents"].float()
        return None

    def timestep_input(self, t: float, latent_shape, image: bool) -> torch.Tensor:
        """The model's timestep for one call: [1], or [1, L] with frame-0 tokens at 0 (TI2V image)."""
        if not self.ti2v_image(image):
            return torch.tensor([t], dtype=torch.float32)
        f, h, w = (n // p for n, p in zip(latent_shape[2:], self.config.patch_size, strict=True))
        per_token = torch.full((1, f * h * w), t, dtype=torch.float32)
        per_token[:, : h * w] = 0.0
        return per_token

    def tokens(self, latent_shape) -> int:
        return math.prod(n // p for n, p in zip(latent_shape[2:], self.config.patch_size, strict=True))


_HY_SAMPLING = {  # variant -> (shift, guidance, steps): model_spec 3.7
    "480p_t2v": (5.0, 6.0, 50), "480p_i2v": (5.0, 6.0, 50), "720p_t2v": (9.0, 6.0, 50),
    "720p_i2v": (7.0, 6.0, 50), "480p_t2v_distilled": (5.0, 1.0, 50),
    "480p_i2v_distilled": (5.0, 1.0, 50), "720p_i2v_distilled": (7.0, 1.0, 50),
    "720p_i2v_distilled_sparse": (7.0, 1.0, 50), "480p_i2v_step_distilled": (7.0, 1.0, 12),
}


def _hy(name, variant):
    shift, guidance, steps = _HY_SAMPLING[variant]
    size = (720, 1280, 121) if variant.startswith("720p") else (480, 848, 121)
    return Pipeline(name, "hunyuan_video15", ((None, f"hunyuanvideo-1.5-{variant}"),),
                    "i2v" if "i2v" in variant else "t2v", "euler", shift, guidance, steps, size,
                    (4, 16))


PIPELINES: dict[str, Pipeline] = {
    **{f"hunyuanvideo-1.5-{v}": _hy(f"hunyuanvideo-1.5-{v}", v) for v in _HY_SAMPLING},
    "wan2.2-ti2v-5b": Pipeline("wan2.2-ti2v-5b", "wan", ((None, "wan2.2-ti2v-5b"),), "ti2v",
                               "unipc", 5.0, 5.0, 50, (704, 1280, 121), (4, 16)),
    "wan2.2-i2v-a14b": Pipeline(
        "wan2.2-i2v-a14b", "wan", (("high", "wan2.2-i2v-a14b-high"), ("low", "wan2.2-i2v-a14b-low")),
        "i2v", "unipc", 5.0, (3.5, 3.5), 40, (720, 1280, 81), (4, 8), boundary=900.0,
        checkpoint_dirs={"high": "high_noise_model", "low": "low_noise_model"}),
    # Tiny random-weight pipelines: same code paths, seconds on a CPU.
    "hunyuanvideo-tiny": Pipeline("hunyuanvideo-tiny", "hunyuan_video15",
                                  ((None, "hunyuanvideo-tiny"),), "t2v", "euler", 5.0, 6.0, 50,
                                  (64, 80, 9), (4, 16), builtin=RANDOM),
    "hunyuanvideo-tiny-meanflow": Pipeline(
        "hunyuanvideo-tiny-meanflow", "hunyuan_video15", ((None, "hunyuanvideo-tiny-meanflow"),),
        "i2v", "euler", 7.0, 1.0, 12, (64, 80, 9), (4, 16), builtin=RANDOM),
    "wan-tiny-ti2v": Pipeline("wan-tiny-ti2v", "wan", ((None, "wan-tiny-ti2v"),), "ti2v", "unipc",
                              5.0, 5.0, 50, (128, 192, 9), (4, 16), builtin=RANDOM),
    "wan-tiny-i2v": Pipeline("wan-tiny-i2v", "wan", (("high", "wan-tiny-i2v"), ("low", "wan-tiny-i2v")),
                             "i2v", "unipc", 5.0, (3.5, 3.5), 40, (64, 96, 9), (4, 8),
                             boundary=900.0, builtin=RANDOM, fps=16.0),
    # Trained here on procedural clips (issue 28): pixel space (the latent is the clip in
    # [-1, 1] plus a fixed position anchor, modules.vae.position_anchor: without it a RoPE-only
    # DiT cannot tell which way time runs, and never learned the direction's sign; vae_stride
    # (1, 1)), 4 frames of 16x16, sampled as it was evaluated (shift 5, CFG 5).
    "wan-tiny-trained": Pipeline("wan-tiny-trained", "wan", ((None, "wan-tiny-trained"),), "ti2v",
                                 "unipc", 5.0, 5.0, 50, (16, 16, 4), (1, 1),
                                 builtin="assets/tiny-wan-ti2v", fps=4.0, enlarge=8,
                                 encoders="word_table", latent="pixel-anchored"),
    # Its HunyuanVideo-1.5 twin (Euler 50, shift 5, CFG 6, as the fixture trainer evaluates it),
    # trained with the position anchor in its latent (modules.vae.position_anchor).
    "hunyuanvideo-tiny-trained": Pipeline(
        "hunyuanvideo-tiny-trained", "hunyuan_video15", ((None, "hunyuanvideo-tiny-trained"),),
        "t2v", "euler", 5.0, 6.0, 50, (16, 16, 4), (1, 1), builtin="assets/tiny-hunyuanvideo15",
        fps=4.0, enlarge=8, encoders="word_table", latent="pixel-anchored"),
    # wan/configs/wan_s2v_14B.py: shift 3, 40 steps, guidance 4.5; generate.py: unipc, 80 frames
    # a clip; 704 x 1280 is the largest 64-multiple size within the default 1280*720 area
    "wan2.2-s2v-14b": Pipeline("wan2.2-s2v-14b", "wan", ((None, "wan2.2-s2v-14b"),), "s2v",
                               "unipc", 3.0, 4.5, 40, (704, 1280, 80), (4, 8), fps=16.0),
    "wan-tiny-s2v": Pipeline("wan-tiny-s2v", "wan", ((None, "wan-tiny-s2v"),), "s2v", "unipc",
                             3.0, 4.5, 40, (64, 64, 16), (4, 8), clips=3, builtin=RANDOM, fps=16.0),
}
# Every command's model without --model (or a stage-1 config naming one): the model trained
# here, whose video shows the prompt; the random-weight ones are one --model away.
DEFAULT_PIPELINE = "wan-tiny-trained"
# the prompt stage 2 encodes in-process without --input_dir or --prompt: words the trained
# models' word table knows (encoders/word_table.py)
DEFAULT_PROMPT = "red circle moves right on blue"


def get_pipeline(name: str) -> Pipeline:
    if name not in PIPELINES:
        import difflib
        near = difflib.get_close_matches(name, PIPELINES, n=1, cutoff=0.6)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ValueError(f"unknown model {name!r}; {hint}expected one of {', '.join(PIPELINES)}")
    return PIPELINES[name]

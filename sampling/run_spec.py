"""One sampling run, resolved: the typed, frozen spec every command that samples builds from its
flags before any model or device work, and the resolution steps they share.

`commands.stage2_resolve.resolve` builds a `RunSpec` from stage 2's flags (generate through it,
prompt by prompt); the deviceless compile (`python -m commands.aot`) and calibration resolve the parts
they share with it through the functions below, so a refusal reads the same whichever command
gives it, and each bound is stated once.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from cache import CMConfig

from .cli import as_int, as_number
from .errors import UsageError
from .pipelines import MAX_STEPS, MAX_TOKENS, Pipeline, SizeError
from .units import size_text

# the --dtype flags' names, the one table of them: the DiT runs in fp32 or bf16 (stage 2, the
# deviceless compile), the VAE in any of the three (stage 3) or fp32/bf16 (its deviceless compile)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DIT_DTYPES = ("fp32", "bf16")
DEFAULT_SEED = 42
SIZE_KEYS = ("height", "width", "video_length")


@dataclass(frozen=True, kw_only=True)
class Launch:
    """Where the run executes: backend, devices and their layout, compilation (the flags' own
    names and values; checked with the rest). The defaults are stage 2's flags' (its parser reads
    them here): one process, one device, the persistent compile cache in its default folder."""

    backend: str = "jax"
    device: str | None = None
    attention: str | None = None
    torch_compile: bool = False
    offload_model: bool = False
    compile_cache_dir: str | None = None  # None: the default folder; 'none': no persistent cache
    warmup_steps: int = 1
    sp_size: int = 1
    cfg_parallel: bool = False
    weight_sharding: str | None = None
    multihost: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


@dataclass(frozen=True, kw_only=True)
class Outputs:
    """What the run writes besides its stage files, and what it shows."""

    output_dir: str
    telemetry_json: str | None
    telemetry_csv: str | None
    plot_png: str | None
    tensorboard_dir: str | None
    compare: bool  # also run uncached from the same inputs
    progress: bool  # show the step bar (the writer only)


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """A stage-2 run, every flag and input checked: what to sample, from what, where, and what to
    write. Results of the run (latents, reports, warnings of loading) are returned beside it."""

    pipe: Pipeline
    config: CMConfig  # the gate's (a budget's choice, --offload_model and --cfg_parallel applied)
    budget: dict | None  # budgeted mode: the target and what the profile promised for it
    steps: int
    solver: str
    shift: float
    guidance: float | tuple[float, float] | None  # None: the pipeline's
    seed: int
    size: tuple[int, int, int]  # height, width, frames
    latent_shape: tuple[int, ...]
    clips: int | None  # speech-to-video: clips to sample one after another
    dtype: torch.dtype
    model_path: str | None
    tensors: dict  # the stage-1 tensors, checked against the pipeline's specs
    stage1: dict  # the stage-1 config the run continues (its own config records it)
    image: bool  # conditioned on a first frame
    prompt: str | None  # encoded in this process; None: given, read or synthesized inputs
    synthetic: bool  # inputs drawn from the seed
    preset: str | None
    profile_files: tuple[tuple[str, str], ...]  # (flag, path) of each calibrated profile used
    accept_profile: bool  # use a profile calibrated on other weights
    launch: Launch
    outputs: Outputs

    @property
    def tokens(self) -> int:
        return self.pipe.tokens(self.latent_shape)

    @property
    def shown_guidance(self):
        """The guidance the run samples with: the flag's or the config's, else the pipeline's."""
        return self.guidance if self.guidance is not None else self.pipe.guidance


# --- resolution steps that stage 2, tpu.aot and calibration share ------------------------------

def pick(flag: str, value, stage1: dict, key: str, default, source: str | None):
    """(value, label) of a setting: the flag's if given, else the stage-1 config's, else the
    default. Only None means "not given": a 0 is a value, checked like any other."""
    if value is not None:
        return value, flag
    if stage1.get(key) is not None:
        return stage1[key], f"{source}: {key}"
    return default, f"{flag} (default)"


def check_path(flag: str, value) -> None:
    """An empty path flag is refused (it would name the working folder, or nothing)."""
    if value == "":
        raise UsageError(f"{flag} '': expected a path")


def with_cfg_parallel(config: CMConfig, cfg_parallel: bool, cfg_mode: str | None) -> CMConfig:
    """--cfg_parallel runs the CFG pair fused; another --cfg_mode is refused."""
    if not cfg_parallel:
        return config
    if cfg_mode not in (None, "fused"):
        raise UsageError(f"--cfg_parallel runs cond and uncond as one fused call; it cannot run "
                         f"with --cfg_mode {cfg_mode}")
    return dataclasses.replace(config, cfg_mode="fused")


def steps_of(value, pipe: Pipeline, stage1: dict | None = None, source: str | None = None) -> int:
    """--num_inference_steps, else the stage-1 config's, else the pipeline's."""
    value, label = pick("--num_inference_steps", value, stage1 or {}, "num_inference_steps",
                        pipe.steps, source)
    return as_int(label, value, minimum=1, maximum=MAX_STEPS)


def shift_of(value, pipe: Pipeline) -> float:
    """--sample_shift, else the pipeline's."""
    return as_number("--sample_shift", value if value is not None else pipe.shift, above=0.0,
                     expected="a finite number > 0 (1.0 = no shift)")


def gib(n: float) -> str:
    return size_text(n, "GiB")


def hidden_bytes(pipe: Pipeline, tokens: int) -> int:
    """One fp32 hidden state of `tokens` tokens."""
    dim = getattr(pipe.config, "dim", None) or pipe.config.hidden_size
    return tokens * dim * 4


def size_of(pipe: Pipeline, flags: tuple, stage1: dict | None = None,
            source: str | None = None) -> tuple[tuple[int, int, int], tuple]:
    """(size, latent shape) from the --height, --width and --video_length flags' `flags`, else
    the stage-1 config's, else the pipeline's: positive integers the model's strides divide, and
    at most MAX_TOKENS tokens per model call."""
    values, labels = [], {}
    for key, value, default in zip(SIZE_KEYS, flags, pipe.size, strict=True):
        value, labels[key] = pick(f"--{key}", value, stage1 or {}, key, default, source)
        values.append(as_int(labels[key], value, minimum=1, expected=f"a positive {key}"))
    size = tuple(values)
    try:
        latent_shape = pipe.latent_shape(*size)
    except SizeError as exc:
        raise UsageError(f"{labels[exc.name]} {exc.value}: expected {exc.expected}") from None
    tokens = pipe.tokens(latent_shape)
    if tokens > MAX_TOKENS:
        raise UsageError(
            f"{labels['height']} {size[0]}, {labels['width']} {size[1]}, {labels['video_length']} "
            f"{size[2]}: {tokens:,} tokens per model call ({gib(hidden_bytes(pipe, tokens))} "
            f"for one hidden state of the {pipe.name} model); expected at most {MAX_TOKENS:,} "
            "(9x HunyuanVideo-1.5 720p)")
    return size, latent_shape


def check_cfg(config: CMConfig, pipe: Pipeline, guidance, cfg_parallel: bool) -> bool:
    """Whether any expert runs CFG (guidance != 1); a fused pair needs it on every expert."""
    values = [pipe.guidance_for(e, guidance) for e, _ in pipe.experts]
    if config.cfg_mode == "fused" and 1.0 in values:
        raise UsageError(f"--{'cfg_parallel' if cfg_parallel else 'cfg_mode fused'} batches "
                         "cond and uncond in one call; it needs CFG "
                         f"(guidance != 1) for every expert, got guidance {values}")
    return any(g != 1.0 for g in values)


def expert_path(pipe: Pipeline, model_path: str, expert) -> str:
    """The checkpoint of one expert: its subfolder of `model_path` (Wan2.2 I2V-A14B), or the
    path itself."""
    sub = pipe.checkpoint_dirs.get(expert)
    return os.path.join(model_path, sub) if sub else model_path

"""What stage 1 computes for a real-size pipeline, counted from the encoders' architectures: the
text encoders by formula, the image and speech encoders and the VAE encodes by torch's flop
counter on the meta device (no weights, no memory). bench/tpu_pages/whole_job.py divides it by the rates
this CPU sustains."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from sampling.pipelines import get_pipeline

# Real-size encoders, as stage 1 runs them (encoders/umt5.py, encoders/hunyuan_text.py):
# umT5-XXL encoder (stage1_encoders.md section 2: d 4096, 64 heads x 64, gated FFN 10240, 24
# layers) in bf16; the Qwen2.5-VL-7B text decoder (its config.json: hidden 3584, 28 query heads
# and 4 key/value heads of 128, SwiGLU 18944, 28 layers, all run: `mllm_states` asks every hidden
# state) in bf16 on a CPU; the Wan2.1 VAE encoder in fp32 (I2V-A14B's condition).
UMT5 = {"d": 4096, "inner": 64 * 64, "ffn": 10240, "layers": 24}
QWEN = {"d": 3584, "q": 28 * 128, "kv": 4 * 128, "ffn": 18944, "layers": 28}
QWEN_CROP = 108  # template tokens before the prompt (encoders/hunyuan_text.py crop_start)
I2V_VAE = "wan2.1-vae"
HY_VAE = "hunyuanvideo-1.5-vae"
# The image and speech encoders (stage1_encoders.md sections 2-3), counted by torch's flop counter
# on the meta device: HunyuanVideo-1.5 I2V's SigLIP so400m-patch14-384 (FLUX.1-Redux's: hidden
# 1152, 16 heads, MLP 4304, 27 layers, one 384 x 384 image) in bf16 on a CPU, and S2V's
# wav2vec2-large-xlsr-53 (hidden 1024, 16 heads, FFN 4096, 24 layers, stable layer norm, 16 kHz
# speech, fp32 as the official encoder runs it)
SIGLIP = {"hidden_size": 1152, "num_attention_heads": 16, "intermediate_size": 4304,
          "num_hidden_layers": 27, "patch_size": 14, "image_size": 384}
WAV2VEC2 = {"hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 4096,
            "num_hidden_layers": 24, "do_stable_layer_norm": True, "feat_extract_norm": "layer",
            "conv_bias": True}
AUDIO_HZ = 16000


# --- stage 1: work counted from the architectures ------------------------------------------------

def umt5_flops(tokens: int) -> float:
    """One umT5-XXL encode: q, k, v, o, the gated FFN's three matmuls, and attention (no
    causal mask), 2 FLOPs a multiply-add."""
    c = UMT5
    per_layer = 2 * tokens * (4 * c["d"] * c["inner"] + 3 * c["d"] * c["ffn"]) \
        + 4 * tokens**2 * c["inner"]
    return c["layers"] * per_layer


def qwen_flops(tokens: int) -> float:
    """One Qwen2.5-VL-7B text pass: q and o, the grouped k and v, SwiGLU, and attention counted
    whole (the causal half is not skipped)."""
    c = QWEN
    per_layer = 2 * tokens * (2 * c["d"] * c["q"] + 2 * c["d"] * c["kv"] + 3 * c["d"] * c["ffn"]) \
        + 4 * tokens**2 * c["q"]
    return c["layers"] * per_layer


@functools.cache
def siglip_flops(layers: int = SIGLIP["num_hidden_layers"]) -> float:
    """One SigLIP image encode (`layers` of its layers), counted on the meta device."""
    import torch

    model, size = siglip_model(layers, "meta"), SIGLIP["image_size"]
    return _counted(lambda: model(pixel_values=torch.zeros(1, 3, size, size, device="meta")))


@functools.cache
def wav2vec2_flops(seconds: float, layers: int = WAV2VEC2["num_hidden_layers"]) -> float:
    """One wav2vec2 pass over `seconds` of 16 kHz speech (every hidden state asked, as
    encoders/wan_audio.py does), counted on the meta device."""
    import torch

    model = wav2vec2_model(layers, "meta")
    samples = torch.zeros(1, round(seconds * AUDIO_HZ), device="meta")
    return _counted(lambda: model(samples, output_hidden_states=True))


def _counted(call) -> float:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        call()
    return float(counter.get_total_flops())


def siglip_model(layers: int, device: str):
    """SigLIP so400m at its real width with `layers` layers, random weights, on `device`."""
    import torch
    from transformers import SiglipVisionConfig, SiglipVisionModel

    with torch.device(device):
        return SiglipVisionModel(SiglipVisionConfig(**{**SIGLIP, "num_hidden_layers": layers})).eval()


def wav2vec2_model(layers: int, device: str):
    """wav2vec2-large at its real width with `layers` layers, random weights, on `device`."""
    import torch
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    with torch.device(device):
        return Wav2Vec2Model(Wav2Vec2Config(**{**WAV2VEC2, "num_hidden_layers": layers})).eval()


def build_vae(spec_name: str, device: str):
    import diffusers
    import torch

    from modules.vae import VAES

    spec = VAES[spec_name]
    with torch.device(device):
        return getattr(diffusers, spec.class_name)(**spec.config).eval()


def vae_encoder_flops(spec_name: str, frames: int, height: int, width: int) -> float:
    """The VAE encode of a [1, 3, F, H, W] video, counted by torch's flop counter on the meta
    device (no memory, a few seconds)."""
    import torch

    vae = build_vae(spec_name, "meta")
    return _counted(lambda: vae.encode(torch.zeros(1, 3, frames, height, width, device="meta")))


def vae_key(spec_name: str, frames: int, height: int, width: int) -> str:
    return f"{spec_name} {frames}x{height}x{width}"


# the pipelines whose stage 1 `stage1_work` models, by family (modules.registry's name)
STAGE1_TASKS = {"wan": ("t2v", "ti2v", "i2v", "s2v"), "hunyuan_video15": ("t2v", "i2v")}


@dataclass(frozen=True)
class Work:
    what: str
    flops: float
    rate: str  # key of the host measurement's rates


def _wan_work(pipe, prompts: int, height: int, width: int, frames: int,
              vae_flops: Callable[[str, int, int, int], float]) -> list[Work]:
    """umT5-XXL on the prompts; I2V-A14B's condition video through the Wan2.1 VAE encoder; S2V's
    speech (the clip's seconds) through wav2vec2 and its reference image through that encoder."""
    tokens = pipe.config.text_len
    work = [Work(f"umT5-XXL bf16, {prompts} x {tokens} tokens", prompts * umt5_flops(tokens),
                 "umt5")]
    if pipe.task == "i2v":
        work.append(Work(f"Wan2.1 VAE encoder fp32, {frames} x {height} x {width}",
                         vae_flops(I2V_VAE, frames, height, width), "vae"))
    if pipe.task == "s2v":
        seconds = frames / pipe.fps
        work += [Work(f"wav2vec2-large fp32, {seconds:g} s of speech", wav2vec2_flops(seconds),
                      "wav2vec2"),
                 Work(f"Wan2.1 VAE encoder fp32, the reference image, 1 x {height} x {width}",
                      vae_flops(I2V_VAE, 1, height, width), "vae")]
    return work


def _hunyuan_work(pipe, prompts: int, height: int, width: int, frames: int,
                  vae_flops: Callable[[str, int, int, int], float]) -> list[Work]:
    """The Qwen2.5-VL-7B text decoder on the prompts; I2V's image through SigLIP and the
    HunyuanVideo-1.5 VAE encoder."""
    tokens = pipe.config.text_len + QWEN_CROP
    work = [Work(f"Qwen2.5-VL-7B text bf16, {prompts} x {tokens} tokens (no quoted text: "
                 "no ByT5)", prompts * qwen_flops(tokens), "qwen")]
    if pipe.task == "i2v":
        work += [Work("SigLIP so400m bf16, 1 image", siglip_flops(), "siglip"),
                 Work(f"HunyuanVideo-1.5 VAE encoder fp32, 1 x {height} x {width}",
                      vae_flops(HY_VAE, 1, height, width), "hy_vae")]
    return work


# family (modules.registry's name) -> what its stage 1 computes for one of STAGE1_TASKS' tasks
STAGE1_WORK = {"wan": _wan_work, "hunyuan_video15": _hunyuan_work}


def stage1_work(report: dict, vae_flops: Callable[[str, int, int, int], float]) -> list[Work]:
    """What stage 1 computes for the report's pipeline at its size: the prompt and, with CFG,
    the negative prompt at the full text length (an upper bound: stage 1 runs the real tokens
    only); I2V-A14B's condition video through the Wan2.1 VAE encoder; S2V's speech (the clip's
    seconds) through wav2vec2 and its reference image through the Wan2.1 VAE encoder;
    HunyuanVideo-1.5 I2V's image through SigLIP and its VAE encoder."""
    pipe = get_pipeline(report["model"])
    guidance = pipe.guidance if isinstance(pipe.guidance, tuple) else (pipe.guidance,)
    prompts = 2 if any(g != 1 for g in guidance) else 1
    height, width, frames = report["size"]
    if pipe.task in STAGE1_TASKS.get(pipe.family, ()):
        return STAGE1_WORK[pipe.family](pipe, prompts, height, width, frames, vae_flops)
    raise ValueError(f"{report['model']} ({pipe.family} {pipe.task}): no stage-1 work model; "
                     f"expected one of {STAGE1_TASKS}")


def modelled(model: str) -> bool:
    """Whether `stage1_work` knows what the pipeline's stage 1 computes."""
    pipe = get_pipeline(model)
    return pipe.task in STAGE1_TASKS.get(pipe.family, ())

"""Stage 3 of the pipeline as a command: decode stage2_latents.safetensors with the model's VAE
and write output_video.mp4 plus the stage-3 fields of generation_config.json.

Order of work, so that bad input costs no decode and leaves no output behind: read and check the
stage-2 files -> check the output folder -> build or load the VAE, check its latent channels ->
(patch parallel: join the process group, plan the grid) -> decode -> frames -> write the video
and the config atomically (rank 0).

Speech-to-video latents are the clips end to end; each clip is decoded with its motion history
in front and keeps its own frames (official WanS2V.generate; `sampling.clips.clip_decodes`),
and the video is the clips' frames one after another.

    python stage3_vae_decode.py --input_dir stage_outputs                      # tiny random VAE
    python stage3_vae_decode.py --input_dir D --backend torch --device cuda    # diffusers on torch
    python stage3_vae_decode.py --input_dir D --vae_path /ckpts/Wan2.2_VAE.pth
    torchrun --nproc_per_node 4 stage3_vae_decode.py --input_dir D --vae_path V --patch_parallel
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from modules.vae import (
    PIXEL_SPECS,
    TINY_VAE_SEED,
    VaeError,
    build_tiny,
    enable_tiling,
    latent_channels,
    load_vae,
    spec_for,
    to_vae_latents,
)
from sampling.cli import CommandParser, add_compile_cache_flag, as_int, as_number, command, typed
from sampling.clips import clip_decodes
from sampling.errors import StageFileError, UsageError
from sampling.one_writer import one_writer
from sampling.pipelines import FLOAT_DTYPES, PIPELINES, TensorSpec, get_pipeline
from sampling.run_spec import DTYPES
from sampling.stage_io import (
    CONFIG,
    LATENTS,
    VIDEO,
    check_tensors,
    check_writable,
    read_stage2_tensors,
    write_video,
)
from vae_parallel.grid import PatchGridError

DEFAULT_DTYPE = "fp32"
# what an H.264 mp4 plays: ffmpeg refuses frame rates it cannot write as a 1/90000 time base,
# and no player shows more than a few hundred frames a second
MIN_FPS, MAX_FPS = 0.1, 1000.0


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        common={"input_dir", "output_dir", "model", "vae_path", "fps", "backend", "device",
                "patch_parallel"},
        description="Stage 3: decode stage-2 latents with the model's VAE into an mp4.")
    g = parser.add_argument_group("inputs and model")
    g.add_argument("--input_dir", default="stage_outputs",
                        help=f"the stage-2 folder ({LATENTS}, generation_config.json); default "
                             "./stage_outputs")
    g.add_argument("--output_dir", help=f"where {VIDEO} goes (default: --input_dir)")
    g.add_argument("--model", help="named pipeline (default: the config's `model`, or the "
                        "HunyuanVideo port's `transformer_version`)")
    g.add_argument("--vae_path", help="diffusers VAE folder, or one .safetensors/.pth file "
                        "(diffusers or official layout); default: a tiny random VAE of the "
                        "model's architecture (the video is then noise)")
    g.add_argument("--fps", type=float, help="frames per second (default: the config's "
                        "`fps`, else 16 for Wan2.2 I2V-A14B and 24 for the others)")
    g = parser.add_argument_group("advanced")
    g.add_argument("--dtype", choices=tuple(DTYPES), default=DEFAULT_DTYPE,
                   help=f"VAE weights and compute (default {DEFAULT_DTYPE})")
    g.add_argument("--backend", choices=("jax", "torch"),
                   help="jax: the decoder as two compiled programs (tpu/vae.py) on JAX's "
                        "devices, the frame's rows split over as many as divide them; torch: "
                        "diffusers on --device. Default: torch when --device, "
                        "--patch_parallel, --tiled or torchrun ask for it, else jax")
    g.add_argument("--device", help="torch backend: cpu, cuda or npu (default: cuda if "
                   "present, else cpu; with torchrun, the local rank's device)")
    add_compile_cache_flag(g)
    g = parser.add_argument_group("parallel")
    g.add_argument("--patch_parallel", action="store_true",
                        help="split the frame over the torchrun ranks (WORLD_SIZE > 1): halo "
                             "exchange, gathered attention K/V, two-stage gather")
    g.add_argument("--grid", help="patch grid ROWSxCOLS for --patch_parallel (default: the "
                        "least halo for the frame)")
    g = parser.add_argument_group("advanced")
    g.add_argument("--tiled", action="store_true",
                        help="diffusers' tiled decode (less memory on one device, small seams)")
    g.add_argument("--tile_size", type=int, help="tile size in pixels for --tiled "
                        "(default: diffusers' 256)")
    return parser


@dataclass(frozen=True, kw_only=True)
class Stage3Request:
    """Stage 3's command line, typed (None: not given)."""

    input_dir: str
    output_dir: str | None
    model: str | None
    vae_path: str | None
    fps: float | None
    dtype: str
    backend: str | None
    device: str | None
    compile_cache_dir: str | None
    patch_parallel: bool
    grid: str | None
    tiled: bool
    tile_size: int | None


def request_of(args: argparse.Namespace) -> Stage3Request:
    """The command line's request: the one place stage 3 reads its Namespace."""
    return typed(Stage3Request, args)


@dataclass(frozen=True, kw_only=True)
class Decode:
    """One decode, resolved and checked before any VAE work: the latents and what to make of
    them, and the request it came from."""

    request: Stage3Request
    pipe: object  # sampling.pipelines.Pipeline
    latents: torch.Tensor
    config: dict  # the stage-2 config, which the video's config continues
    size: tuple[int, int, int]  # frames, height, width of the video
    fps: float
    output_dir: str
    dtype: torch.dtype
    grid: object  # vae_parallel's PatchGrid, or None
    backend: str
    clips: list | None  # speech-to-video: each clip's decode
    compile_cache_dir: str | None


@dataclass(frozen=True, kw_only=True)
class DecodeReport:
    """What one decode did (rank 0 also wrote the video: `outputs`, `video`, `enlarged`); on JAX
    its compile counts."""

    model: str
    vae: str
    latent_shape: list
    clips: int | None
    ranks: int
    grid: list | None
    tiled: bool
    device: str
    dtype: str
    decode_seconds: float
    fps: float
    rank: int
    outputs: dict | None = None
    video: list | None = None
    enlarged: int | None = None
    loop_compiles: int | None = None
    prepare_compiles: int | None = None  # 0 for a decoder kept from a decode before
    # as stage 2's `compiles`: prepare, loop, process (everything this process compiled so far,
    # whose `compiled`, not served by the persistent cache, a second run keeps at 0)
    compiles: dict | None = None

    def as_dict(self) -> dict:
        """The summary's form: the fields a decode did not fill left out."""
        optional = ("outputs", "video", "enlarged", "loop_compiles", "prepare_compiles",
                    "compiles")
        return {k: v for k, v in dataclasses.asdict(self).items()
                if not (k in optional and v is None)}


def default_fps(pipe) -> float:
    """The official sample_fps: Wan2.2 I2V-A14B and S2V 16, TI2V-5B 24 (model_spec 2.5, 2.6);
    24 for HunyuanVideo-1.5 (`Pipeline.fps`)."""
    return pipe.fps


def _pipeline_name(request: Stage3Request, config, metadata) -> str:
    if request.model:
        return request.model
    for source in (config, metadata):
        if "model" in source:
            return str(source["model"])
    if "transformer_version" in config:
        return f"hunyuanvideo-1.5-{config['transformer_version']}"
    raise UsageError("the stage-2 config names no `model`; pass --model (one of "
                     f"{', '.join(PIPELINES)})")


def _grid_shape(text):
    if text is None:
        return None
    try:
        rows, cols = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--grid {text!r}: expected ROWSxCOLS, e.g. 2x2") from None
    if rows < 1 or cols < 1:
        raise UsageError(f"--grid {text!r}: expected ROWSxCOLS of positive integers, e.g. 2x2")
    return rows, cols


def resolve(request: Stage3Request) -> Decode:
    """Everything the decode needs, checked, before any VAE work."""
    if not os.path.isdir(request.input_dir):
        raise StageFileError(f"--input_dir {request.input_dir} is not a directory; expected the "
                             f"stage-2 folder holding {LATENTS}")
    tensors, metadata, config = read_stage2_tensors(request.input_dir)
    latents = tensors["latents"]
    name = _pipeline_name(request, config, metadata)
    if name not in PIPELINES:
        raise UsageError(f"unknown model {name!r}; expected one of {', '.join(PIPELINES)}")
    pipe = get_pipeline(name)
    channels = pipe.latent_channels
    if latents.dim() != 5 or latents.shape[0] != 1:
        raise StageFileError(f"{LATENTS}: latents have shape {list(latents.shape)}; expected "
                             f"[1, {channels}, F, H, W]")
    if latents.shape[1] != channels:
        raise StageFileError(f"{LATENTS}: latents have {latents.shape[1]} channels; the {name} VAE "
                             f"expects {channels} (shape [1, {channels}, F, H, W])")
    if 0 in latents.shape:
        raise StageFileError(f"{LATENTS}: latents have shape {list(latents.shape)}; expected at "
                             "least one latent frame, row and column")
    # as stage 2 refuses such stage-1 tensors: a video of NaN or of integers is no video
    check_tensors({"latents": latents}, {"latents": TensorSpec((None,) * 5, FLOAT_DTYPES)},
                  os.path.join(request.input_dir, LATENTS))
    st, ss = pipe.vae_stride
    height, width = latents.shape[3] * ss, latents.shape[4] * ss
    clips = None
    if pipe.task == "s2v":
        clips = _s2v_clips(pipe, tensors, metadata, os.path.join(request.input_dir, LATENTS))
        # the config's video_length is one clip's
        frames, clip_frames = sum(c.keep for c in clips), latents.shape[2] // len(clips) * st
    else:
        frames = clip_frames = (latents.shape[2] - 1) * st + 1
    source = os.path.join(request.input_dir, CONFIG)
    for key, value in (("video_length", clip_frames), ("height", height), ("width", width)):
        if config.get(key) is not None and as_int(f"{source}: {key}", config[key]) != value:
            raise StageFileError(f"{LATENTS}: latents {list(latents.shape)} decode to {key} "
                                 f"{value}" + (" per clip" if clips and key == "video_length" else "")
                                 + f"; generation_config.json says {config[key]}")
    if request.tiled and request.patch_parallel:
        raise UsageError("--tiled and --patch_parallel are alternatives (tiles inside patches "
                         "would not match the single-device decode); pick one")
    world = as_int("WORLD_SIZE (set by torchrun)", os.environ.get("WORLD_SIZE", "1"), minimum=1)
    if world > 1 and not request.patch_parallel:
        raise UsageError(f"launched on {world} ranks without --patch_parallel; add it, or run one "
                         "process")
    grid = None
    if request.patch_parallel and world > 1:  # checked here, on every rank alike, before any VAE work
        from vae_parallel import plan_grid
        grid = plan_grid(world, latents.shape[3], latents.shape[4], _grid_shape(request.grid))
    elif request.grid is not None:
        raise UsageError("--grid needs --patch_parallel under torchrun (WORLD_SIZE > 1)")
    if request.tile_size is not None and not request.tiled:
        raise UsageError("--tile_size needs --tiled")
    backend = _backend(request, world)
    compile_cache_dir = None
    if backend == "jax":  # as stage 2's
        from tpu.compile import check_cache_dir
        compile_cache_dir = check_cache_dir(request.compile_cache_dir)
    if request.fps is not None:
        fps = as_number("--fps", request.fps, minimum=MIN_FPS, maximum=MAX_FPS)
    elif config.get("fps") is not None:
        fps = as_number(f"{source}: fps", config["fps"], minimum=MIN_FPS, maximum=MAX_FPS)
    else:
        fps = default_fps(pipe)
    output_dir = request.output_dir if request.output_dir is not None else request.input_dir
    check_writable(output_dir, "--output_dir", (VIDEO, CONFIG))
    return Decode(request=request, pipe=pipe, latents=latents, config=config,
                  size=(frames, height, width), fps=fps, output_dir=output_dir,
                  dtype=DTYPES[request.dtype], grid=grid, backend=backend, clips=clips,
                  compile_cache_dir=compile_cache_dir)


def _s2v_clips(pipe, tensors, metadata, source):
    """The clips' decodes (`sampling.clips.ClipDecode`) of speech-to-video latents, from the
    clip layout stage 2 records in the latents' metadata and the reference or motion latents it
    writes beside them; refused when they do not fit together."""
    latents, (_, c, _, h, w) = tensors["latents"], tensors["latents"].shape
    fields = ("num_clips", "clip_latent_frames", "motion_latent_frames", "motion_history_given")
    missing = [k for k in fields if k not in metadata]
    if missing:
        raise StageFileError(f"{source} records no {', '.join(missing)}; expected the clip layout "
                             f"stage 2 writes with {pipe.name} latents (rerun stage 2)")
    clips, frames, history = (as_int(f"{source}: {k}", metadata[k], minimum=1) for k in fields[:3])
    given = metadata["motion_history_given"]
    if given not in ("true", "false"):
        raise StageFileError(f"{source}: motion_history_given {given!r}; expected true or false")
    if latents.shape[2] != clips * frames:
        raise StageFileError(f"{source}: latents have {latents.shape[2]} latent frames; its "
                             f"metadata records {clips} clips of {frames} ({clips * frames}), "
                             "end to end (rerun stage 2)")
    if given == "true":  # the first clip continued this history
        key, spec = "motion_latents", TensorSpec((1, c, history, h, w), doc="the first clip's "
                                                 "motion history")
    else:  # official drop_first_motion: the first clip decodes after the reference latent
        key, spec = "ref_latents", TensorSpec((1, c, 1, h, w), doc="the reference image latent")
    check_tensors(tensors, {key: spec}, source)
    return clip_decodes(latents, clips, history, pipe.vae_stride[0], **{key: tensors[key]})


_TORCH_ONLY = ("device", "patch_parallel", "tiled", "tile_size")


def _backend(request: Stage3Request, world: int) -> str:
    """The --backend asked for, or the default: torch where a torch-only flag or a torchrun
    world asks for it, else jax (as stage 2)."""
    torch_flags = [f"--{f}" for f in _TORCH_ONLY if getattr(request, f) not in (None, False)]
    if request.backend == "jax" and (torch_flags or world > 1):
        raise UsageError(f"{', '.join(torch_flags) or 'torchrun'} belong(s) to --backend torch; "
                         "the JAX backend splits the frame over JAX's own devices")
    if request.backend is not None:
        return request.backend
    return "torch" if torch_flags or world > 1 else "jax"


def build_vae(pipe, vae_path, dtype):
    """(vae, description): from the checkpoint, or tiny random weights from a fixed seed."""
    spec = spec_for(pipe)
    if spec.name in PIXEL_SPECS:
        if vae_path is not None:
            load_vae(spec, vae_path, dtype)  # refuses: a pixel-space model has no VAE
        return build_tiny(spec, pipe.latent_channels), "none (the latent is the clip)"
    if vae_path is None:
        vae = build_tiny(spec, pipe.latent_channels, seed=TINY_VAE_SEED, dtype=dtype)
        return vae, f"{spec.name} (tiny, random weights)"
    vae = load_vae(spec, vae_path, dtype)
    if latent_channels(vae) != pipe.latent_channels:
        raise VaeError(f"--vae_path {vae_path} decodes {latent_channels(vae)} latent channels; "
                       f"the {pipe.name} latents have {pipe.latent_channels}")
    return vae, f"{spec.name} ({vae_path})"


def device_for(name, local_rank):
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name in ("cuda", "npu") and local_rank is not None:
        return torch.device(name, local_rank)
    return torch.device(name)


_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


def _distributed(device: torch.device):
    """(rank, world size) of the torchrun group, joined with the device's backend."""
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds each rank to its own GPU
    if not dist.is_initialized():
        dist.init_process_group(_BACKENDS.get(device.type, "gloo"))  # env:// from torchrun
    return dist.get_rank(), dist.get_world_size()


def enlarge(frames, factor: int):
    """Frames enlarged by a whole factor (nearest neighbour): `Pipeline.enlarge` of the tiny
    pixel-space model, whose 16x16 clips players show as a dot and whose pixels H.264's
    half-resolution colour (yuv420p) would blur together."""
    if factor <= 1:
        return frames
    return np.repeat(np.repeat(frames, factor, axis=1), factor, axis=2)


def to_frames(video: torch.Tensor):
    """[1, 3, F, H, W] in [-1, 1] -> uint8 [F, H, W, 3] (the diffusers video post-processing)."""
    frames = ((video[0].float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return frames.permute(1, 2, 3, 0).cpu().numpy()


def video_frames(vae, latents, pipe, dtype=torch.float32):
    """uint8 frames [F, H, W, 3] of DiT latents on one device, enlarged as the pipeline asks."""
    z = to_vae_latents(vae, latents.to(dtype=dtype))
    return enlarge(to_frames(decode(vae, z, None, False, None)), pipe.enlarge)


def decode(vae, z, grid, tiled, tile_size):
    """The video on rank 0 (None elsewhere): patch parallel over `grid`, or on one device."""
    if grid is not None:
        from vae_parallel import PatchComm, parallel_decode
        return parallel_decode(vae, z, PatchComm(grid))
    if tiled:
        enable_tiling(vae, tile_size)
    with torch.no_grad():
        return vae.decode(z, return_dict=False)[0]


def clip_videos(decode_one, vae, clips, dtype=torch.float32, device=None):
    """Each speech-to-video clip's video [1, 3, keep, H, W]: `decode_one` of its [history |
    clip] latents (`sampling.clips.ClipDecode`, de-normalised here), cut to its last `keep`
    frames; None where decode_one gives None (a patch-parallel decode off rank 0)."""
    for clip in clips:
        video = decode_one(to_vae_latents(vae, clip.latents.to(device=device, dtype=dtype)))
        yield None if video is None else video[:, :, video.shape[2] - clip.keep:]


def decode_frames(decode_one, vae, r: Decode, device=None):
    """uint8 frames [F, H, W, 3] of the resolved latents (None off rank 0): one decode, or one
    per speech-to-video clip, the clips' frames one after another. Each clip becomes uint8 as
    soon as it is decoded, so only one clip's float video is held at a time."""
    if r.clips is None:
        videos = [decode_one(to_vae_latents(vae, r.latents.to(device=device, dtype=r.dtype)))]
    else:
        videos = clip_videos(decode_one, vae, r.clips, r.dtype, device)
    parts = [None if v is None else to_frames(v) for v in videos]
    if parts[0] is None:
        return None
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def run(args: argparse.Namespace) -> dict:
    return decode_stage(request_of(args)).as_dict()


def decode_stage(request: Stage3Request) -> DecodeReport:
    """The whole stage; returns the report (rank 0 writes the files)."""
    r = resolve(request)
    if r.backend == "jax":
        with one_writer(r.output_dir):
            return decode_jax(r)
    parallel = r.grid is not None
    device = device_for(request.device, int(os.environ.get("LOCAL_RANK", "0")) if parallel
                        else None)
    rank, world = _distributed(device) if parallel else (0, 1)
    try:
        # rank 0 writes the video: the other ranks of a patch-parallel decode hold nothing
        with one_writer(r.output_dir) if rank == 0 else contextlib.nullcontext():
            return decode_torch(r, rank, world, device)
    finally:
        if world > 1:
            import torch.distributed as dist
            dist.destroy_process_group()


def decode_jax(r: Decode, built=None, also=None, decoders=None) -> DecodeReport:
    """The decode on JAX (tpu/vae.py, imported here: the torch path never loads torchax);
    `built` and `also` as for `_run`; `decoders`: a dict in which the decoder (its weights on the
    devices, its compiled programs) is kept for the next decode of the job, by device count."""
    import jax

    from tpu.compile import enable_compile_cache

    # as stage 2, and before tpu.vae is imported (importing torchax compiles): the next run
    # finds every program in the persistent cache
    enable_compile_cache(r.compile_cache_dir)
    from tpu.vae import JaxVaeDecoder
    from tpu.vae_plan import make_mesh, mesh_size

    pipe, latents = r.pipe, r.latents
    vae, vae_name = built if built is not None else build_vae(pipe, r.request.vae_path, r.dtype)
    # this process's own devices: on a multi-host slice process 0 decodes alone (the
    # prompt-to-video command), so a mesh with another host's devices would wait for it forever
    devices = mesh_size(latents.shape[3], latents.shape[4], len(jax.local_devices()))
    decoders = {} if decoders is None else decoders
    if devices not in decoders:
        decoders[devices] = JaxVaeDecoder(vae, make_mesh(devices) if devices > 1 else None)
    decoder = decoders[devices]
    shapes = {tuple(c.latents.shape) for c in r.clips} if r.clips else {tuple(latents.shape)}
    began, cold = time.perf_counter(), decoder.compile_counts()
    for shape in sorted(shapes):  # every program compiles here, none in the decode loop
        decoder.prepare(shape)
    compiled = time.perf_counter()
    before = decoder.compile_counts()
    # the host copy of a JAX array is read-only; torch wants to own a writable one
    frames = decode_frames(lambda z: torch.from_numpy(np.array(decoder.decode(z))), vae, r)
    seconds = time.perf_counter() - compiled
    after = decoder.compile_counts()
    loop = after - before
    d = jax.local_devices()[0]
    with warnings.catch_warnings():
        # ffmpeg starts by fork + exec, which runs no JAX code in the child: JAX's warning about
        # forking its threads does not apply
        warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning)
        report = _write(r, frames, seconds, vae_name, 0, devices,
                        f"jax {d.platform}:{d.device_kind} x{devices}", also,
                        extra=dict(vae_backend="jax",
                                   stage3_compile_time=round(compiled - began, 3)))
    return dataclasses.replace(
        report, loop_compiles=loop.lowered, prepare_compiles=(before - cold).lowered,
        compiles={"prepare": (before - cold).to_dict(), "loop": loop.to_dict(),
                  "process": after.to_dict()})


def decode_torch(r: Decode, rank, world, device, built=None, also=None) -> DecodeReport:
    """Decode and write one resolved run; `built`: a (vae, name) of `build_vae` already on
    `device`, shared by the runs of a job (the prompt-to-video command); `also`: a Staged of
    files to commit with the video."""
    request = r.request
    vae, vae_name = built if built is not None else build_vae(r.pipe, request.vae_path, r.dtype)
    vae = vae.to(device)
    began = time.perf_counter()
    frames = decode_frames(lambda z: decode(vae, z, r.grid, request.tiled, request.tile_size),
                           vae, r, device)
    seconds = time.perf_counter() - began
    return _write(r, frames, seconds, vae_name, rank, world, device, also)


def _write(r: Decode, frames, seconds, vae_name, rank, world, device, also=None,
           extra=None) -> DecodeReport:
    """The report, and on rank 0 the video of uint8 `frames` and the config (plus the fields of
    `extra`) of one decode."""
    pipe, grid, request = r.pipe, r.grid, r.request
    report = DecodeReport(model=pipe.name, vae=vae_name, latent_shape=list(r.latents.shape),
                          clips=len(r.clips) if r.clips else None, ranks=world,
                          grid=list(grid.shape) if grid else None, tiled=request.tiled,
                          device=str(device), dtype=request.dtype, decode_seconds=seconds,
                          fps=r.fps, rank=rank)
    if rank != 0:
        return report
    expected = r.size
    if tuple(frames.shape[:3]) != expected:
        raise VaeError(f"the VAE decoded {list(frames.shape[:3])} (frames, height, width); the "
                       f"latents call for {list(expected)}"
                       + ("; choose another --tile_size" if request.tiled else ""))
    factor = pipe.enlarge
    frames = enlarge(frames, factor)
    config = dict(r.config)
    fields = dict(output_video=os.path.join(r.output_dir, VIDEO),
                  stage3_decode_time=round(seconds, 3), vae=vae_name, vae_dtype=request.dtype,
                  video_frames=expected[0], video_height=frames.shape[1],
                  video_width=frames.shape[2], video_enlarged=factor,
                  vae_patch_parallel_ranks=world,
                  vae_patch_grid=report.grid, vae_tiled=request.tiled, **(extra or {}))
    config.update(fps=r.fps, **fields)
    outputs = write_video(r.output_dir, frames, r.fps, config, also=also)
    return dataclasses.replace(report, outputs=outputs, video=list(frames.shape[:3]),
                               enlarged=factor)


def format_summary(report: dict) -> str:
    lines = [f"stage 3: {report['model']}  VAE {report['vae']}  {report['dtype']} on "
             f"{report['device']}",
             f"decode: latents {report['latent_shape']}"
             + (f" ({report['clips']} clips, each after its motion history)" if report["clips"]
                else "")
             + f" in {report['decode_seconds']:.2f} s on {report['ranks']} rank(s)"
             + (f", patch grid {report['grid'][0]}x{report['grid'][1]}" if report["grid"] else "")
             + (", tiled" if report["tiled"] else "")
             + (f"; loop compiles {report['loop_compiles']}, "
                f"{report['compiles']['process']['compiled']} compiled by XLA in all"
                if "compiles" in report else "")]
    if "video" in report:
        f, h, w = report["video"]
        lines.append(f"video: {f} frames {w}x{h} at {report['fps']:g} fps"
                     + (f" (enlarged {report['enlarged']}x)" if report["enlarged"] > 1 else ""))
        lines.append("wrote " + ", ".join(report["outputs"].values()))
    return "\n".join(lines)


ERRORS = (UsageError, StageFileError, VaeError, PatchGridError)

main = command(build_parser, run, format_summary, ERRORS, lambda report: report["rank"] == 0)

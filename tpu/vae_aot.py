"""Stage 3 compiled for a Cloud TPU slice on a machine without one: the real-size VAE decode. The
library of the command `python -m commands.vae_aot` (`commands/vae_aot.py`: its flags, the
`VaeAotRequest` they give, its printed summary): `compile_decode(request)` checks a request and
compiles it into the report.

The pipeline's VAE is built on the meta device at its released size (no weights read), its
decode traced by `tpu.vae.JaxVaeDecoder` exactly as stage 3 runs it (the first and the steady
per-latent-frame programs, rows split over the slice's devices) and compiled by libtpu for the
named slice. Reported per chip: HBM (the compiler's memory analysis of each program, and a plan
of the whole decode: weights, the carried causal caches, the program in flight and the previous
video chunk on its way to the host), TFLOP, collectives, and a roofline time (`tpu.program.Program`):
the first program once and the steady one for every further latent frame.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch

from modules.vae import VAES, spec_for
from sampling.journal import atomic_write
from sampling.pipelines import SizeError, get_pipeline
from sampling.run_spec import DTYPES
from sampling.stage_io import check_writable_file

from .program import ChainProgram, chain_record, chip_bytes, record
from .topology import AotError, parse_topology, topology_devices
from .vae_chain import Chain


@dataclasses.dataclass(frozen=True, kw_only=True)
class VaeAotRequest:
    """One deviceless compile of a decode, as the command's flags give it
    (`commands.vae_aot.request_of`, the one place they are read): a field per flag, named as its
    dest. Checked by `compile_decode` before libtpu is loaded."""

    model: str  # the pipeline whose VAE decodes (sampling.pipelines.PIPELINES)
    topology: str  # a TPU slice, e.g. v6e:2x4
    dtype: str  # a key of DTYPES
    height: int | None  # None: the pipeline's
    width: int | None
    video_length: int | None
    frames_per_call: int | None  # None: auto (tpu.vae_wan.WAN_FRAMES_PER_CALL)
    tiny: bool  # stage 3's tiny random-weight VAE instead of the released size
    json: str | None  # write the report here
    hlo_dir: str | None  # write each program's optimized HLO text here


def meta_vae(pipe, dtype, tiny: bool = False):
    """The pipeline's released VAE architecture on the meta device (shapes only); `tiny`: the
    tiny random-weight VAE stage 3 decodes the tiny pipelines with, instead."""
    spec = spec_for(pipe)
    if spec.name not in VAES:
        raise AotError(f"{pipe.name} samples in pixel space: there is no VAE to compile")
    config = spec.tiny_config(pipe.latent_channels) if tiny else spec.config
    import diffusers  # seconds to import: only where a VAE is built, as modules.vae does
    with torch.device("meta"):
        vae = getattr(diffusers, spec.class_name)(**config).eval()
    return spec, vae.to(dtype)


def compile_decode(request: VaeAotRequest) -> dict:
    """The report of one deviceless compile of the pipeline's decode (what `commands.vae_aot`
    prints and writes)."""
    chip, dims = parse_topology(request.topology)
    pipe = get_pipeline(request.model)
    # positive integers where given (commands.vae_aot.request_of), else the pipeline's
    size = [default if value is None else value for value, default in zip(
        (request.height, request.width, request.video_length), pipe.size, strict=True)]
    per_call = "auto" if request.frames_per_call is None else request.frames_per_call
    try:
        latent_shape = pipe.latent_shape(*size)
    except SizeError as exc:
        raise AotError(f"--{exc.name} {exc.value}: expected {exc.expected}") from None
    if pipe.task == "s2v":  # decoded clip by clip: one clip's latents with nothing in front
        raise AotError(f"{pipe.name} decodes clip by clip, each with its motion history in "
                       "front: compile the Wan2.1 VAE's decode of wan2.2-i2v-a14b instead")
    check_writable_file("--json", request.json)
    if request.hlo_dir:
        try:
            os.makedirs(request.hlo_dir, exist_ok=True)
        except OSError as exc:
            raise AotError(f"--hlo_dir {request.hlo_dir}: {exc.strerror}; expected a folder this "
                           "process can create or write") from None
    dtype = DTYPES[request.dtype]
    spec, vae = meta_vae(pipe, dtype, request.tiny)
    chip, devices = topology_devices(request.topology)

    from jax.sharding import Mesh

    from sharding.device_order import device_grid
    from tpu.vae_plan import AXIS, ROWS, split_plan

    from .vae import JaxVaeDecoder
    rows, split = split_plan(latent_shape[3], latent_shape[4], len(devices))
    mesh = Mesh(device_grid((rows,), devices[:rows]), (AXIS,))  # as tpu.vae_plan.make_mesh
    decoder = JaxVaeDecoder(vae, mesh, abstract=True, frames_per_call=per_call)
    began = time.perf_counter()
    compiled = dict(zip(("first", "steady"), decoder.prepare(tuple(latent_shape)), strict=True))
    seconds = time.perf_counter() - began
    weights = chip_bytes(decoder.params)
    frames = latent_shape[2]
    programs = {}
    for name, program in compiled.items():
        if program is None:
            continue
        if isinstance(program, Chain):  # a chain of block programs (tpu/vae_chain.py)
            programs[name] = chain_record(name, program, weight_bytes=weights)
        else:
            args_bytes = program.memory_analysis().argument_size_in_bytes
            programs[name] = record(name, program, seconds, weight_bytes=weights,
                                    activation_bytes=max(args_bytes - weights, 0))
        if request.hlo_dir:  # for `python -m tpu.hbm`: where the program's HBM traffic goes
            with open(os.path.join(request.hlo_dir, f"{name}.txt"), "w") as f:
                f.write(program.as_text())
    steady_p = programs.get("steady")
    k = decoder.per_call
    calls = {"first": 1, "steady": -(-(frames - 1) // k) if steady_p is not None else 0}
    roofline = sum(calls[n] * p.seconds(chip)["roofline"] for n, p in programs.items())
    # the same with each program's HBM bound from its HBM traffic (tpu.hbm)
    traffic = sum(calls[n] * p.seconds(chip, traffic=True)["roofline"]
                  for n, p in programs.items())
    tflop = sum(calls[n] * p.flops for n, p in programs.items()) / 1e12
    # In flight at the worst call: the weights, that call's carried state and input, its
    # temporaries and outputs (the new state beside the old one: nothing is donated), and the
    # previous call's video chunk, which the host copies out while this call runs.
    video = (1, 3, 1 + pipe.vae_stride[0] * (frames - 1), size[0], size[1])
    chunk = 3 * pipe.vae_stride[0] * k * size[0] * size[1] * 4 // rows  # float32, split
    peak = max(p.in_flight() for p in programs.values()) + chunk
    total = weights + peak
    report = {
        "model": pipe.name, "vae": spec.name + (" (tiny)" if request.tiny else ""),
        "topology": request.topology,
        "chip": {k: getattr(chip, k) for k in ("name", "hbm_bytes", "bf16_flops", "hbm_bandwidth",
                                                "ici_bandwidth", "devices_per_chip")},
        "devices": rows, "split": "rows" if split == ROWS else "columns", "chips": len(devices),
        "strips": [decoder.strips.rows, decoder.strips.cols] if decoder.strips else [1, 1],
        "frames_per_call": k,
        "dtype": request.dtype,
        "conv_operands": {t: n for n, t in DTYPES.items()}.get(decoder.operands, request.dtype),
        "size": size,
        "latent_shape": list(latent_shape), "video_shape": list(video),
        "programs": {n: {**(p.report() if isinstance(p, ChainProgram) else p.__dict__),
                         **p.seconds(chip), "ici_bytes": p.ici_bytes, "in_flight": p.in_flight(),
                         "traffic": p.seconds(chip, traffic=True), "calls": calls[n]}
                     for n, p in programs.items()},
        "memory": {"hbm": chip.hbm_bytes, "weights": weights, "in_flight": peak, "total": total,
                   "headroom": chip.hbm_bytes - total, "fits": total <= chip.hbm_bytes},
        "tflop": tflop, "roofline_seconds": roofline, "roofline_seconds_traffic": traffic,
        "compile_seconds": seconds,
        **_chain_compiles(compiled.values()),
    }
    if request.json:
        # whole or not at all, and no fixed temporary name two runs would share
        atomic_write(request.json, lambda f: json.dump(report, f, indent=1, default=str))
    return report


def _chain_compiles(programs) -> dict:
    """Of chains of block programs: how many distinct programs were compiled for the decode and
    the longest compile among them (they compile a core pair each: on a host with the cores, the
    decode's compile takes about that long)."""
    chains = [p for p in programs if isinstance(p, Chain)]
    keys = {k for c in chains for k in c.keys}
    if not keys:
        return {}
    seconds = chains[0].compile_seconds
    return {"programs_compiled": len(keys), "program_compile_seconds": max(seconds[k] for k in keys)}


def dtype_label(r: dict) -> str:
    """A report's dtype, and its conv operands' where they differ ("fp32, conv operands bf16");
    reports written before conv operands were recorded convolved as stored."""
    ops = r.get("conv_operands", r["dtype"])
    return r["dtype"] + (f", conv operands {ops}" if ops != r["dtype"] else "")


def strips_label(r: dict) -> str:
    """", each band as 4 x 2 strips" (`tpu.vae_strips.Strips`); nothing for a band kept whole (and
    for reports written before strips were recorded)."""
    rows, cols = r.get("strips", (1, 1))
    return f", each band as {rows} x {cols} strips" if rows * cols > 1 else ""


def units_label(r: dict) -> str:
    """What a report's "chips" count: chips, or devices where a chip holds several (v7x: its two
    TensorCores, each with half the chip's HBM); "per chip" figures are per device there."""
    n = r["chip"].get("devices_per_chip", 1)
    return "chips" if n == 1 else f"devices ({n} a chip)"


if __name__ == "__main__":  # the command moved; an old habit gets told where
    print("python -m tpu.vae_aot is now python -m commands.vae_aot (the same flags)",
          file=sys.stderr)
    sys.exit(2)

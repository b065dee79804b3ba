"""Ahead-of-time compile for a Cloud TPU slice, on a machine without one: the library of the
command `python -m commands.aot` (`commands/aot.py`: its flags, the `AotRequest` they give, its
printed summary).

With libtpu installed (`pip install "jax[tpu]==0.10.2"`), a topology name gives the compile-only
devices of a TPU slice (`tpu.topology`), and `jax.jit(f).lower(<abstract arguments sharded over a
mesh of them>).compile()` runs the real TPU compiler, Mosaic (splash) kernels included.
`tpu.aot_backend.AotBackend` is the JAX backend with every program call compiled instead of run,
and the project's own warm-up drives it, so exactly the programs the loop would run are
compiled: probe, middle, tail, cached tail, the residual add/sub and forecast combinations, each
scheduler combination, the frame write-back. This module takes a typed `AotRequest`, checks it
(every check before libtpu is loaded) and compiles it: `compile_run(request)` gives the report.

What is measured (the compiler's own figures, per chip): HBM arguments, outputs and temporaries
of each program, flops and bytes accessed (XLA's cost analysis; the splash kernel is a custom
call it cannot see, so its work is counted from the shapes it was traced with), collectives by
kind and bytes (read from the compiled HLO) and the chips each of their groups runs between
(`tpu.placement`: ICI hops per ring step, under the mesh's device order and under the list
order), compile seconds on this machine.
What is estimated: the memory plan of the whole run (weights resident, residual slots the gate
can hold, inputs, the largest program in flight) against the chip's HBM, and a roofline time
(each program bound by the larger of flops / peak bf16 rate, bytes / HBM bandwidth and received
collective bytes / ICI bandwidth) per call, per step and per run, with caching off and with the
cache schedule.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time

from sampling.platforms import quiet_cpu_default

from .topology import AotError, parse_topology, topology_devices, wraparound

quiet_cpu_default()  # before jax: see its docstring


from cache.flags import CacheFlags, config_of  # noqa: E402
from modules.checkpoint import cast_model, load_model  # noqa: E402
from modules.registry import build_model  # noqa: E402
from sampling.clips import fit_motion, motion_frames  # noqa: E402
from sampling.journal import atomic_write  # noqa: E402
from sampling.pipelines import get_pipeline  # noqa: E402
from sampling.run import make_sample, warm_up  # noqa: E402
from sampling.run_spec import (  # noqa: E402
    DTYPES,
    check_cfg,
    expert_path,
    shift_of,
    size_of,
    steps_of,
    with_cfg_parallel,
)
from sampling.schedulers import make_scheduler  # noqa: E402
from sampling.stage_io import check_writable_file  # noqa: E402
from sampling.stages import SignalPlan  # noqa: E402
from sharding.jax_sp import make_mesh  # noqa: E402

from .aot_backend import AotBackend, run_plan, step_helpers  # noqa: E402
from .placement import placement  # noqa: E402
from .program import chip_bytes  # noqa: E402


@dataclasses.dataclass(frozen=True, kw_only=True)
class AotRequest:
    """One deviceless compile, as the command's flags give it (`commands.aot.request_of`, the one
    place they are read): a field per flag, named as its dest, the cache flags as `CacheFlags`.
    Checked by `compile_run`, before libtpu is loaded."""

    model: str  # a named pipeline (sampling.pipelines.PIPELINES)
    model_path: str | None  # a checkpoint to check (headers only); None: the meta architecture
    topology: str  # a TPU slice, e.g. v6e:2x4
    sp_size: int
    cfg_parallel: bool
    weight_sharding: str | None  # sharding.jax_sp.WEIGHT_SHARDINGS; None: by the chip count
    swap_experts: bool
    height: int | None  # None: the pipeline's
    width: int | None
    video_length: int | None
    num_inference_steps: int | None
    sample_solver: str | None
    sample_shift: float | None
    guidance_scale: float | tuple[float, float] | None  # (low, high): two experts (sampling.guidance)
    image: bool
    dtype: str  # bf16 or fp32
    attention: str  # splash or jax_dpa
    computed_fraction: float | None
    unrolled: bool
    json: str | None  # also write the report here
    cache: CacheFlags


def _models(pipe, model_path, dtype) -> dict:
    models = {}
    for expert, name in pipe.experts:
        if model_path is None:
            models[expert] = cast_model(build_model(name, meta=True), dtype)
        else:
            models[expert], _ = load_model(expert_path(pipe, model_path, expert), name,
                                           dtype=dtype, meta=True)
    return models


def compile_run(request: AotRequest) -> dict:
    """The report of one deviceless compile (what `commands.aot` prints and writes)."""
    # Every flag is checked before libtpu is loaded (its setup noise, seconds) and long before the
    # compile (minutes at real sizes): a refusal is one line, at once.
    chip, dims = parse_topology(request.topology)
    # one JAX device per chip on v5e, v5p (megacore) and v6e; two (one per TensorCore) on v7x
    chips = math.prod(dims) * chip.devices_per_chip
    pipe = get_pipeline(request.model)
    # the resolution stage 2 makes of the same flags (sampling.run_spec): the same refusals
    config = with_cfg_parallel(config_of(request.cache), request.cfg_parallel,
                               request.cache.cfg_mode)
    sp, cfg = request.sp_size, 2 if request.cfg_parallel else 1
    if sp < 1:
        raise AotError(f"--sp_size {sp}: expected >= 1")
    if sp * cfg != chips:
        unit = "chip" if chip.devices_per_chip == 1 else "device"
        raise AotError(f"--sp_size {sp}{' --cfg_parallel' if cfg > 1 else ''} uses {sp * cfg} "
                       f"{unit}(s); topology {request.topology} has {chips}"
                       + ("" if unit == "chip" else f" ({chip.devices_per_chip} a chip)")
                       + f": give --sp_size {chips // cfg if chips % cfg == 0 else chips}"
                       f"{' --cfg_parallel' if cfg > 1 and chips % cfg == 0 else ''}, or a "
                       f"{sp * cfg}-{unit} topology")
    if request.computed_fraction is not None and not 0 < request.computed_fraction <= 1:
        raise AotError(f"--computed_fraction {request.computed_fraction}: expected in (0, 1]")
    size, latent_shape = size_of(pipe, (request.height, request.width, request.video_length))
    steps = steps_of(request.num_inference_steps, pipe)
    shift = shift_of(request.sample_shift, pipe)
    solver = request.sample_solver or pipe.solver
    guidance = request.guidance_scale  # read and checked as stage 2 reads it (request_of)
    cfg_on = check_cfg(config, pipe, guidance, request.cfg_parallel)
    fused = config.cfg_mode == "fused"
    if request.swap_experts and request.weight_sharding == "fsdp":
        raise AotError("--swap_experts plans for whole experts swapped in at the switch; with "
                       "--weight_sharding fsdp both stay resident, split")
    check_writable_file("--json", request.json)
    image = pipe.task == "i2v" or (pipe.task == "ti2v" and request.image)
    dtype = DTYPES[request.dtype]

    chip, devices = topology_devices(request.topology)
    if len(devices) != chips:  # the device count the checks above assumed
        raise AotError(f"--topology {request.topology}: libtpu gave {len(devices)} devices for "
                       f"{math.prod(dims)} chips, {chips} expected")
    models = _models(pipe, request.model_path, dtype)
    mesh = make_mesh(sp, cfg, devices) if sp * cfg > 1 else None
    plan = SignalPlan.from_config(config)
    began = time.perf_counter()
    weights = "replicated" if request.swap_experts else request.weight_sharding
    backend = AotBackend(models, plan, devices=devices, mesh=mesh, weights=weights,
                         attention_impl=request.attention, scan_blocks=not request.unrolled)
    tensors = pipe.synthesize(latent_shape, cfg_on, image, 0)
    if pipe.task == "s2v":  # sampled clip by clip (sampling/clips.py): one clip's programs
        tensors = pipe.clip_inputs(tensors, 0, fit_motion(tensors.get("motion_latents"),
                                                          motion_frames(pipe)), latent_shape)
    sample = make_sample(backend, pipe, tensors, latent_shape, image=image, seed=0,
                         guidance=guidance, fused_cfg=fused)
    scheduler = make_scheduler(solver, steps, shift)
    warm_up(backend, plan, scheduler, sample)
    helpers = step_helpers(backend, scheduler.fresh(), sample, cfg_on)
    branches = 1 if fused or not cfg_on else 2
    # each timestep input goes to the device before the loop; make_sample put one
    backend.input_bytes += (steps - 1) * chip_bytes(backend.put(
        pipe.timestep_input(0.0, latent_shape, image)))
    run_ = run_plan(backend, chip, config, steps=steps, branches=branches, helpers=helpers,
                    computed_fraction=request.computed_fraction, swap_experts=request.swap_experts)
    programs = {}
    for p in backend.records.values():
        programs.setdefault(p.name, {**dataclasses.asdict(p), **p.seconds(chip),
                                     "traffic": p.seconds(chip, traffic=True),
                                     "ici_bytes": p.ici_bytes})
    report = {
        "model": pipe.name, "topology": request.topology, "chip": dataclasses.asdict(chip),
        "chips": len(devices), "sp": sp, "cfg": cfg, "weight_sharding": backend.weight_sharding,
        "swap_experts": request.swap_experts, "attention": request.attention,
        "dtype": request.dtype,
        "scanned_runs": [[r.start, r.stop, r.period] for r in backend.runs],
        "size": list(size), "latent_shape": list(latent_shape), "tokens": pipe.tokens(latent_shape),
        "steps": steps, "solver": solver, "cache": {"modes": list(config.modes),
                                                    "probe_blocks": plan.fn_blocks,
                                                    "tail_blocks": plan.bn_blocks,
                                                    "config": config.to_dict()},
        "device": backend.device_name(), "programs": programs, "helpers_per_step": helpers,
        "memory": run_.memory, "seconds": run_.seconds, "schedule": run_.schedule,
        "compile_seconds": sum(p["compile_seconds"] for p in programs.values()),
        "wall_seconds": time.perf_counter() - began,
    }
    if mesh is not None:
        report["placement"] = run_placement(backend.collective_ops, mesh, devices, chip)
    if request.json:
        # whole or not at all, and no fixed temporary name two runs would share
        atomic_write(request.json, lambda f: json.dump(report, f, indent=1, default=str))
    return report


def run_placement(ops: dict, mesh, devices, chip) -> dict:
    """Where the run's collectives go (`tpu.placement`): under the mesh's order, and under the
    devices' list order (the mesh `jax.devices()` reshaped would be; same HLO, other chips)."""
    coords = [tuple(d.coords) for d in devices]
    extents = [max(c[i] for c in coords) + 1 for i in range(len(coords[0]))]
    orders = {"mesh": [tuple(d.coords) for d in mesh.devices.flat],
              "list_order": coords[:mesh.size]}
    return placement(ops, orders, extents=extents, wraps=wraparound(chip, tuple(extents)),
                     sp=mesh.shape["sp"])


if __name__ == "__main__":  # the command moved; an old habit gets told where
    print("python -m tpu.aot is now python -m commands.aot (the same flags)", file=sys.stderr)
    sys.exit(2)

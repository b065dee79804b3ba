"""Ahead-of-time compile for a Cloud TPU slice, on a machine without one: `python -m tpu.aot`.

With libtpu installed (`pip install "jax[tpu]==0.10.2"`), a topology name gives the compile-only
devices of a TPU slice (`tpu.topology`), and `jax.jit(f).lower(<abstract arguments sharded over a
mesh of them>).compile()` runs the real TPU compiler, Mosaic (splash) kernels included.
`tpu.aot_backend.AotBackend` is the JAX backend with every program call compiled instead of run,
and the project's own warm-up drives it, so exactly the programs the loop would run are
compiled: probe, middle, tail, cached tail, the residual add/sub and forecast combinations, each
scheduler combination, the frame write-back. This module is the command: flags, checks, report.

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

import argparse
import dataclasses
import json
import math
import sys
import time

from sampling.platforms import quiet_cpu_default

from .topology import AotError, GiB, parse_topology, topology_devices, wraparound

quiet_cpu_default()  # before jax: see its docstring

import torch  # noqa: E402

from cache import ConfigError  # noqa: E402
from cache.flags import config_of  # noqa: E402
from modules.checkpoint import cast_model, load_model  # noqa: E402
from modules.layers import ModelConfigError  # noqa: E402
from modules.layouts import CheckpointError  # noqa: E402
from modules.registry import build_model  # noqa: E402
from sampling.cache_cli import add_cache_arguments, cache_flags  # noqa: E402
from sampling.cli import as_number, command  # noqa: E402
from sampling.clips import fit_motion, motion_frames  # noqa: E402
from sampling.errors import StageFileError, UsageError  # noqa: E402
from sampling.journal import atomic_write  # noqa: E402
from sampling.pipelines import MAX_GUIDANCE, PIPELINES, get_pipeline  # noqa: E402
from sampling.run import make_sample, warm_up  # noqa: E402
from sampling.run_spec import (  # noqa: E402
    check_cfg,
    expert_path,
    shift_of,
    size_of,
    steps_of,
    with_cfg_parallel,
)
from sampling.schedulers import SOLVERS, SchedulerError, make_scheduler  # noqa: E402
from sampling.stage_io import check_writable_file  # noqa: E402
from sampling.stages import SignalPlan  # noqa: E402
from sharding.jax_sp import WEIGHT_SHARDINGS, make_mesh  # noqa: E402

from .aot_backend import AotBackend, run_plan, step_helpers  # noqa: E402
from .placement import format_placement, placement  # noqa: E402
from .program import chip_bytes  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tpu.aot",
        description="Compile every program a stage-2 run would use for a Cloud TPU slice, on this "
                    "machine (no TPU needed; libtpu must be installed), and report per chip: "
                    "HBM, flops, collectives, a memory plan of the whole run and a roofline time.")
    p.add_argument("--model", required=True, choices=tuple(PIPELINES), metavar="NAME",
                   help=f"named pipeline: {', '.join(PIPELINES)}")
    p.add_argument("--model_path", help="checkpoint to check (headers only; no tensor is read); "
                   "default: the architecture of --model on the meta device")
    p.add_argument("--topology", required=True, help="TPU slice, e.g. v6e:2x4 (v6e-8), v6e:1x1, "
                   "v5e:2x4, v5p:2x2x1, v7x:2x2x1 (v7x-8: 4 chips, 8 devices)")
    p.add_argument("--sp_size", type=int, default=1, help="sequence-parallel devices (default 1)")
    p.add_argument("--cfg_parallel", action="store_true", help="cond and uncond on two device "
                   "groups (a fused pair; 2 x sp_size chips)")
    p.add_argument("--weight_sharding", choices=WEIGHT_SHARDINGS,
                   help="replicated, or fsdp: block weights split over the mesh, gathered per "
                        "block (default: fsdp on several chips, replicated on one)")
    p.add_argument("--swap_experts", action="store_true", help="plan for keeping only the running "
                   "Wan2.2 I2V-A14B expert on the device (the other loaded at the switch)")
    p.add_argument("--height", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--video_length", type=int, help="frames, 4k + 1")
    p.add_argument("--num_inference_steps", type=int)
    p.add_argument("--sample_solver", choices=SOLVERS)
    p.add_argument("--sample_shift", type=float)
    p.add_argument("--guidance_scale", type=float, help="1 turns CFG off (one call per step)")
    p.add_argument("--image", action="store_true", help="TI2V with a first frame (per-token "
                   "timesteps); I2V pipelines always take their image")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="weights on the device, fp32 islands kept (default bf16, as a load gives)")
    p.add_argument("--attention", default="splash", choices=("splash", "jax_dpa"),
                   help="attention lowering (default splash, the TPU kernel)")
    p.add_argument("--computed_fraction", type=float,
                   help="adaptive caching (TeaCache/FBCache): the share of steps assumed computed, "
                        "for the run estimate")
    p.add_argument("--unrolled", action="store_true", help="compile the middle stage's blocks "
                   "unrolled, not as a loop over each run of repeating blocks (slower to compile)")
    p.add_argument("--json", help="also write the report here")
    add_cache_arguments(p)
    return p


def _models(pipe, model_path, dtype) -> dict:
    models = {}
    for expert, name in pipe.experts:
        if model_path is None:
            models[expert] = cast_model(build_model(name, meta=True), dtype)
        else:
            models[expert], _ = load_model(expert_path(pipe, model_path, expert), name,
                                           dtype=dtype, meta=True)
    return models


def run(args) -> dict:
    # Every flag is checked before libtpu is loaded (its setup noise, seconds) and long before the
    # compile (minutes at real sizes): a refusal is one line, at once.
    chip, dims = parse_topology(args.topology)
    # one JAX device per chip on v5e, v5p (megacore) and v6e; two (one per TensorCore) on v7x
    chips = math.prod(dims) * chip.devices_per_chip
    pipe = get_pipeline(args.model)
    # the resolution stage 2 makes of the same flags (sampling.run_spec): the same refusals
    config = with_cfg_parallel(config_of(cache_flags(args)), args.cfg_parallel, args.cfg_mode)
    sp, cfg = args.sp_size, 2 if args.cfg_parallel else 1
    if sp < 1:
        raise AotError(f"--sp_size {sp}: expected >= 1")
    if sp * cfg != chips:
        unit = "chip" if chip.devices_per_chip == 1 else "device"
        raise AotError(f"--sp_size {sp}{' --cfg_parallel' if cfg > 1 else ''} uses {sp * cfg} "
                       f"{unit}(s); topology {args.topology} has {chips}"
                       + ("" if unit == "chip" else f" ({chip.devices_per_chip} a chip)")
                       + f": give --sp_size {chips // cfg if chips % cfg == 0 else chips}"
                       f"{' --cfg_parallel' if cfg > 1 and chips % cfg == 0 else ''}, or a "
                       f"{sp * cfg}-{unit} topology")
    if args.computed_fraction is not None and not 0 < args.computed_fraction <= 1:
        raise AotError(f"--computed_fraction {args.computed_fraction}: expected in (0, 1]")
    size, latent_shape = size_of(pipe, (args.height, args.width, args.video_length))
    steps = steps_of(args.num_inference_steps, pipe)
    shift = shift_of(args.sample_shift, pipe)
    solver = args.sample_solver or pipe.solver
    guidance = args.guidance_scale
    if guidance is not None:
        as_number("--guidance_scale", guidance, minimum=0.0, maximum=MAX_GUIDANCE,
                  expected=f"a number in [0, {MAX_GUIDANCE:g}] (1 turns CFG off)")
    cfg_on = check_cfg(config, pipe, guidance, args.cfg_parallel)
    fused = config.cfg_mode == "fused"
    if args.swap_experts and args.weight_sharding == "fsdp":
        raise AotError("--swap_experts plans for whole experts swapped in at the switch; with "
                       "--weight_sharding fsdp both stay resident, split")
    check_writable_file("--json", args.json)
    image = pipe.task == "i2v" or (pipe.task == "ti2v" and args.image)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    chip, devices = topology_devices(args.topology)
    if len(devices) != chips:  # the device count the checks above assumed
        raise AotError(f"--topology {args.topology}: libtpu gave {len(devices)} devices for "
                       f"{math.prod(dims)} chips, {chips} expected")
    models = _models(pipe, args.model_path, dtype)
    mesh = make_mesh(sp, cfg, devices) if sp * cfg > 1 else None
    plan = SignalPlan.from_config(config)
    began = time.perf_counter()
    weights = "replicated" if args.swap_experts else args.weight_sharding
    backend = AotBackend(models, plan, devices=devices, mesh=mesh, weights=weights,
                         attention_impl=args.attention, scan_blocks=not args.unrolled)
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
                    computed_fraction=args.computed_fraction, swap_experts=args.swap_experts)
    programs = {}
    for p in backend.records.values():
        programs.setdefault(p.name, {**dataclasses.asdict(p), **p.seconds(chip),
                                     "traffic": p.seconds(chip, traffic=True),
                                     "ici_bytes": p.ici_bytes})
    report = {
        "model": pipe.name, "topology": args.topology, "chip": dataclasses.asdict(chip),
        "chips": len(devices), "sp": sp, "cfg": cfg, "weight_sharding": backend.weight_sharding,
        "swap_experts": args.swap_experts, "attention": args.attention, "dtype": args.dtype,
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
    if args.json:
        # whole or not at all, and no fixed temporary name two runs would share
        atomic_write(args.json, lambda f: json.dump(report, f, indent=1, default=str))
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


def _gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _collectives(c: dict) -> str:
    return ", ".join(f"{k} {v['count']} ({v['bytes'] / 2**20:.0f} MiB)" for k, v in sorted(c.items())) or "-"


def _device_note(chip: dict) -> str:
    """Where a JAX device is less than a chip (v7x: one TensorCore), what "per chip" below means."""
    n = chip.get("devices_per_chip", 1)
    return "" if n == 1 else f" TensorCore devices, {n} a chip; \"per chip\" below is per device"


def format_summary(r: dict) -> str:
    m, s, sch = r["memory"], r["seconds"], r["schedule"]
    chip = r["chip"]
    lines = [
        f"{r['model']} on {r['topology']} ({r['chips']} x {chip['name']}{_device_note(chip)}, "
        f"{_gib(chip['hbm_bytes'])} GiB HBM each): sp {r['sp']}, cfg {r['cfg']}, weights "
        f"{r['weight_sharding']}"
        + (" (one expert on the device)" if r["swap_experts"] else "")
        + f", {r['dtype']}, attention {r['attention']}",
        f"  {r['size'][0]}x{r['size'][1]}, {r['size'][2]} frames -> latents {r['latent_shape']} "
        f"({r['tokens']} tokens), {r['steps']} steps {r['solver']}; cache: "
        f"{'+'.join(r['cache']['modes']) or 'off'} (probe {r['cache']['probe_blocks']}, tail "
        f"{r['cache']['tail_blocks']} blocks)",
        "",
        "per chip, per call  (measured by the compiler; roofline estimated)",
        f"  {'program':12s} {'compile s':>9s} {'args GiB':>9s} {'out GiB':>8s} {'temp GiB':>9s} "
        f"{'TFLOP':>8s} {'GB acc.':>8s} {'GB HBM':>7s} {'roofline ms':>11s} {'bound':>7s}  "
        "collectives",
    ]
    for name, p in r["programs"].items():
        bound = max(("compute", "hbm", "ici"), key=lambda k: p[k])
        lines.append(f"  {name:12s} {p['compile_seconds']:9.1f} {_gib(p['argument_bytes']):>9s} "
                     f"{_gib(p['output_bytes']):>8s} {_gib(p['temp_bytes']):>9s} "
                     f"{p['flops'] / 1e12:8.2f} {p['bytes_accessed'] / 1e9:8.2f} "
                     f"{_gb(p.get('hbm_bytes')):>7s} "
                     f"{1e3 * p['roofline']:11.2f} {bound:>7s}  {_collectives(p['collectives'])}")
    lines += [
        "",
        "memory per chip over the run (estimated from the compiled programs)",
        f"  weights resident  {_gib(m['weights']):>7s} GiB  ({m['experts_resident']} expert(s), "
        f"{r['weight_sharding']})",
        f"  residual slots    {_gib(m['residual_slots']):>7s} GiB  ({m['slots']} x "
        f"{_gib(m['residual_bytes'])} GiB)",
        f"  probe references  {_gib(m['probe_references']):>7s} GiB",
        f"  inputs            {_gib(m['inputs']):>7s} GiB",
        f"  in flight         {_gib(m['in_flight']):>7s} GiB  (largest program: "
        f"{m['largest_program']}, + the hidden state the loop holds)",
        f"  total             {_gib(m['total']):>7s} GiB of {_gib(m['hbm'])}  -> "
        + (f"fits, {_gib(m['headroom'])} GiB headroom" if m["fits"]
           else f"DOES NOT FIT by {_gib(-m['headroom'])} GiB"),
    ]
    if m["switch_bytes"]:
        lines.append(f"  expert switch moves {_gib(m['switch_bytes'])} GiB to every chip once")
    lines += [
        "",
        f"roofline (peak {chip['bf16_flops'] / 1e12:.0f} TFLOP/s bf16, HBM "
        f"{chip['hbm_bandwidth'] / 1e9:.0f} GB/s, ICI {chip['ici_bandwidth'] / 1e9:.0f} GB/s "
        "bidirectional per chip; each program at its largest bound)",
        f"  full call {1e3 * s['full_call']:.1f} ms, reused call {1e3 * s['reused_call']:.1f} ms, "
        f"helpers {1e3 * s['helpers_per_step']:.2f} ms/step, {sch['branches_per_step']} call(s)/step",
        f"  caching off: {s['step_uncached']:.3f} s/step, {s['run_uncached']:.1f} s/run",
    ]
    if s["run_cached"] is not None:
        lines.append(f"  cached ({sch['computed_steps']}/{sch['steps']} steps computed, "
                     f"{sch['source']}): {s['step_cached']:.3f} s/step, {s['run_cached']:.1f} s/run,"
                     f" {s['speedup']:.2f}x")
    elif r["cache"]["modes"]:
        lines.append(f"  cached: {sch['source']}")
    t = s.get("traffic")
    if t is not None:
        lines.append(f"  with HBM traffic as the HBM bound (tpu.hbm): caching off "
                     f"{t['step_uncached']:.3f} s/step"
                     + (f", cached {t['step_cached']:.3f} s/step, {t['run_cached']:.1f} s/run"
                        if t["run_cached"] is not None else ""))
    if r.get("placement"):
        lines.append(format_placement(r["placement"]))
    lines.append(f"compiled {len(r['programs'])} programs in {r['compile_seconds']:.0f} s "
                 f"(wall {r['wall_seconds']:.0f} s)" + (f"; wrote {r['json']}" if r.get("json") else ""))
    return "\n".join(lines)


ERRORS = (AotError, UsageError, ConfigError, CheckpointError, ModelConfigError, StageFileError,
          SchedulerError)
main = command(build_parser, run, format_summary, ERRORS)

if __name__ == "__main__":
    sys.exit(main())

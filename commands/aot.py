"""The deviceless compile of stage 2's programs for a Cloud TPU slice, on a machine without one:
`python -m commands.aot`. Its flags, the one `AotRequest` they give (`request_of`), and the
printed summary; `tpu.aot` checks the request and compiles it (`tpu.aot.compile_run`), and its
docstring says what is measured and what is estimated.

    JAX_PLATFORMS=cpu python -m commands.aot --model wan2.2-i2v-a14b --topology v6e:2x4 --sp_size 8
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from sampling.platforms import quiet_cpu_default

quiet_cpu_default()  # before jax (sharding.jax_sp, tpu.aot import it): see its docstring

from cache import ConfigError  # noqa: E402
from modules.layers import ModelConfigError  # noqa: E402
from modules.layouts import CheckpointError  # noqa: E402
from sampling.cache_cli import add_cache_arguments  # noqa: E402
from sampling.cli import command, typed  # noqa: E402
from sampling.errors import StageFileError, UsageError  # noqa: E402
from sampling.guidance import parse_guidance  # noqa: E402
from sampling.pipelines import PIPELINES, get_pipeline  # noqa: E402
from sampling.run_spec import DIT_DTYPES  # noqa: E402
from sampling.schedulers import SOLVERS, SchedulerError  # noqa: E402
from sampling.units import GiB  # noqa: E402
from sharding.jax_sp import WEIGHT_SHARDINGS  # noqa: E402
from tpu.aot import AotRequest, compile_run  # noqa: E402
from tpu.placement import format_placement  # noqa: E402
from tpu.topology import AotError  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m commands.aot",
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
    p.add_argument("--guidance_scale", help="1 turns CFG off (one call per step); 'low,high' for "
                   "Wan2.2 I2V-A14B's experts, as stage 2 takes it")
    p.add_argument("--image", action="store_true", help="TI2V with a first frame (per-token "
                   "timesteps); I2V pipelines always take their image")
    p.add_argument("--dtype", choices=tuple(reversed(DIT_DTYPES)), default="bf16",
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


def request_of(args: argparse.Namespace) -> AotRequest:
    """The command line's request: the one place the compile reads its Namespace. Each field from
    the flag of its name; the cache flags as `CacheFlags`; the guidance as stage 2 reads it (a
    number, or 'low,high' for a two-expert pipeline)."""
    return dataclasses.replace(typed(AotRequest, args), guidance_scale=parse_guidance(
        args.guidance_scale, get_pipeline(args.model)))


def run(args: argparse.Namespace) -> dict:
    return compile_run(request_of(args))


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

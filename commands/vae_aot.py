"""Stage 3 compiled for a Cloud TPU slice on a machine without one: the real-size VAE decode.

    JAX_PLATFORMS=cpu python -m commands.vae_aot --model wan2.2-ti2v-5b --topology v6e:2x4

The command: its flags, the one `VaeAotRequest` they give (`request_of`), and the printed
summary. `tpu.vae_aot` checks the request and compiles it (`tpu.vae_aot.compile_decode`); its
docstring says what is reported.
"""

from __future__ import annotations

import argparse
import sys

from sampling.cli import as_int
from sampling.pipelines import PIPELINES
from sampling.units import GiB
from tpu.topology import AotError
from tpu.vae_aot import (
    VaeAotRequest,
    compile_decode,
    dtype_label,
    strips_label,
    units_label,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m commands.vae_aot",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, choices=sorted(PIPELINES),
                   help="the pipeline whose VAE decodes (its released architecture)")
    p.add_argument("--topology", required=True, help="TPU slice, e.g. v6e:2x4 (v6e-8)")
    # the decoder's compile is planned for fp32 and bf16 (stage 3 also takes fp16)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="VAE weights and compute (stage 3's --dtype)")
    p.add_argument("--height", default=None, help="video height (default: the pipeline's)")
    p.add_argument("--width", default=None, help="video width (default: the pipeline's)")
    p.add_argument("--video_length", default=None, help="frames (default: the pipeline's)")
    p.add_argument("--frames_per_call", default=None, help="latent frames a steady call decodes "
                   "(Wan; default: tpu.vae_wan.WAN_FRAMES_PER_CALL)")
    p.add_argument("--tiny", action="store_true", help="the tiny VAE of stage 3's random-weight "
                   "decode instead of the released size (a quick check of the compile path)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--hlo_dir", default=None, help="write each program's optimized HLO text "
                   "here (first.txt, steady.txt; `python -m tpu.hbm` reads them)")
    return p


def _count(flag: str, value) -> int | None:
    return None if value is None else as_int(flag, value, minimum=1, expected="a positive integer")


def request_of(args: argparse.Namespace) -> VaeAotRequest:
    """The command line's request: the one place the decode's compile reads its Namespace (the
    sizes and --frames_per_call, given as text, read as positive integers)."""
    return VaeAotRequest(
        model=args.model, topology=args.topology, dtype=args.dtype,
        height=_count("--height", args.height), width=_count("--width", args.width),
        video_length=_count("--video_length", args.video_length),
        frames_per_call=_count("--frames_per_call", args.frames_per_call), tiny=args.tiny,
        json=args.json, hlo_dir=args.hlo_dir)


def run(args: argparse.Namespace) -> dict:
    return compile_decode(request_of(args))


def format_summary(r: dict) -> str:
    m = r["memory"]
    lines = [f"{r['model']} decode ({r['vae']}, {dtype_label(r)}) on {r['topology']}: latents "
             f"{r['latent_shape']} -> video {r['video_shape']}, {r['split']} split over "
             f"{r['devices']} of {r['chips']} {units_label(r)}{strips_label(r)}",
             f"  {'program':8s} {'calls':>5s} {'args GiB':>8s} {'temp GiB':>8s} {'out GiB':>8s} "
             f"{'TFLOP':>7s} {'GB acc.':>8s} {'GB HBM':>7s} {'roofline ms':>11s} "
             f"{'(traffic)':>9s}  collectives"]
    for n, p in r["programs"].items():
        coll = ", ".join(f"{k} {v['count']}" for k, v in p["collectives"].items()) or "none"
        lines.append(f"  {n:8s} {p['calls']:5d} {p['argument_bytes'] / GiB:8.2f} "
                     f"{p['temp_bytes'] / GiB:8.2f} {p['output_bytes'] / GiB:8.2f} "
                     f"{p['flops'] / 1e12:7.2f} {p['bytes_accessed'] / 1e9:8.2f} "
                     f"{p['hbm_bytes'] / 1e9:7.2f} {1e3 * p['roofline']:11.2f} "
                     f"{1e3 * p['traffic']['roofline']:9.2f}  {coll}")
    lines.append(f"  per chip: {m['total'] / GiB:.2f} GiB of {m['hbm'] / GiB:.2f} "
                 f"({'fits' if m['fits'] else 'DOES NOT FIT'}; weights {m['weights'] / GiB:.2f}, "
                 f"in flight {m['in_flight'] / GiB:.2f}); {r['tflop']:.1f} TFLOP; roofline "
                 f"{r['roofline_seconds']:.2f} s ({r['roofline_seconds_traffic']:.2f} s with HBM "
                 f"traffic); compiled in {r['compile_seconds']:.0f} s{_compiles_label(r)}")
    return "\n".join(lines)


def _compiles_label(r: dict) -> str:
    if "programs_compiled" not in r:
        return ""
    return (f" ({r['programs_compiled']} programs, a compile per core pair, the longest "
            f"{r['program_compile_seconds']:.0f} s)")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = run(args)
    except (AotError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

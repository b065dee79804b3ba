"""Real-size pipelines compiled for Cloud TPU slices on this CPU machine: the table of
bench/results/tpu_aot.md.

    pip install "jax[tpu]==0.10.2"       # libtpu: the compiler (in requirements-dev.txt)
    python bench/tpu_aot.py [--only ROW[,ROW...]] [--rerun]

Each row is one `python -m tpu.aot` run (one at a time: a real-size compile takes minutes and a
few GB), its report kept as JSON under bench/results/tpu_aot/ and reused unless --rerun, so the
table can be rebuilt or extended without compiling again. Per row: whether the whole run fits the
chip's HBM and the memory per chip, compile seconds on this machine, TFLOP per step and roofline
seconds per step (caching off, and with the cache schedule), beside the anchor's measured
HunyuanVideo-1.5 figures on v6e-8 (tpu_notes 1.8): 7.29 s/step (stock splash), 5.81 s/step
(exp2 kernel), DeepCache about 1.8x.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tpu.vae_aot import dtype_label, strips_label  # noqa: E402  (decode cells, as it prints them)

OUT = ROOT / "bench" / "results" / "tpu_aot"
BEFORE = OUT / "unrolled"  # reports compiled before the middle stage became a scan
GiB = 2**30

# (row name, command arguments): every named real-size pipeline at its default size and default
# weight layout (FSDP on several chips), beside the alternatives it was chosen over; DeepCache at
# its default schedule (11/45/4)
ROWS = [
    ("hy15-720p-v6e8", "--model hunyuanvideo-1.5-720p_t2v --topology v6e:2x4 --sp_size 8"),
    ("hy15-720p-v6e8-replicated", "--model hunyuanvideo-1.5-720p_t2v --topology v6e:2x4 --sp_size 8 "
                                  "--weight_sharding replicated"),
    ("hy15-720p-v5e8", "--model hunyuanvideo-1.5-720p_t2v --topology v5e:2x4 --sp_size 8"),
    ("hy15-720p-v5p4", "--model hunyuanvideo-1.5-720p_t2v --topology v5p:2x2x1 --sp_size 4"),
    ("hy15-480p-49f-v6e1", "--model hunyuanvideo-1.5-480p_t2v --topology v6e:1x1 --video_length 49"),
    ("ti2v5b-v6e8", "--model wan2.2-ti2v-5b --topology v6e:2x4 --sp_size 8"),
    ("ti2v5b-v5e8", "--model wan2.2-ti2v-5b --topology v5e:2x4 --sp_size 8"),
    ("ti2v5b-v5p4", "--model wan2.2-ti2v-5b --topology v5p:2x2x1 --sp_size 4"),
    ("a14b-v6e8", "--model wan2.2-i2v-a14b --topology v6e:2x4 --sp_size 8"),
    ("a14b-v6e8-swap", "--model wan2.2-i2v-a14b --topology v6e:2x4 --sp_size 8 --swap_experts"),
    ("a14b-v6e8-replicated", "--model wan2.2-i2v-a14b --topology v6e:2x4 --sp_size 8 "
                             "--weight_sharding replicated"),
    ("a14b-v5e8", "--model wan2.2-i2v-a14b --topology v5e:2x4 --sp_size 8"),
    ("a14b-v5e16-cfg", "--model wan2.2-i2v-a14b --topology v5e:4x4 --sp_size 8 --cfg_parallel"),
    ("a14b-v5p4", "--model wan2.2-i2v-a14b --topology v5p:2x2x1 --sp_size 4"),
]
# Stage 3: each pipeline's VAE decode at its default size (stage 3's default fp32), beside the
# stage-2 row whose roofline run it is measured against
DECODE_ROWS = [
    ("vae-ti2v5b-v6e8", "--model wan2.2-ti2v-5b --topology v6e:2x4", "ti2v5b-v6e8"),
    ("vae-ti2v5b-v6e8-bf16", "--model wan2.2-ti2v-5b --topology v6e:2x4 --dtype bf16",
     "ti2v5b-v6e8"),
    ("vae-ti2v5b-v5e8", "--model wan2.2-ti2v-5b --topology v5e:2x4", "ti2v5b-v5e8"),
    ("vae-ti2v5b-v5p4", "--model wan2.2-ti2v-5b --topology v5p:2x2x1", "ti2v5b-v5p4"),
    ("vae-a14b-v6e8", "--model wan2.2-i2v-a14b --topology v6e:2x4", "a14b-v6e8"),
    ("vae-a14b-v5e8", "--model wan2.2-i2v-a14b --topology v5e:2x4", "a14b-v5e8"),
    ("vae-a14b-v5p4", "--model wan2.2-i2v-a14b --topology v5p:2x2x1", "a14b-v5p4"),
    ("vae-hy15-720p-v6e8", "--model hunyuanvideo-1.5-720p_t2v --topology v6e:2x4", "hy15-720p-v6e8"),
    ("vae-hy15-720p-v5e8", "--model hunyuanvideo-1.5-720p_t2v --topology v5e:2x4", "hy15-720p-v5e8"),
    ("vae-hy15-720p-v5p4", "--model hunyuanvideo-1.5-720p_t2v --topology v5p:2x2x1", "hy15-720p-v5p4"),
]
DECODE_SHARE = 0.10  # the decode's roofline against the stage-2 run's, at most
DECODE_TRAFFIC = (
    "On a TPU the fp32 Wan decoders round each convolution's input and weight to bf16 in the "
    "program and sum in fp32 (`tpu.vae.conv_operand_dtype`): what the TPU's DEFAULT precision "
    "does to an fp32 convolution anyway, stated where the operands are made, so the weights, the "
    "carried caches and every convolution's input move half the bytes (\"conv operands bf16\" in "
    "the decode cell). And each chip's band of the frame runs as a batch of at least 8 strips "
    "(`tpu.vae.strip_grid`; the cell says the grid): of a convolution with a batch under 8, "
    "libtpu's space-to-batch pass makes 8 batches of the frame's width, so every convolution's "
    "input was padded and relaid out into them and its fp32 output copied back for the norm that "
    "reads it (27% of the TI2V-5B decode's HBM traffic). Batches of 4 are still cut, of 8 not; "
    "turning the pass off by flags instead cut one convolution's traffic by two thirds but its "
    "compile from 28 to 378 s, and the whole decode did not compile in 43 minutes. Each strip's "
    "zero padding is its halo, gathered by strip index from the neighbours' border lines "
    "(collective-permutes of those lines between chips) and written with the strip once; the "
    "upsamplers' 3x3 convolutions run as 1x3x3 3-D ones without folding the frames into the "
    "batch, and Wan2.2's shortcut upsampler repeats pixels instead of transposing its output. "
    "The TI2V-5B fp32 decode on v6e-8, per steady call per chip (`python -m tpu.vae_aot --model "
    "wan2.2-ti2v-5b --topology v6e:2x4 --hlo_dir D`, then `python -m tpu.hbm D/steady.txt`), GB "
    "accessed / GB of HBM traffic: 45.0 / 30.4 with fp32 operands, 40.2 / 23.8 with bf16 ones, "
    "36.0 / 18.6 as 4 x 2 strips a chip, 31.9 / 16.0 with the upsamplers reformulated, 25.3 / "
    "9.3 with the halo gathered from border lines (its first form split the batch axis into the "
    "strip grid, and XLA relaid the strips out several times a convolution; the other Wan rows "
    "were compiled with an equivalent form of the halo that measured 25.3 / 9.2 here): 15.4 ms "
    "a call by bytes "
    "accessed, 9.1 ms by traffic, where the 8.35 TFLOP of the call bound it. The whole decode "
    "went from 0.75 s to 0.47 s (13.6% to 8.6% of the stage-2 run) by bytes accessed and 0.44 s "
    "to 0.28 s (11.3% to 7.1%) by traffic, 289 to 253 TFLOP (the width is no longer padded to "
    "8 x 11 columns), 3.25 to 2.69 GiB per chip, and its compile from 748 to 363 s. The A14B "
    "decode (9 x 1 strips) went from 0.69 / 0.42 s to 0.61 / 0.22 s, with 3.5 GiB of "
    "temporaries per chip instead of 1.5. Two latent frames per steady call (`--frames_per_call "
    "2`, measured before the halo's last form): 25.6 GB accessed a frame against 31.9, but 18.5 "
    "GB of traffic against 16.0, so one stays the default. Whether a TPU runs these programs as "
    "the roofline says, and whether its numbers equal the fp32 program's, stay to be measured "
    "on a slice.")
CACHE = "--enable_cache"  # DeepCache: a schedule known before the run, so the roofline is exact
V5_BLOCKS = ("v5e and v5p compile splash with 1024-row query blocks (tpu/attention.py "
             "BLOCKS_BY_KIND): the stock 2048-row blocks ask 17.5 MiB (v5e) and 21.6 MiB (v5p) "
             "of scoped VMEM in Wan2.2 TI2V-5B's middle, over the 16 MiB those chips give a kernel.")
# reports compiled before tpu.aot read past the splash kernel's multi-line metadata (a line of it
# starting `}},` ended the computation: every program's collectives after its first kernel were
# dropped); drop a row from here once it is compiled again
UNDERCOUNTED: dict[str, str] = {}  # every such report has been compiled again
ANCHOR = ("HunyuanVideo-1.5 720p 121 frames on v6e-8, measured by the anchor (gpu-tpu-pedia, "
          "tpu_notes 1.8): 7.29 s/step with stock splash, 5.81 s/step with its exp2 kernel, "
          "DeepCache ~1.8x (1.83x measured at 49 frames)")


def run_row(name: str, args: str, rerun: bool, module: str = "tpu.aot") -> dict:
    """One row's report: `python -m <module> <args> --json`, reused unless `rerun`."""
    path = OUT / f"{name}.json"
    if path.exists() and not rerun:
        return json.loads(path.read_text())
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    began = time.perf_counter()
    extra = CACHE.split() if module == "tpu.aot" else []
    out = subprocess.run([sys.executable, "-m", module, *args.split(), *extra, "--json", str(path)],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{name}: {module} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    (OUT / f"{name}.txt").write_text(out.stdout)
    print(f"{name}: {time.perf_counter() - began:.0f} s", file=sys.stderr)
    return json.loads(path.read_text())


def decode_line(r: dict, stage2: dict | None) -> str:
    m, chip = r["memory"], r["chip"]
    verdict = (f"fits ({m['headroom'] / GiB:.1f} left)" if m["fits"]
               else f"NO (over by {-m['headroom'] / GiB:.1f})")
    steady = r["programs"].get("steady", {})
    if stage2 is None:
        run2, share = "no report", "-"
    else:
        run2 = f"{stage2['seconds']['run_cached']:.1f}"
        share = _share(r["roofline_seconds"], stage2["seconds"]["run_cached"])
    # the same with every program's HBM bound from its HBM traffic (tpu.hbm), both stages
    traffic2 = (stage2 or {}).get("seconds", {}).get("traffic")
    if r.get("roofline_seconds_traffic") is None:
        t_roof, t_share = "-", "not counted"
    else:
        t_roof = f"{r['roofline_seconds_traffic']:.2f}"
        t_share = "stage 2 not counted" if traffic2 is None else \
            f"{_share(r['roofline_seconds_traffic'], traffic2['run_cached'])} of " \
            f"{traffic2['run_cached']:.1f} s"
    return (f"| {r['model']} ({r['vae']}, {dtype_label(r)}) | {r['topology']} ({chip['name']}) | "
            f"{r['devices']} of {r['chips']} ({r.get('split', 'rows')}{strips_label(r)}) | "
            f"{' x '.join(map(str, r['video_shape'][2:]))} | {verdict} | "
            f"{m['total'] / GiB:.2f} ({m['weights'] / GiB:.2f} weights) | {r['compile_seconds']:.0f} "
            f"| {r['tflop']:.0f} | {1e3 * steady.get('roofline', 0):.0f} "
            f"({max(('compute', 'hbm', 'ici'), key=lambda k: steady.get(k, 0))}) | "
            f"{r['roofline_seconds']:.2f} | {run2} | {share} | {t_roof} | {t_share} |")


def _share(decode: float, stage2: float) -> str:
    frac = decode / stage2
    return f"{frac:.1%} ({'met' if frac <= DECODE_SHARE else 'NOT met'})"


def decode_lines(only, rerun: bool) -> list[str]:
    lines = [
        "## Stage 3: the VAE decode on the same slices",
        "",
        "`python bench/tpu_aot.py` (each row: `python -m tpu.vae_aot <row arguments>`). The",
        "pipeline's released VAE built on the meta device, its decode traced by `tpu.vae` as stage 3",
        "runs it on JAX (a first program for latent frame 0, a steady one for each further latent",
        "frame with the causal caches carried; the frame split by rows, or by columns where the",
        "rows do not divide, over the largest divisor of the chip count that divides them:",
        "`tpu.vae.split_plan`, and for Wan each chip's band run as a batch of strips:",
        "`tpu.vae.strip_grid`), in fp32 as stage 3's default unless the row says bf16, compiled for",
        "the slice. Per chip: GiB of the whole decode (weights, carried caches and inputs, the",
        "program's temporaries and outputs, and the previous video chunk on its way to the host),",
        "TFLOP of the whole clip, the steady program's roofline (its bound), the clip's roofline",
        "(first + steady per further latent frame), and its share of the stage-2 run's roofline",
        f"with the default cache schedule (the table above); the goal is at most {DECODE_SHARE:.0%}.",
        "The last two columns take each program's HBM bound from its HBM traffic instead (both",
        "stages; see below the table).",
        "",
        "| decode | slice | chips used (split) | video (frames x H x W) | fits (GiB left) | GiB per "
        "chip | compile s | TFLOP per chip | steady ms (bound) | roofline s | stage-2 run s, cached "
        "| share | roofline s, HBM traffic | share, HBM traffic |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    missing = []
    for name, row_args, stage2_name in DECODE_ROWS:
        path = OUT / f"{name}.json"
        if only is not None and name not in only:
            if not path.exists():
                missing.append(name)
                continue
            report = json.loads(path.read_text())
        else:
            report = run_row(name, row_args, rerun, "tpu.vae_aot")
        s2 = OUT / f"{stage2_name}.json"
        lines.append(decode_line(report, json.loads(s2.read_text()) if s2.exists() else None))
    lines += ["", "Compile seconds: on this 2-core machine. The Wan rows were compiled on "
              "2026-11-26 evening, as strips, two at a time (before, alone, the TI2V-5B v6e fp32 "
              "and bf16 rows took 748 and 1093 s; 2573 and 5298 s beside other jobs before "
              "that); the HunyuanVideo-1.5 v6e-8 row earlier beside other jobs (load average "
              "5-8; that older report counts the encoder's weights too in GiB per chip), its "
              "v5e-8 and v5p-4 rows that evening beside one other job.", "", DECODE_TRAFFIC]
    if missing:
        lines += ["", f"Not compiled yet (no report): {', '.join(missing)}; `python bench/tpu_aot.py "
                  f"--decode_only --only {','.join(missing)}` adds them."]
    return lines + [""]


def _compile_cell(name: str, r: dict) -> str:
    """Compile seconds (middle program's in brackets), after the report compiled with the
    middle's blocks unrolled (before issue 24's scan, kept under unrolled/) where there is one."""
    def fmt(rep):
        return f"{rep['compile_seconds']:.0f} ({rep['programs']['middle']['compile_seconds']:.0f})"
    before = BEFORE / f"{name}.json"
    if not before.exists():
        return fmt(r)
    return f"{fmt(json.loads(before.read_text()))} -> {fmt(r)}"


def row_line(name: str, args: str, r: dict) -> str:
    m, s, sch = r["memory"], r["seconds"], r["schedule"]
    chip = r["chip"]
    flops_step = sum(p["flops"] for n, p in r["programs"].items() if n in ("probe", "middle", "tail")) \
        * sch["branches_per_step"] / 1e12
    weights = r["weight_sharding"] + (" (1 expert resident)" if r["swap_experts"] else "")
    verdict = (f"fits ({m['headroom'] / GiB:.1f} left)" if m["fits"]
               else f"NO (over by {-m['headroom'] / GiB:.1f})")
    return (f"| {r['model']} | {r['topology']} ({chip['name']}, {chip['hbm_bytes'] / GiB:.2f} GiB) "
            f"| {r['sp']}{' x cfg 2' if r.get('cfg', 1) == 2 else ''} | {weights} | {verdict} "
            f"| {m['total'] / GiB:.1f} "
            f"({m['weights'] / GiB:.1f} weights) | {_compile_cell(name, r)} | {flops_step:.0f} "
            f"| {s['step_uncached']:.2f} | {sch['computed_steps']}/{sch['steps']} | "
            f"{s['step_cached']:.2f} ({s['speedup']:.2f}x) | {_traffic_cell(s.get('traffic'))} |")


def _traffic_cell(t: dict | None) -> str:
    if t is None:
        return "-"
    return f"{t['step_uncached']:.2f} off, {t['step_cached']:.2f} cached ({t['speedup']:.2f}x)"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="compile only these rows (names, comma-separated); the others "
                    "come from their reports if present")
    ap.add_argument("--rerun", action="store_true", help="compile again even if a report exists")
    ap.add_argument("--decode_only", action="store_true", help="compile no stage-2 row (the "
                    "stage-3 rows named by --only, or all of them, still compile)")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Real-size pipelines compiled for Cloud TPU slices (deviceless)",
        "",
        "`python bench/tpu_aot.py` (each row: `python -m tpu.aot <row arguments> --enable_cache`;",
        "reports and the full per-program printout under `bench/results/tpu_aot/`).",
        "Compiled by libtpu for the named slice on a 2-core CPU machine without a TPU; jax 0.10.2,",
        "libtpu 0.0.42.1, bf16 weights with the checkpoints' fp32 islands, splash attention",
        "(Mosaic), DeepCache at the seeds' schedule. Measured: HBM of every program (the compiler's",
        "memory analysis), flops (XLA's cost analysis plus the splash kernel's work counted from its",
        "shapes), collectives (HLO), compile seconds on this shared machine. Estimated: the memory",
        "plan of the whole run, and roofline seconds (each program at the largest of flops / peak",
        "bf16, bytes / HBM bandwidth, received collective bytes / half the bidirectional ICI",
        "bandwidth). Real steps run slower than the roofline by the kernels' efficiency.",
        "",
        "HBM traffic (`tpu/hbm.py`, the last column): XLA's bytes accessed add up every operand and",
        "result of every instruction, wherever it lives; on a TPU the compiler's memory-space",
        "assignment keeps many buffers in the chip's VMEM (layouts marked `S(1)`) and moves them",
        "with explicit asynchronous copies, which that count adds again. The traffic count takes",
        "what crosses the HBM interface: operands and results in memory space 0, a slice as its",
        "result, the copies by their HBM side, a loop body once per iteration, plus the splash",
        "kernel's K/V re-reads. It is a model too (a fusion reads each HBM operand once, VMEM is",
        "free), so the bytes-accessed roofline stays beside it as the conservative figure. Rows",
        "compiled before the count existed show `-`.",
        "",
        "Compile s: the whole run's programs, the middle program's in brackets. `a -> b`: a with the",
        "middle stage's blocks unrolled (the reports kept under `tpu_aot/unrolled/`; `python -m",
        "tpu.aot ... --unrolled` compiles that way), b with each run of identical blocks as one",
        "`jax.lax.scan` (tpu/scan.py, the default). Costs of a loop count its body once per",
        "iteration. Compile seconds depend on what else this shared machine runs: compare a row's",
        "middle with its tail, which the scan does not change. The `a -> b` rows were compiled",
        "unrolled and then scanned, one after the other on an otherwise idle machine (2026-11-26,",
        "load average about 2 from the compile itself); middle programs: hy15-720p-v6e8 352.8 ->",
        "60.1 s (5.9x), hy15-720p-v6e8-replicated 249.6 -> 67.1 s (3.7x), hy15-480p-49f-v6e1",
        "182.6 -> 44.7 s (4.1x), ti2v5b-v6e8 154.9 -> 43.9 s (3.5x), a14b-v6e8 146.3 -> 47.5 s",
        "(3.1x), a14b-v6e8-swap 173.3 -> 65.8 s (2.6x). ti2v5b-v6e8 and a14b-v6e8 were compiled",
        "scanned again later that day, idle too, to count their HBM traffic: 56.3 and 71.7 s (the",
        "table's figures), so two idle compiles of one program differ by up to half; the speedup",
        "of the scan is the larger effect. Flops equal, HBM per chip equal or lower",
        "(the scan's temporaries are one block's: hy15-720p-v6e8 6.1 -> 4.2 GiB). One cost: where",
        "the middle is HBM-bound (hy15-480p-49f-v6e1, one chip, replicated weights) the scanned",
        "middle accesses 773 GB a call against 693 GB unrolled, 0.96 against 0.87 s/step.",
        "",
        "| pipeline | slice (chip HBM) | sp | weights | fits (GiB left) | GiB per chip | compile s (middle) "
        "| TFLOP/step/chip | roofline s/step, off | computed steps | roofline s/step, cached "
        "| roofline s/step, HBM traffic |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    only = None if args.only is None else set(args.only.split(","))
    unknown = (only or set()) - {name for name, _ in ROWS} - {name for name, *_ in DECODE_ROWS}
    if unknown:
        raise SystemExit(f"--only {args.only}: unknown row(s) {sorted(unknown)}; expected names from "
                         f"{', '.join(name for name, _ in ROWS)}")
    for name, row_args in ROWS:
        if only is not None and name not in only or args.decode_only:
            path = OUT / f"{name}.json"
            if not path.exists():
                continue
            report = json.loads(path.read_text())
        else:
            report = run_row(name, row_args, args.rerun)
        lines.append(row_line(name, row_args, report))
    missing = [name for name, _ in ROWS if not (OUT / f"{name}.json").exists()]
    lines += ["", f"Anchor: {ANCHOR}.", "", V5_BLOCKS, ""]
    stale = [name for name in UNDERCOUNTED if (OUT / f"{name}.json").exists()]
    if stale:
        lines += ["Collectives undercounted in the reports of " + ", ".join(stale) + " (compiled "
                  "before tpu.aot read past the splash kernel's multi-line metadata: each program's "
                  "collectives after its first kernel were dropped): "
                  + "; ".join(f"{n}: {UNDERCOUNTED[n]}" for n in stale) + ". The table's figures "
                  "do not depend on them (every program there is compute- or HBM-bound either "
                  f"way); `python bench/tpu_aot.py --only {','.join(stale)} --rerun` recounts them.",
                  ""]
    if missing:
        lines += [f"Not compiled yet (no report): {', '.join(missing)}; `python bench/tpu_aot.py "
                  f"--only {','.join(missing)}` adds them.", ""]
    lines += decode_lines(only, args.rerun)
    (ROOT / "bench" / "results" / "tpu_aot.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

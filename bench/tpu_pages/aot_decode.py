"""The stage-3 decode rows of bench/tpu_pages/aot.py's page: each real-size VAE decode compiled for a
TPU slice beside the stage-2 run it follows, and the figures under that table."""

from __future__ import annotations

import os
from collections.abc import Callable

from bench.tpu_pages.aot_reports import ONE_PROGRAM, load_or_run, per_device, read_report
from sampling.units import GiB
from tpu.vae_aot import dtype_label, strips_label  # (decode cells, as it prints them)
from tpu.vae_strips import MIN_STRIPS

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
    ("vae-ti2v5b-v7x8", "--model wan2.2-ti2v-5b --topology v7x:2x2x1", "ti2v5b-v7x8"),
    ("vae-a14b-v7x8", "--model wan2.2-i2v-a14b --topology v7x:2x2x1", "a14b-v7x8"),
    ("vae-hy15-720p-v6e8", "--model hunyuanvideo-1.5-720p_t2v --topology v6e:2x4", "hy15-720p-v6e8"),
    ("vae-hy15-480p-v6e8", "--model hunyuanvideo-1.5-480p_t2v --topology v6e:2x4",
     "hy15-480p-t2v-v6e8"),
    ("vae-hy15-720p-v5e8", "--model hunyuanvideo-1.5-720p_t2v --topology v5e:2x4", "hy15-720p-v5e8"),
    ("vae-hy15-720p-v5p4", "--model hunyuanvideo-1.5-720p_t2v --topology v5p:2x2x1", "hy15-720p-v5p4"),
]


DECODE_SHARE = 0.10  # the decode's roofline against the stage-2 run's, at most


DECODE_TRAFFIC = (
    "On a TPU the fp32 Wan decoders round each convolution's input and weight to bf16 in the "
    "program and sum in fp32 (`tpu.vae_wan.conv_operand_dtype`): what the TPU's DEFAULT precision "
    "does to an fp32 convolution anyway, stated where the operands are made, so the weights, the "
    "carried caches and every convolution's input move half the bytes (\"conv operands bf16\" in "
    f"the decode cell). And each chip's band of the frame runs as a batch of at least {MIN_STRIPS} "
    "strips (`tpu.vae_strips.strip_grid`; the cell says the grid): of a convolution with a smaller batch, "
    f"libtpu's space-to-batch pass makes {MIN_STRIPS} batches of the frame's width, so every "
    "convolution's input was padded and relaid out into them and its fp32 output copied back for "
    "the norm that reads it. Turning the pass off by flags instead cut one convolution's traffic "
    "but slowed its compile many times over, and the whole decode did not finish compiling. Each "
    "strip's zero padding is its halo, gathered by strip index from the neighbours' border lines "
    "(collective-permutes of those lines between chips) and written with the strip once (its "
    "first form split the batch axis into the strip grid, and XLA relaid the strips out several "
    "times a convolution; the other Wan rows were compiled with an equivalent earlier form of the "
    "halo); the upsamplers' 3x3 convolutions run as 1x3x3 3-D ones without folding the frames into "
    "the batch, and Wan2.2's shortcut upsampler repeats pixels instead of transposing its output. "
    "Each of these cut the steady call's bytes accessed and its HBM traffic.")


DECODE_FRAMES = (
    "Two latent frames per steady call (`--frames_per_call 2`, measured before the halo's last "
    "form) accessed fewer bytes a frame but moved more HBM traffic a frame, so one stays the "
    "default. Whether a TPU runs these programs as the roofline says, and whether its numbers "
    "equal the fp32 program's, stay to be measured on a slice.")


# the decode rows the figures under the decode table are printed from
DECODE_DETAIL, DECODE_SECOND = "vae-ti2v5b-v6e8", "vae-a14b-v6e8"


def _decode_compile(name: str, r: dict) -> tuple[str, str]:
    """(compile s, roofline s) cells: with a chain of block programs, how many distinct ones and
    the longest compile among them; after the one-program report (ONE_PROGRAM) where the row
    had one, "before -> after"."""
    compile_s, roofline = f"{r['compile_seconds']:.0f}", f"{r['roofline_seconds']:.2f}"
    if "programs_compiled" in r:
        compile_s += (f" ({r['programs_compiled']} programs, the longest "
                      f"{r['program_compile_seconds']:.0f})")
        before = read_report(name, ONE_PROGRAM)
        if before is not None:
            compile_s = f"{before['compile_seconds']:.0f} -> {compile_s}"
            roofline = f"{before['roofline_seconds']:.2f} -> {roofline}"
    return compile_s, roofline


def decode_line(name: str, r: dict, stage2: dict | None) -> str:
    m, chip = r["memory"], r["chip"]
    compile_s, roofline = _decode_compile(name, r)
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
            f"{r['devices']} of {r['chips']}{'' if per_device(chip) == '' else ' devices'} "
            f"({r.get('split', 'rows')}{strips_label(r)}) | "
            f"{' x '.join(map(str, r['video_shape'][2:]))} | {verdict} | "
            f"{m['total'] / GiB:.2f} ({m['weights'] / GiB:.2f} weights) | {compile_s} "
            f"| {r['tflop']:.0f} | {1e3 * steady.get('roofline', 0):.0f} "
            f"({max(('compute', 'hbm', 'ici'), key=lambda k: steady.get(k, 0))}) | "
            f"{roofline} | {run2} | {share} | {t_roof} | {t_share} |")


def _share(decode: float, stage2: float) -> str:
    frac = decode / stage2
    return f"{frac:.1%} ({'met' if frac <= DECODE_SHARE else 'NOT met'})"


def decode_lines(compiles: Callable[[str], bool], rerun: bool) -> list[str]:
    lines = [
        "## Stage 3: the VAE decode on the same slices",
        "",
        "`python -m bench.tpu_pages.aot` (each row: `python -m commands.vae_aot <row arguments>`). The",
        "pipeline's released VAE built on the meta device, its decode traced by `tpu.vae` as stage 3",
        "runs it on JAX (a first call for latent frame 0, a steady one for each further latent",
        "frame with the causal caches carried, each call a chain of block programs that blocks",
        "alike share: `tpu/vae_chain.py`; the frame split by rows, or by columns where the",
        "rows do not divide, over the largest divisor of the chip count that divides them:",
        "`tpu.vae_plan.split_plan`, and for Wan each chip's band run as a batch of strips:",
        "`tpu.vae_strips.strip_grid`), in fp32 as stage 3's default unless the row says bf16, compiled for",
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
        report = load_or_run(name, row_args, compiles(name), rerun, "commands.vae_aot")
        if report is None:
            missing.append(name)
            continue
        lines.append(decode_line(name, report, read_report(stage2_name)))
    lines += ["", f"Compile seconds: on this {os.cpu_count()}-core machine. `a -> b`: a with each "
              "decoder call compiled as one program (the reports kept under `tpu_aot/one_program/`), "
              "b as a chain of block programs, a compile per pair of cores (one at a time here, "
              "except where the row says two); in brackets how many distinct programs and the "
              "longest of their compiles, about the decode's compile on a host with a core pair for "
              "each (a Cloud TPU VM host has many times this machine's cores: bench/tpu_pages/whole_job.py's "
              "HOSTS); the roofline cell the same way. "
              "One-program rows: the Wan rows were compiled one evening, as strips, "
              "two at a time; the HunyuanVideo-1.5 v6e-8 row earlier beside other jobs (that older "
              "report counts the encoder's weights too in GiB per chip), its v5e-8 and v5p-4 rows "
              "that evening beside one other job.", "",
              DECODE_TRAFFIC, *decode_figures(), "", DECODE_FRAMES]
    if missing:
        lines += ["", f"Not compiled yet (no report): {', '.join(missing)}; `python -m bench.tpu_pages.aot "
                  f"--decode_only --only {','.join(missing)}` adds them."]
    return lines + [""]


def bound_of(program: dict) -> str:
    return max(("compute", "hbm", "ici"), key=lambda k: program.get(k, 0))


def decode_figures() -> list[str]:
    """The detailed decode's steady call and the second decode's totals, from their reports (each
    sentence only where its report is there)."""
    out = []
    r = read_report(DECODE_DETAIL)
    if r is not None and r.get("roofline_seconds_traffic") is not None:
        st = r["programs"]["steady"]
        why = {"compute": f"the call's {st['flops'] / 1e12:.2f} TFLOP", "hbm": "its HBM traffic",
               "ici": "its collectives"}[bound_of(st["traffic"])]
        out.append(
            f"The {r['model']} {r['dtype']} decode on {r['topology']}, per steady call per chip "
            f"(`python -m commands.vae_aot --model {r['model']} --topology {r['topology']} --hlo_dir D`, "
            f"then `python -m tpu.hbm D/steady.txt`): {st['bytes_accessed'] / 1e9:.1f} GB accessed, "
            f"{st['hbm_bytes'] / 1e9:.1f} GB of HBM traffic; {1e3 * st['roofline']:.1f} ms a call by "
            f"bytes accessed, {1e3 * st['traffic']['roofline']:.1f} ms by traffic, where {why} bound "
            f"it. The whole decode: {r['roofline_seconds']:.2f} s by bytes accessed, "
            f"{r['roofline_seconds_traffic']:.2f} s by traffic, {r['memory']['total'] / GiB:.2f} GiB "
            "per chip.")
    r = read_report(DECODE_SECOND)
    if r is not None and r.get("roofline_seconds_traffic") is not None:
        rows, cols = r.get("strips", (1, 1))
        out.append(
            f"The {r['model']} decode on {r['topology']} ({rows} x {cols} strips a band): "
            f"{r['roofline_seconds']:.2f} / {r['roofline_seconds_traffic']:.2f} s by bytes accessed "
            f"/ by traffic, with {r['programs']['steady']['temp_bytes'] / GiB:.1f} GiB of "
            "temporaries per chip in its steady call.")
    return ["", " ".join(out)] if out else []

"""Real-size pipelines compiled for Cloud TPU slices on this CPU machine: the table of
bench/results/tpu_aot.md.

    pip install "jax[tpu]==0.10.2"       # libtpu: the compiler (in requirements-dev.txt)
    python -m bench.tpu_pages.aot [--only ROW[,ROW...]] [--rerun] [--decode_only] [--page_only]

Each row is one `python -m commands.aot` run (one at a time: a real-size compile takes minutes and a
few GB), its report kept as JSON under bench/results/tpu_aot/ and reused unless --rerun, so the
table can be rebuilt or extended without compiling again (--page_only: from the reports alone).
Per row: whether the whole run fits the chip's HBM and the memory per chip, compile seconds on
this machine, TFLOP per step and roofline seconds per step (caching off, and with the cache
schedule), beside the anchor's published HunyuanVideo-1.5 figures on v6e-8 (ANCHOR). Every
figure of the page is printed from the reports, or is the anchor's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.tpu_pages.aot_decode import DECODE_ROWS, bound_of, decode_lines  # noqa: E402
from bench.tpu_pages.aot_reports import (  # noqa: E402
    BEFORE,
    COMPILED,
    OUT,
    load_or_run,
    per_device,
    read_report,
    version,
    wrap,
)
from sampling.journal import atomic_write  # noqa: E402
from sampling.units import GiB  # noqa: E402
from tpu.attention import BLOCK_Q, BLOCKS_BY_KIND  # noqa: E402
from tpu.topology import CHIPS  # noqa: E402

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
    # every other released HunyuanVideo-1.5 pipeline at its default size on v6e-8
    ("hy15-720p-i2v-v6e8", "--model hunyuanvideo-1.5-720p_i2v --topology v6e:2x4 --sp_size 8"),
    ("hy15-480p-t2v-v6e8", "--model hunyuanvideo-1.5-480p_t2v --topology v6e:2x4 --sp_size 8"),
    ("hy15-480p-i2v-v6e8", "--model hunyuanvideo-1.5-480p_i2v --topology v6e:2x4 --sp_size 8"),
    ("hy15-480p-t2v-distilled-v6e8", "--model hunyuanvideo-1.5-480p_t2v_distilled --topology v6e:2x4 "
                                     "--sp_size 8"),
    ("hy15-480p-i2v-distilled-v6e8", "--model hunyuanvideo-1.5-480p_i2v_distilled --topology v6e:2x4 "
                                     "--sp_size 8"),
    ("hy15-720p-i2v-distilled-v6e8", "--model hunyuanvideo-1.5-720p_i2v_distilled --topology v6e:2x4 "
                                     "--sp_size 8"),
    ("hy15-720p-i2v-distilled-sparse-v6e8", "--model hunyuanvideo-1.5-720p_i2v_distilled_sparse "
                                            "--topology v6e:2x4 --sp_size 8"),
    ("hy15-480p-i2v-step-distilled-v6e8", "--model hunyuanvideo-1.5-480p_i2v_step_distilled "
                                          "--topology v6e:2x4 --sp_size 8"),
    ("ti2v5b-v6e8", "--model wan2.2-ti2v-5b --topology v6e:2x4 --sp_size 8"),
    ("ti2v5b-v5e8", "--model wan2.2-ti2v-5b --topology v5e:2x4 --sp_size 8"),
    ("ti2v5b-v5p4", "--model wan2.2-ti2v-5b --topology v5p:2x2x1 --sp_size 4"),
    ("ti2v5b-v5e16-cfg", "--model wan2.2-ti2v-5b --topology v5e:4x4 --sp_size 8 --cfg_parallel"),
    ("ti2v5b-v7x8", "--model wan2.2-ti2v-5b --topology v7x:2x2x1 --sp_size 8"),
    ("a14b-v6e8", "--model wan2.2-i2v-a14b --topology v6e:2x4 --sp_size 8"),
    ("a14b-v6e8-swap", "--model wan2.2-i2v-a14b --topology v6e:2x4 --sp_size 8 --swap_experts"),
    ("a14b-v6e8-replicated", "--model wan2.2-i2v-a14b --topology v6e:2x4 --sp_size 8 "
                             "--weight_sharding replicated"),
    ("a14b-v5e8", "--model wan2.2-i2v-a14b --topology v5e:2x4 --sp_size 8"),
    ("a14b-v5e16-cfg", "--model wan2.2-i2v-a14b --topology v5e:4x4 --sp_size 8 --cfg_parallel"),
    ("a14b-v5p4", "--model wan2.2-i2v-a14b --topology v5p:2x2x1 --sp_size 4"),
    ("a14b-v7x8", "--model wan2.2-i2v-a14b --topology v7x:2x2x1 --sp_size 8"),
    # speech to video: one clip's programs (they serve every clip)
    ("s2v14b-v6e8", "--model wan2.2-s2v-14b --topology v6e:2x4 --sp_size 8"),
    # maxdiffusion's v7x-8 split (V7X_ANCHOR): the two guidance branches on 2 x 4 devices
    ("a14b-v7x8-cfg", "--model wan2.2-i2v-a14b --topology v7x:2x2x1 --sp_size 4 --cfg_parallel"),
]
# reports compiled before tpu.aot read past the splash kernel's multi-line metadata (a line of it
# starting `}},` ended the computation: every program's collectives after its first kernel were
# dropped); drop a row from here once it is compiled again
UNDERCOUNTED: dict[str, str] = {}  # every such report has been compiled again
# Published figures of another project, not measured here: the anchor's own HunyuanVideo-1.5 runs on
# a v6e-8 slice (gpu-tpu-pedia, tpu_notes 1.8), cited beside our roofline
ANCHOR = ("HunyuanVideo-1.5 720p 121 frames on v6e-8, measured by the anchor (gpu-tpu-pedia, "
          "tpu_notes 1.8): 7.29 s/step with stock splash, 5.81 s/step with its exp2 kernel, "
          "DeepCache ~1.8x (1.83x measured at 49 frames)")
# Published figures of another project on v7x-8, not measured here (the table's I2V-A14B v7x rows
# stand beside it; bench/tpu_pages/whole_job.py keeps it as that row's anchor)
V7X_ANCHOR = ("maxdiffusion's v7x-8 figure (its README's ring-attention table; tpu_notes 2.5): Wan2.2 "
              "A14B (by its 40 steps; T2V or I2V not stated) at 720p, 81 frames, 40 steps, CFG on 2 "
              "x context 4, 194.4 s end to end with Tokamax flash attention")
V7X_ROWS = ("a14b-v7x8", "a14b-v7x8-cfg")  # the rows set beside it
# what became of the v7x decode rows, while they have no report
V7X_DECODE = ("The v7x decode rows have no report: the one compile tried (vae-ti2v5b-v7x8, as one "
              "program) was stopped before it finished, on this machine shared with other jobs.")


def v5_blocks() -> str:
    """Why v5e and v5p get smaller splash blocks, from the block table tpu.attention compiles with."""
    query = "/".join(str(q) for q in sorted({blocks[0] for blocks in BLOCKS_BY_KIND.values()}))
    return (f"v5e and v5p compile splash with {query}-row query blocks (tpu/attention.py "
            f"BLOCKS_BY_KIND): the stock {BLOCK_Q}-row blocks ask more scoped VMEM in Wan2.2 "
            "TI2V-5B's middle than those chips give a kernel (libtpu's CompileTimeScopedVmemOom).")


def v7x_lines() -> list[str]:
    """What a v7x row's figures are per (a device: half a chip), where they come from, and the
    I2V-A14B rows' rooflines beside maxdiffusion's v7x-8 figure (from the reports present)."""
    chip = CHIPS["v7x"]
    text = (f"v7x (TPU7x, Ironwood): libtpu {version('libtpu')} knows the v7x-8 slice as tpu7x:2x2x1 "
            "(it refuses v7x:2x2x1, which `tpu.topology` translates) and gives 8 devices for its 4 "
            f"chips, one per TensorCore (device_kind {chip.device_kind}, two at each chip's "
            "coordinates), so the v7x rows run sp 8 (or cfg 2 x sp 4) and every per-chip figure of "
            f"a v7x row is per device: {chip.hbm_bytes / GiB:.2f} GiB of HBM (the compiler's limit, "
            "as for the other chips; 192 GiB a chip), "
            f"{chip.bf16_flops / 1e12:.1f} TFLOP/s bf16 and {chip.hbm_bandwidth / 1e9:.0f} GB/s of "
            "HBM (half the chip's 2307 TFLOP/s and 7380 GB/s: docs.cloud.google.com/tpu/docs/tpu7x), "
            f"{chip.ici_bandwidth / 1e9:.0f} GB/s of ICI (half the chip's 1200 GB/s bidirectional: "
            "an assumption, as no page read here says how a chip's links divide between its two "
            "chiplets). The roofline counts a collective between the two devices of one chip at "
            "that ICI rate, though it runs die to die, and the placement counts it as 0 hops. "
            "Slice shapes: xpk's tpu7x list (the stored copy of the Cloud TPU page ends before its "
            "configurations); where a v7x slice wraps around is taken to be v5p's case. Splash "
            f"compiles with the stock {BLOCK_Q}-row blocks on v7x (no VMEM refusal, so no "
            "BLOCKS_BY_KIND entry). libtpu compiles v7x programs in two forms the HLO reader "
            "(tpu/hlo.py) had not met: collectives offloaded to SparseCore computations, which "
            "close with `}, execution_thread=\"sparsecore\"` ahead of the entry, and FSDP matmuls "
            "as windowed einsums, loops over the weight's shards with a u32 counter stepping by 2; "
            "read as before, half those matmuls' flops were dropped. The v7x rows were compiled "
            "beside other jobs: their compile seconds are high for it.")
    reports = [(name, read_report(name)) for name in V7X_ROWS]
    shown = [(name, r) for name, r in reports if r is not None]
    if shown:
        text += (f" Beside {V7X_ANCHOR}: our stage-2 roofline for wan2.2-i2v-a14b at "
                 f"{shown[0][1]['size'][0]} x {shown[0][1]['size'][1]}, {shown[0][1]['size'][2]} "
                 f"frames, {shown[0][1]['steps']} steps, "
                 + "; ".join(f"cfg {r['cfg']} x sp {r['sp']} ({name}): {r['seconds']['run_uncached']:.0f} "
                             f"s uncached, {r['seconds']['run_cached']:.0f} s with the cache schedule"
                             for name, r in shown)
                 + " (stage 1, the decode and the whole job: bench/results/whole_job.md).")
    if not any(read_report(name) for name, *_ in DECODE_ROWS if "v7x" in name):
        text += " " + V7X_DECODE
    return wrap(text)


def compiled_lines(names: list[str]) -> list[str]:
    """Where and when each row compiled, from the record `run_row` adds to its report; rows whose
    reports predate that record are named as such."""
    recorded, unrecorded = [], []
    for name in names:
        r = read_report(name, OUT)
        if r is None:
            continue
        c = r.get(COMPILED)
        if c is None:
            unrecorded.append(name)
        else:
            recorded.append(f"{name} {c['date']}, {c['cores']} cores, 1-minute load average "
                            f"{c['load_start']:.1f} at the start, {c['load_end']:.1f} at the end")
    text = ("How the rows' compile seconds were taken, from their reports (one compile keeps about "
            "two cores busy, so the load at the end includes the compile itself): "
            + ("; ".join(recorded) if recorded else "no report records it yet")
            + (f". Reports from before the record was kept: {', '.join(unrecorded)}" if unrecorded
               else "") + ".")
    return wrap(text)


def _compile_cell(name: str, r: dict) -> str:
    """Compile seconds (middle program's in brackets), after the report compiled with the
    middle's blocks unrolled (before issue 24's scan, kept under unrolled/) where there is one."""
    def fmt(rep):
        return f"{rep['compile_seconds']:.0f} ({rep['programs']['middle']['compile_seconds']:.0f})"
    before = BEFORE / f"{name}.json"
    if not before.exists():
        return fmt(r)
    return f"{fmt(json.loads(before.read_text()))} -> {fmt(r)}"


def _flops_step(r: dict) -> float:
    """TFLOP per step per chip: probe, middle and tail once per branch."""
    return sum(p["flops"] for n, p in r["programs"].items() if n in ("probe", "middle", "tail")) \
        * r["schedule"]["branches_per_step"] / 1e12


def row_line(name: str, args: str, r: dict) -> str:
    m, s, sch = r["memory"], r["seconds"], r["schedule"]
    chip = r["chip"]
    weights = r["weight_sharding"] + (" (1 expert resident)" if r["swap_experts"] else "")
    verdict = (f"fits ({m['headroom'] / GiB:.1f} left)" if m["fits"]
               else f"NO (over by {-m['headroom'] / GiB:.1f})")
    return (f"| {r['model']} | {r['topology']} ({chip['name']}, {chip['hbm_bytes'] / GiB:.2f} GiB"
            f"{per_device(chip)}) | {r['sp']}{' x cfg 2' if r.get('cfg', 1) == 2 else ''} | {weights} "
            f"| {verdict} | {m['total'] / GiB:.1f} "
            f"({m['weights'] / GiB:.1f} weights) | {_compile_cell(name, r)} | {_flops_step(r):.0f} "
            f"| {s['step_uncached']:.2f} | {sch['computed_steps']}/{sch['steps']} | "
            f"{s['step_cached']:.2f} ({s['speedup']:.2f}x) | {_traffic_cell(s.get('traffic'))} |")


def _traffic_cell(t: dict | None) -> str:
    if t is None:
        return "-"
    return f"{t['step_uncached']:.2f} off, {t['step_cached']:.2f} cached ({t['speedup']:.2f}x)"


def _scan_pairs() -> list[tuple[str, dict, dict]]:
    """(row, unrolled report, scanned report) of every row compiled both ways, in table order."""
    pairs = [(name, read_report(name, BEFORE), read_report(name)) for name, _ in ROWS]
    return [(name, a, b) for name, a, b in pairs if a is not None and b is not None]


def _middle_bytes(r: dict) -> float:
    return r["programs"]["middle"]["bytes_accessed"] / 1e9


def scan_figures(pairs: list[tuple[str, dict, dict]]) -> str:
    """What the scan changed, unrolled report against scanned one: the middle's compile seconds,
    flops, HBM per chip, and the step of every row whose middle is HBM-bound."""
    def mid(r):
        return r["programs"]["middle"]["compile_seconds"]
    compiles = ", ".join(f"{n} {mid(a):.1f} -> {mid(b):.1f} s ({mid(a) / mid(b):.1f}x)"
                         for n, a, b in pairs)
    flops = max(abs(_flops_step(b) / _flops_step(a) - 1) for _, a, b in pairs)
    higher = [n for n, a, b in pairs if b["memory"]["total"] > a["memory"]["total"]]
    n, a, b = max(pairs, key=lambda t: t[1]["memory"]["total"] - t[2]["memory"]["total"])
    text = (f"Middle programs, unrolled -> scanned: {compiles}. Flops per step differ by at most "
            f"{flops:.4%}; HBM per chip is "
            + (f"higher scanned in {', '.join(higher)}" if higher else "equal or lower in every row")
            + f" (the scan's temporaries are one block's: {n} {a['memory']['total'] / GiB:.1f} -> "
            f"{b['memory']['total'] / GiB:.1f} GiB).")
    bound = [(n, a, b) for n, a, b in pairs if bound_of(b["programs"]["middle"]) == "hbm"]
    if bound:
        text += " Where the middle is HBM-bound, the scanned middle's bytes accessed set the step: " \
            + "; ".join(f"{n} ({b['chips']} chip{'s' * (b['chips'] > 1)}, {b['weight_sharding']} weights) "
                        f"{_middle_bytes(b):.0f} GB a call scanned against {_middle_bytes(a):.0f} GB "
                        f"unrolled, {b['seconds']['step_uncached']:.2f} against "
                        f"{a['seconds']['step_uncached']:.2f} s/step" for n, a, b in bound) + "."
    return text


def compile_paragraph() -> list[str]:
    """The page's paragraph on compile seconds and the scan, its figures from the reports."""
    text = ("Compile s: the whole run's programs, the middle program's in brackets. `a -> b`: a with "
            "the middle stage's blocks unrolled (the reports kept under `tpu_aot/unrolled/`; `python "
            "-m commands.aot ... --unrolled` compiles that way), b with each run of repeating blocks as one "
            "`jax.lax.scan` (tpu/scan.py, the default; a run repeats one block, or a period of "
            "blocks: Wan S2V's audio injections every 4th and then every 3rd block make two runs of "
            "periods 4 and 3). Costs of a loop count its body once per "
            "iteration. Compile seconds depend on what else this shared machine runs: compare a "
            "row's middle with its tail, which the scan does not change.")
    pairs = _scan_pairs()
    if pairs:
        again = [n for n, _, b in pairs if b["seconds"].get("traffic") is not None]
        text += (" The `a -> b` rows were compiled unrolled and then scanned, one after the other on "
                 "an otherwise idle machine"
                 + (f"; {' and '.join(again)} were compiled scanned again later, idle too, "
                    "to count their HBM traffic (their reports and figures are from that compile), so "
                    "their two scanned compiles are not compared here" if again else "")
                 + ". " + scan_figures(pairs))
    return wrap(text)


def _hops(s: dict) -> str:
    if s["hops_max"] is None:
        return "-"
    return f"{s['hops_min']}-{s['hops_max']} ({s['mean_hops']:.2f})"


def _rings(s: dict) -> str:
    return f"{s['rings_closed']}/{s['rings']}" if s["rings"] else "-"


def _sp_rings(order: dict) -> str:
    """closed or open, and the hops of each step of the rings (each distinct sequence once)."""
    steps = " or ".join(dict.fromkeys("+".join(map(str, ring)) for ring in order["sp_ring_steps"]))
    return f"{'closed' if order['sp_rings_closed'] else 'open'}, {steps} hops"


def placement_lines() -> list[str]:
    """The section on where each mesh row's collectives run on the slice, from the reports'
    placement (`tpu.placement`): the mesh's device order beside the list order."""
    reports = {name: read_report(name, OUT) for name, _ in ROWS}  # OUT as it is now (tests move it)
    rows = [(name, r) for name, r in reports.items() if r is not None and r.get("placement")]
    if not rows:
        return []
    lines = ["## Where the collectives run", ""]
    text = ("`python -m commands.aot` records, for a mesh of several chips, every collective's groups of "
            "partition ids (tpu/hlo.py `collective_ops`, each replica-group form expanded) on the chips "
            "that hold those partitions (tpu/placement.py): the ICI hops of each step around a group's "
            "ring (its members in the order the HLO lists them, the last step back to the first; a "
            "collective-permute's source to target), counted on the slice's grid, the shorter way "
            "round only along an axis with wraparound links (v5e and v6e have them on an axis of 16 "
            "chips only, v5p on slices of whole 4x4x4 cubes: the Scaling Book, \"How to Think About "
            "TPUs\"; `tpu.topology.wraparound`). Mesh: `sharding.jax_sp.make_mesh`'s device order, "
            "from the chips' coordinates. List order: the same HLO with partition k on the k-th device "
            "libtpu lists, the mesh a plain reshape gave before. JAX compiles one replica and n "
            "partitions over the mesh's devices flattened, so the HLO text is the same under both "
            "orders (tests/test_tpu_aot.py compiles one program both ways on v5e:4x4) and only the "
            "chip behind each partition id differs: both columns come from one compile. Runs: per "
            "call of each program, summed over the programs it occurs in. Rings closed: the distinct "
            "groups whose every step is one hop (or none: between the two devices of a v7x chip). "
            "GB x hops: the bytes a chip "
            "receives over ICI per call times the mean hops of its collective's steps. The compiler's "
            "collective emitters may route a ring otherwise: hops model the traffic, they do not "
            "measure it.")
    lines += wrap(text)
    for name, r in rows:
        p = r["placement"]
        mesh, listed = p["orders"]["mesh"], p["orders"]["list_order"]
        grid = "x".join(map(str, p["extents"][:2] if p["extents"][2:] == [1] else p["extents"]))
        wraps = ("wraparound on axes " + ", ".join("xyz"[i] for i, w in enumerate(p["wraparound"]) if w)
                 if any(p["wraparound"]) else "no wraparound")
        lines += ["", f"{name}: {r['model']} at {r['size'][0]} x {r['size'][1]} (H x W), {r['size'][2]} "
                  f"frames on "
                  f"{r['topology']} ({grid} chips, {wraps}), cfg {r['cfg']} x sp {r['sp']}. The sp "
                  f"rings: mesh {_sp_rings(mesh)}; list order {_sp_rings(listed)}.", "",
                  "| collective | programs | runs per call | groups x members | hops per step, mesh "
                  "(mean) | rings closed, mesh | hops per step, list order (mean) | rings closed, list "
                  "order | GB x hops per chip, mesh / list order |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for kind, m in mesh["collectives"].items():
            o = listed["collectives"][kind]
            lines.append(f"| {kind} | {', '.join(m['programs'])} | {m['count']} | "
                         f"{', '.join(m['groups']) or '-'} | {_hops(m)} | {_rings(m)} | {_hops(o)} | "
                         f"{_rings(o)} | {m['byte_hops'] / 1e9:.1f} / {o['byte_hops'] / 1e9:.1f} |")
            if m["unmapped"]:
                lines.append(f"| ({kind}: {m['unmapped']} runs with groups not read) | | | | | | | | |")
    before = [name for name, r in reports.items() if r is not None and r["chips"] > 1
              and not r.get("placement")]
    if before:
        lines += ["", f"Reports with no placement (compiled before it was recorded): "
                  f"{', '.join(before)}; `python -m bench.tpu_pages.aot --only {','.join(before)} --rerun` "
                  "adds it."]
    return lines + [""]


def header() -> list[str]:
    """The page's opening paragraphs; the machine and the compiler's versions as found here."""
    setup = (f"Compiled by libtpu for the named slice on a {os.cpu_count()}-core CPU machine without a "
             f"TPU; jax {version('jax')}, libtpu {version('libtpu')} (as installed), bf16 weights "
             "with the checkpoints' fp32 islands, splash attention (Mosaic), DeepCache at the seeds' "
             "schedule. Measured: HBM of every program (the compiler's memory analysis), flops (XLA's "
             "cost analysis plus the splash kernel's work counted from its shapes), collectives "
             "(HLO), compile seconds on this shared machine. Estimated: the memory plan of the whole "
             "run, and roofline seconds (each program at the largest of flops / peak bf16, bytes / "
             "HBM bandwidth, received collective bytes / half the bidirectional ICI bandwidth). Real "
             "steps run slower than the roofline by the kernels' efficiency.")
    return [
        "# Real-size pipelines compiled for Cloud TPU slices (deviceless)",
        "",
        "`python -m bench.tpu_pages.aot` (each row: `python -m commands.aot <row arguments> --enable_cache`;",
        "reports and the full per-program printout under `bench/results/tpu_aot/`).",
        *wrap(setup),
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
        *compile_paragraph(),
        "",
        "| pipeline | slice (chip HBM) | sp | weights | fits (GiB left) | GiB per chip | compile s (middle) "
        "| TFLOP/step/chip | roofline s/step, off | computed steps | roofline s/step, cached "
        "| roofline s/step, HBM traffic |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]


def _parse():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="compile only these rows (names, comma-separated); the others "
                    "come from their reports if present")
    ap.add_argument("--rerun", action="store_true", help="compile again even if a report exists")
    ap.add_argument("--decode_only", action="store_true", help="compile no stage-2 row (the "
                    "stage-3 rows named by --only, or all of them, still compile)")
    ap.add_argument("--page_only", action="store_true", help="compile nothing: write the page from "
                    "the reports present (rows without one are listed as not compiled)")
    args = ap.parse_args()
    only = None if args.only is None else set(args.only.split(","))
    unknown = (only or set()) - {name for name, _ in ROWS} - {name for name, *_ in DECODE_ROWS}
    if unknown:
        raise SystemExit(f"--only {args.only}: unknown row(s) {sorted(unknown)}; expected names from "
                         f"{', '.join(name for name, _ in ROWS)}")
    return args, only


def main():
    args, only = _parse()
    OUT.mkdir(parents=True, exist_ok=True)

    def compiles(name: str, stage2: bool) -> bool:
        if args.page_only or stage2 and args.decode_only:
            return False
        return only is None or name in only

    lines = header()
    for name, row_args in ROWS:
        report = load_or_run(name, row_args, compiles(name, True), args.rerun)
        if report is not None:
            lines.append(row_line(name, row_args, report))
    missing = [name for name, _ in ROWS if not (OUT / f"{name}.json").exists()]
    lines += ["", f"Anchor: {ANCHOR}.", "", v5_blocks(), "", *v7x_lines(), "", *placement_lines()]
    stale = [name for name in UNDERCOUNTED if (OUT / f"{name}.json").exists()]
    if stale:
        lines += ["Collectives undercounted in the reports of " + ", ".join(stale) + " (compiled "
                  "before tpu.aot read past the splash kernel's multi-line metadata: each program's "
                  "collectives after its first kernel were dropped): "
                  + "; ".join(f"{n}: {UNDERCOUNTED[n]}" for n in stale) + ". The table's figures "
                  "do not depend on them (every program there is compute- or HBM-bound either "
                  f"way); `python -m bench.tpu_pages.aot --only {','.join(stale)} --rerun` recounts them.",
                  ""]
    if missing:
        lines += [f"Not compiled yet (no report): {', '.join(missing)}; `python -m bench.tpu_pages.aot "
                  f"--only {','.join(missing)}` adds them.", ""]
    lines += decode_lines(lambda name: compiles(name, False), args.rerun)
    names = [name for name, _ in ROWS] + [name for name, *_ in DECODE_ROWS]
    lines += [""] * (lines[-1] != "") + compiled_lines(names)
    atomic_write(str(ROOT / "bench" / "results" / "tpu_aot.md"), lambda f: f.write("\n".join(lines)))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""The whole job per real-size pipeline and Cloud TPU slice: bench/results/whole_job.md (and its
figures as JSON beside it, whole_job.json).

    python -m bench.tpu_pages.whole_job              # measure this CPU (about 3 minutes), then the page
    python -m bench.tpu_pages.whole_job --page_only  # the page from the reports and the last measurement

One row per stage-2 row of bench/tpu_pages/aot.py (`ROWS`, the first of each pipeline and slice: the
default its alternatives were chosen over) that has a report: stage 1 on the slice's host,
stage 2 uncached and with the cache schedule its report was compiled with, stage 3 (the decode
row that `DECODE_ROWS` pairs with it), compile cold and warm, the job's total, and the anchors'
published figures for the same pipeline and slice class. Every figure carries its kind:

  measured   timed (on what is said: this machine, or the anchor's slice as it published)
  roofline   from the compiled program's flops, bytes and collectives at the chip's peaks
             (`python -m commands.aot` / `commands.vae_aot` reports): a floor real steps run above
  estimate   arithmetic on other figures, its basis stated

Stage 1 cannot run at real size here (no weights; umT5-XXL alone is 11 GB): its work is counted
from the encoders' architectures at the pipeline's full text length, and divided by the rate one
real-size layer of each encoder sustains on this CPU (random weights, the dtype stage 1 uses),
scaled linearly to the host's vCPUs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.tpu_pages.aot import ROWS  # noqa: E402
from bench.tpu_pages.aot_decode import DECODE_ROWS  # noqa: E402
from bench.tpu_pages.aot_reports import OUT, read_report  # noqa: E402
from bench.tpu_pages.stage1_work import (  # noqa: E402
    AUDIO_HZ,
    HY_VAE,
    I2V_VAE,
    QWEN,
    QWEN_CROP,
    SIGLIP,
    UMT5,
    WAV2VEC2,
    Work,
    build_vae,
    modelled,
    qwen_flops,
    siglip_flops,
    siglip_model,
    stage1_work,
    umt5_flops,
    vae_encoder_flops,
    vae_key,
    wav2vec2_flops,
    wav2vec2_model,
)
from sampling.journal import atomic_write  # noqa: E402
from sampling.pipelines import get_pipeline  # noqa: E402

PAGE = ROOT / "bench" / "results" / "whole_job.md"
DATA = PAGE.with_suffix(".json")
KINDS = {"measured": "M", "roofline": "R", "estimate": "E"}

# The real-size layers `measure_host` times: their sequence lengths (umT5's; Qwen's, a 1000-token
# text after the template) and how many timed runs, after one warm-up, each median is of
UMT5_PROBE_TOKENS = 512
QWEN_PROBE_TOKENS = 1000 + QWEN_CROP
TIMED_RUNS = 3
WAV2VEC2_PROBE_SECONDS = 5  # one S2V clip: 80 frames at 16 fps

# The host that runs stage 1 on each slice: (machine, vCPUs, source). v5e and v5p from the Cloud
# TPU pages (docs.cloud.google.com/tpu/docs/v5e "VM types"; /tpu/docs/v5p-training "VM, host and
# slice properties"); the v6e figures were not in the stored copy of /tpu/docs/v6e.
HOSTS = {
    "v6e:2x4": ("ct6e-standard-8t", 180, "assumed: the v6e page's VM types as recalled, not in "
                "the stored copy of docs.cloud.google.com/tpu/docs/v6e"),
    "v6e:1x1": ("ct6e-standard-1t", 44, "assumed, as for ct6e-standard-8t"),
    "v5e:2x4": ("ct5lp-hightpu-8t", 224, "docs.cloud.google.com/tpu/docs/v5e, VM types"),
    "v5e:4x4": ("ct5lp-hightpu-4t, one of the slice's hosts", 112,
                "docs.cloud.google.com/tpu/docs/v5e, VM types"),
    "v5p:2x2x1": ("v5p-8 host", 208, "docs.cloud.google.com/tpu/docs/v5p-training; half of them "
                  "under NUMA binding"),
    "v7x:2x2x1": ("tpu7x-standard-4t", 224, "docs.cloud.google.com/tpu/docs/tpu7x, system "
                  "architecture (vCPUs of the 4-chip VM); the machine type as xpk names it"),
}

# Warm compile: every program comes from the persistent cache (tests/test_compile_cache.py: a
# second run compiles nothing). Loading them was not timed on a TPU; the anchor's loads were.
WARM_STAGE2, WARM_STAGE3 = 5.0, 4.7
WARM_BASIS = ("the anchor's measured cache loads: HunyuanVideo-1.5 stage 2 ~5 s after a ~60 s first "
              "compile (gpu-tpu-pedia TORCHAX_MIGRATION_GUIDE 6.3), the Wan VAE decode 4.68 s after "
              "84.22 s (v4-8; tpu_notes 1.7-1.8)")


@dataclass(frozen=True)
class Anchor:
    model: str
    topology: str  # the slice class ours is compared on
    text: str  # the figure as published
    seconds: float | None  # its stage-2 or whole-run seconds, where one number stands for it
    source: str
    stage1_seconds: float | None = None  # its stage 1's seconds, where the text gives them


ANCHORS = [
    Anchor("hunyuanvideo-1.5-720p_t2v", "v6e:2x4",
           "stage 2 of 121 frames at 720p, 50 steps: 365 s stock splash (7.29 s/step), 291 s with "
           "its exp2 kernel (5.81 s/step), 203 s with DeepCache (before exp2)", 365.0,
           "gpu-tpu-pedia HunyuanVideo-1.5 README, commits 023693e, 5672cb1, 1d26dfd; tpu_notes 1.8"),
    Anchor("wan2.2-i2v-a14b", "v6e:2x4",
           "I2V 720p 81 frames, optimized: 184.7 s (steps and what the time covers not stated)",
           184.7, "gpu-tpu-pedia tpu/Wan2.2/docs/wan_tpu_optimization_guide.md appendix B "
           "at cd93a09"),
    Anchor("wan2.2-i2v-a14b", "v5p:2x2x1",
           "720x1280, 81 frames, 40 steps: stage 1 ~30 s (VAE encode on the TPU), stage 2 ~180 s, "
           "stage 3 ~20 s, ~230 s in all", 230.0, "gpu-tpu-pedia tpu/Wan2.2/README.md; tpu_notes 1.8",
           stage1_seconds=30.0),
    # matched to I2V-A14B on v7x-8 (v7x:2x2x1), the closest of the table's rows: Wan2.2's 40 steps
    # at 720p are A14B's; maxdiffusion does not say T2V or I2V
    Anchor("wan2.2-i2v-a14b", "v7x:2x2x1",
           "Wan2.2 A14B (T2V or I2V not stated) 720p 81 frames, 40 steps, CFG on 2 x context 4: "
           "194.4 s end to end (Tokamax flash)", 194.4,
           "maxdiffusion README ring-attention table; tpu_notes 2.5"),
]


@dataclass(frozen=True)
class Figure:
    """One number of the page with its kind and what it rests on."""

    value: float | None
    kind: str  # a key of KINDS
    basis: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"figure kind {self.kind!r}; expected one of {', '.join(KINDS)}")

    def cell(self, digits: int = 0) -> str:
        return "-" if self.value is None else f"{self.value:.{digits}f} [{KINDS[self.kind]}]"


def total(parts: list[Figure], basis: str) -> Figure:
    """The sum of figures: roofline only if every part is, else an estimate; None if any is."""
    if any(p.value is None for p in parts):
        return Figure(None, "estimate", basis)
    kind = "roofline" if all(p.kind == "roofline" for p in parts) else "estimate"
    return Figure(sum(p.value for p in parts), kind, basis)


def stage1_figure(report: dict, host: dict) -> tuple[Figure, list[Work], tuple]:
    """Stage 1's seconds on the slice's host: FLOPs / (rate here x host vCPUs / threads here)."""
    machine = HOSTS.get(report["topology"])
    work = stage1_work(report, lambda *a: host["vae_flops"][vae_key(*a)])
    if machine is None:
        return Figure(None, "estimate", f"no host figure for {report['topology']}"), work, None
    scale = machine[1] / host["threads"]
    seconds = sum(w.flops / (host["rates_gflops"][w.rate] * 1e9 * scale) for w in work)
    return (Figure(seconds, "estimate", f"FLOPs / rate measured here, x {machine[1]} vCPUs / "
                   f"{host['threads']} threads ({machine[0]})"), work, machine)


# --- one row ---------------------------------------------------------------------------------------

def decode_for(stage2_name: str, folder: Path = OUT) -> tuple[str, dict] | None:
    """The first decode row bench/tpu_pages/aot.py pairs with this stage-2 row that has a report, or
    else the first decode report of the same VAE, clip size and slice: the decode does not
    depend on the task or on how stage 2 splits the slice (a cfg x sp row, an image-to-video
    pipeline of the same VAE and size decode alike)."""
    from modules.vae import spec_for

    found = [(name, paired, r) for name, _, paired in DECODE_ROWS
             if (r := read_report(name, folder)) is not None]
    for name, paired, r in found:
        if paired == stage2_name:
            return name, r
    mine = read_report(stage2_name, folder)
    if mine is None:
        return None
    clip = (spec_for(get_pipeline(mine["model"])).name, mine["size"], mine["topology"])
    for name, _, r in found:
        if (r.get("vae"), r.get("size"), r.get("topology")) == clip:
            return name, r
    return None


def schedule_label(r: dict) -> str:
    dc = r["cache"]["config"].get("deepcache") or {}
    sch = r["schedule"]
    which = (f"DeepCache {dc['start']}/{dc['end']}/{dc['interval']}" if dc
             else sch.get("source", "the report's schedule"))
    return f"{which}, {sch['computed_steps']}/{sch['steps']} computed"


def job_row(name: str, r: dict, decode: tuple[str, dict] | None, host: dict) -> dict:
    """Every figure of one pipeline x slice, each with its kind and basis."""
    s1, work, machine = stage1_figure(r, host)
    s = r["seconds"]
    what = f"`{name}` ({r['topology']})"
    s2_off = Figure(s["run_uncached"], "roofline", f"{what}: {r['steps']} steps at the roofline")
    s2_on = Figure(s["run_cached"], "roofline", f"{what}: {schedule_label(r)}")
    if decode is None:
        s3 = Figure(None, "roofline", "no decode report")
        cold = Figure(r["compile_seconds"], "measured", "stage 2 only (no decode report); "
                      "deviceless compile on this machine")
    else:
        dname, d = decode
        s3 = Figure(d["roofline_seconds"], "roofline", f"`{dname}`: the clip's decode")
        cold = Figure(r["compile_seconds"] + d["compile_seconds"], "measured",
                      f"stage 2 + stage 3 (`{dname}`), deviceless compile on this machine")
    warm = Figure(WARM_STAGE2 + (0 if decode is None else WARM_STAGE3), "estimate", WARM_BASIS)
    basis = "stage 1 + stage 2 {} + stage 3"
    anchors = [a for a in ANCHORS if (a.model, a.topology) == (r["model"], r["topology"])]
    return {
        "row": name, "model": r["model"], "topology": r["topology"], "cfg": r.get("cfg", 1),
        "sp": r.get("sp"), "size": r["size"],
        "steps": r["steps"], "schedule": schedule_label(r), "decode": None if decode is None
        else decode[0], "host": None if machine is None else
        {"machine": machine[0], "vcpus": machine[1], "source": machine[2]},
        "stage1_work": [asdict(w) for w in work],
        "figures": {k: asdict(v) for k, v in {
            "stage1": s1, "stage2_uncached": s2_off, "stage2_cached": s2_on, "stage3": s3,
            "compile_cold": cold, "compile_warm": warm,
            "total_uncached": total([s1, s2_off, s3], basis.format("uncached")),
            "total_cached": total([s1, s2_on, s3], basis.format("cached"))}.items()},
        "anchors": [asdict(a) for a in anchors],
    }


def unmodelled(folder: Path = OUT) -> list[str]:
    """ROWS with a report whose pipeline's stage 1 has no work model (not on the page)."""
    return [name for name, _ in ROWS
            if (r := read_report(name, folder)) is not None and not modelled(r["model"])]


def job_rows(host: dict, folder: Path = OUT) -> list[dict]:
    """One row per pipeline x slice, the first ROWS entry of each that has a report and whose
    stage 1 is modelled (`unmodelled` names the others)."""
    rows, seen = [], set()
    for name, _ in ROWS:
        r = read_report(name, folder)
        if r is None or (key := (r["model"], r["topology"], r.get("cfg", 1))) in seen \
                or not modelled(r["model"]):
            continue
        seen.add(key)
        rows.append(job_row(name, r, decode_for(name, folder), host))
    return rows


# --- the page -------------------------------------------------------------------------------------

def _fig(row: dict, key: str) -> Figure:
    return Figure(**row["figures"][key])


def _slice(row: dict, rows: list[dict]) -> str:
    """The row's slice, with its mesh where another row has the same pipeline and slice (I2V-A14B
    on v7x-8 as sp 8 and as maxdiffusion's cfg 2 x sp 4)."""
    twins = sum((r["model"], r["topology"]) == (row["model"], row["topology"]) for r in rows)
    return row["topology"] + (f" (cfg {row['cfg']} x sp {row['sp']})" if twins > 1 else "")


def table_line(row: dict, rows: list[dict] = ()) -> str:
    f = {k: _fig(row, k) for k in row["figures"]}
    none = "no decode report"
    s3, t_off, t_on = ((f["stage3"].cell(1), f["total_uncached"].cell(), f["total_cached"].cell())
                       if row["decode"] else (none, none, none))
    anchors = "; ".join(f"{a['text']} [M, {a['source'].split()[0]}]" for a in row["anchors"]) or "-"
    h, w, frames = row["size"]
    return (f"| {row['model']} {frames} x {h} x {w} | {_slice(row, rows or [row])} | {f['stage1'].cell(1)} | "
            f"{f['stage2_uncached'].cell(1)} | {f['stage2_cached'].cell(1)} ({row['schedule']}) | "
            f"{s3} | {f['compile_cold'].cell()} | {f['compile_warm'].cell()} | "
            f"{t_off} | {t_on} | {anchors} |")


def stage1_line(row: dict, host: dict) -> str:
    h = row["host"]
    work = "; ".join(f"{w['what']}: {w['flops'] / 1e12:.1f} TFLOP at "
                     f"{host['rates_gflops'][w['rate']]:.1f} GFLOP/s here" for w in row["stage1_work"])
    where = "-" if h is None else f"{h['machine']}, {h['vcpus']} vCPUs ({h['source']})"
    return f"| `{row['row']}` | {work} | {where} | {_fig(row, 'stage1').cell(1)} |"


def readings(rows: list[dict]) -> list[str]:
    """The anchors' measured seconds against our roofline for the same pipeline and slice, and
    the I2V condition's share of stage 1."""
    out, i2v = [], []
    for row in rows:
        work = row["stage1_work"]
        if get_pipeline(row["model"]).task == "i2v" and any(w["rate"] == "vae" for w in work):
            vae = sum(w["flops"] for w in work if w["rate"] == "vae")
            i2v.append(f"`{row['row']}` {vae / sum(w['flops'] for w in work):.0%}")
        for a in row["anchors"]:
            ours = _fig(row, "stage2_uncached").value
            if a["model"].startswith("hunyuan") and a["seconds"]:
                out.append(f"- {row['model']} on {_slice(row, rows)}: the anchor measured stage 2 at "
                           f"{a['seconds']:.0f} s with stock splash; our roofline is {ours:.1f} s, "
                           f"{a['seconds'] / ours:.1f}x below it: what kernels short of the chip's "
                           "peaks (and anything the roofline leaves out) cost there.")
            elif a["seconds"]:
                job = _fig(row, "total_uncached").value
                out.append(f"- {row['model']} on {_slice(row, rows)}: the anchor published "
                           f"{a['seconds']:.1f} s; our uncached job (stage 1 estimate + roofline "
                           + (f"stages 2 and 3) is {job:.0f} s" if job is not None else
                              f"stage 2) has stage 2 at {ours:.1f} s") + ".")
    if i2v:
        stage1 = next(a.stage1_seconds for a in ANCHORS if a.stage1_seconds is not None)
        out.append(f"- The Wan2.1 VAE encode of the I2V condition is most of stage 1's FLOPs on the "
                   f"host ({', '.join(i2v)}); the anchor's Wan2.2 stage 1 runs that encode on the TPU "
                   f"(~{stage1:g} s for all of stage 1 on v5p-8).")
    return out


def host_lines(host: dict) -> list[str]:
    r = host["rates_gflops"]
    return [
        f"Stage-1 rates, measured {host['date']} on this machine ({host['cpu']}, {host['threads']} "
        f"threads, load average {host['loadavg'][0]:.1f} from other jobs when it began, so a low "
        f"reading of this CPU): one real-size layer each, random weights, median of {TIMED_RUNS} timed "
        f"runs after one warm-up: umT5-XXL {r['umt5']:.1f} GFLOP/s (bf16, {UMT5_PROBE_TOKENS} tokens), "
        f"Qwen2.5-VL-7B {r['qwen']:.1f} (bf16, {QWEN_PROBE_TOKENS} tokens), the Wan2.1 VAE encoder "
        f"{r['vae']:.1f} (fp32, {host['vae_probe']})"
        + ("" if "siglip" not in r else
           f", the HunyuanVideo-1.5 VAE encoder {r['hy_vae']:.1f} (fp32, one frame of that size), "
           f"SigLIP {r['siglip']:.1f} (bf16, one image), wav2vec2-large {r['wav2vec2']:.1f} (fp32, "
           f"all {WAV2VEC2['num_hidden_layers']} layers, {WAV2VEC2_PROBE_SECONDS} s of speech)")
        + ". A plain matmul of umT5's FFN shape: "
        f"{r['matmul_bf16']:.1f} GFLOP/s in bf16, {r['matmul_fp32']:.1f} in fp32 (this CPU's bf16 "
        f"instructions: {', '.join(host['bf16_native']) or 'none, no AVX512-BF16 or AMX'})"
        + ("" if r["matmul_bf16"] >= r["matmul_fp32"] else
           f": the bf16 that stage 1 runs its text encoders in on a CPU is "
           f"{r['matmul_fp32'] / r['matmul_bf16']:.1f}x slower than fp32 here, so a host with native "
           "bf16 (or fp32 text encoders) would shorten the text encodes") + ".",
        "",
        f"Measured, the whole stage 1 at tiny size: `python stage1_encode.py --prompt \"...\"` on "
        f"the default tiny model ({host['tiny_model']}) takes {host['tiny_stage1_s']:.1f} s [M] "
        f"a process on this machine (median of {TIMED_RUNS}; the interpreter and imports included).",
    ]


def page(rows: list[dict], host: dict, skipped: list[str] = ()) -> list[str]:
    vcpus = [vcpu for _, vcpu, _ in HOSTS.values()]
    lines = [
        "# The whole job: stage 1, stage 2, stage 3 and compile, per pipeline and slice",
        "",
        "`python -m bench.tpu_pages.whole_job` (`--page_only`: from the reports under "
        "`bench/results/tpu_aot/` and the last measurement in `whole_job.json`, which holds every "
        "figure below with its kind and basis).",
        "",
        "Kinds: **[M]** measured (on what is said), **[R]** roofline (the compiled program's flops, "
        "bytes and collectives at the chip's peaks: `bench/results/tpu_aot.md`; real steps run "
        "slower), **[E]** estimate (its basis below). Seconds. Total = stage 1 + stage 2 + stage 3; "
        "not counted: loading the weights, the compile (its columns), writing the mp4. Stage 2 "
        "cached: the schedule the reports were compiled with, `--enable_cache`'s default; the "
        "presets (TeaCache-based) decide per run, so they have no roofline without a trace.",
        "",
        "| pipeline (frames x H x W) | slice | stage 1 (host) | stage 2 uncached | stage 2 cached "
        f"(schedule) | stage 3 | compile cold (this {os.cpu_count()}-core machine) | compile warm "
        "| total uncached | total cached | anchor, published |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *[table_line(r, rows) for r in rows],
        *([] if not skipped else [
            "", f"Not on this page: {', '.join(skipped)} (stage 2 compiled, `bench/results/tpu_aot.md`; "
            "what their stage 1 computes, the image or speech encoders beside the text encoder, is "
            "not modelled here yet)."]),
        "",
        "## How each kind is made",
        "",
        "- Stage 1 [E]: FLOPs counted from the encoders' architectures (2 a multiply-add; the "
        "prompt and, with CFG, the negative prompt at the pipeline's full text length: an upper "
        "bound, as stage 1 runs only the real tokens; the VAE encodes and the image and speech "
        "encoders counted by torch's flop counter on the meta device) / the rate one real-size "
        "layer sustains on this CPU, scaled linearly "
        "to the host's vCPUs (as if each sustained this CPU's rate per thread: optimistic in the "
        "scaling, pessimistic in the rate, see below).",
        "- Stage 2 and stage 3 [R]: the reports' roofline run (stage 2: every step, uncached or at "
        "the schedule; stage 3: the clip's decode, the first call + a steady call per further "
        "latent frame, each a chain of block programs).",
        "- Compile cold [M]: the reports' compile seconds, stage 2's programs + stage 3's, libtpu "
        f"compiling deviceless on this shared {os.cpu_count()}-core machine (a TPU VM host has "
        f"{min(vcpus)}-{max(vcpus)} vCPUs; stage 3's block programs compile a core pair each, one at a "
        "time here).",
        f"- Compile warm [E]: every program from the persistent cache (a second run compiles "
        f"nothing: tests/test_compile_cache.py); loading them is not measured here (no TPU). "
        f"{WARM_STAGE2:g} s for stage 2 + {WARM_STAGE3:g} s for stage 3, from {WARM_BASIS}.",
        "- Totals [E]: sums of the figures beside them.",
        "- Anchor [M, source]: published by another project on the same pipeline and slice class, "
        "timed there; not comparable step for step (their kernels, schedules and what the time "
        "covers differ).",
        "",
        "## Stage 1 on the host",
        "",
        "| row | work (FLOPs; rate here) | host | seconds |",
        "|---|---|---|---|",
        *[stage1_line(r, host) for r in rows],
        "",
        *host_lines(host),
        "",
        "## Anchors",
        "",
        *readings(rows),
    ]
    shown = {(r["model"], r["topology"]) for r in rows}
    for a in ANCHORS:
        if (a.model, a.topology) not in shown:
            lines.append(f"- {a.model} on {a.topology} (not a pipeline and slice of the table): "
                         f"{a.text} [M] ({a.source}).")
    lines += ["", "Sources of the table's anchors: " + "; ".join(
        f"{a.model} on {a.topology}: {a.source}" for a in ANCHORS if (a.model, a.topology) in shown)
        + "."]
    return lines


# --- measuring this CPU ---------------------------------------------------------------------------

def _median_seconds(fn, runs: int = TIMED_RUNS) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _umt5_layer():
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    c = UMT5
    model = UMT5EncoderModel(UMT5Config(
        vocab_size=1000, d_model=c["d"], d_kv=64, num_heads=c["inner"] // 64, d_ff=c["ffn"],
        num_layers=1, feed_forward_proj="gated-gelu", is_encoder_decoder=False)).bfloat16().eval()
    ids = torch.randint(0, 1000, (1, UMT5_PROBE_TOKENS))
    return umt5_flops(UMT5_PROBE_TOKENS) / c["layers"], lambda: model(input_ids=ids)


def _qwen_layer():
    import torch
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    c = QWEN
    model = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=1000, hidden_size=c["d"], intermediate_size=c["ffn"], num_hidden_layers=1,
        num_attention_heads=c["q"] // 128, num_key_value_heads=c["kv"] // 128,
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})).bfloat16().eval()
    ids = torch.randint(0, 1000, (1, QWEN_PROBE_TOKENS))
    return qwen_flops(ids.shape[1]) / c["layers"], lambda: model(input_ids=ids, output_hidden_states=True)


VAE_PROBE = (I2V_VAE, 5, 128, 224)  # the encoder's causal first frame + one 4-frame chunk


def _vae_encoder():
    import torch

    vae, video = build_vae(I2V_VAE, "cpu"), torch.randn(1, 3, *VAE_PROBE[1:])
    return vae_encoder_flops(*VAE_PROBE), lambda: vae.encode(video)


def _hy_vae_encoder():
    import torch

    vae, image = build_vae(HY_VAE, "cpu"), torch.randn(1, 3, 1, *VAE_PROBE[2:])
    return vae_encoder_flops(HY_VAE, 1, *VAE_PROBE[2:]), lambda: vae.encode(image)


def _siglip_layer():
    import torch

    model, size = siglip_model(1, "cpu").bfloat16(), SIGLIP["image_size"]
    pixels = torch.randn(1, 3, size, size, dtype=torch.bfloat16)
    return siglip_flops(layers=1), lambda: model(pixel_values=pixels)


def _wav2vec2():
    import torch

    model = wav2vec2_model(WAV2VEC2["num_hidden_layers"], "cpu")
    speech = torch.randn(1, WAV2VEC2_PROBE_SECONDS * AUDIO_HZ)
    return (wav2vec2_flops(WAV2VEC2_PROBE_SECONDS),
            lambda: model(speech, output_hidden_states=True))


def _matmul(dtype_name: str):
    import torch

    dtype = getattr(torch, dtype_name)
    x, y = torch.randn(512, UMT5["d"], dtype=dtype), torch.randn(UMT5["d"], UMT5["ffn"], dtype=dtype)
    return 2 * x.shape[0] * x.shape[1] * y.shape[1], lambda: x @ y


def gflops(build) -> float:
    """GFLOP/s of the (flops, call) that `build` makes, its model freed after."""
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        flops, call = build()
        return flops / _median_seconds(call) / 1e9


def measure_host(sizes: list[tuple[str, int, int, int]]) -> dict:
    """This CPU's rates on one real-size layer of each encoder, a plain matmul in both dtypes,
    the tiny default stage 1, and the VAE encode FLOPs at the sizes the rows need."""
    import torch
    from transformers.utils import logging

    logging.set_verbosity_error()
    load = os.getloadavg()
    rates = {"umt5": gflops(_umt5_layer), "qwen": gflops(_qwen_layer), "vae": gflops(_vae_encoder),
             "hy_vae": gflops(_hy_vae_encoder), "siglip": gflops(_siglip_layer),
             "wav2vec2": gflops(_wav2vec2),
             "matmul_fp32": gflops(lambda: _matmul("float32")),
             "matmul_bf16": gflops(lambda: _matmul("bfloat16"))}
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, str(ROOT / "stage1_encode.py"), "--prompt",
                "red circle moves right on blue", "--output_dir", tmp, "-q", "--summary_json",
                os.path.join(tmp, "s.json")]
        tiny = _median_seconds(lambda: subprocess.run(argv, cwd=ROOT, check=True, capture_output=True))
        tiny_model = json.loads(Path(tmp, "s.json").read_text())["model"]
    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")),
               "unknown CPU")
    flags = set(next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), []))
    return {"date": datetime.date.today().isoformat(), "cpu": cpu, "threads": torch.get_num_threads(),
            "bf16_native": sorted(flags & {"avx512_bf16", "amx_bf16"}),
            "loadavg": load, "rates_gflops": rates, "vae_probe": "x".join(map(str, VAE_PROBE[1:])),
            "tiny_stage1_s": tiny, "tiny_model": tiny_model,
            "vae_flops": {vae_key(*k): vae_encoder_flops(*k) for k in sizes}}


def vae_sizes(folder: Path = OUT) -> list[tuple[str, int, int, int]]:
    """The VAE encodes the rows' stage 1 needs, as `stage1_work` asks for them."""
    sizes = set()
    for name, _ in ROWS:
        r = read_report(name, folder)
        if r is not None and modelled(r["model"]):
            stage1_work(r, lambda *size: sizes.add(size) or 0.0)
    return sorted(sizes)


def write(rows: list[dict], host: dict, page_path: Path = PAGE, skipped: list[str] = ()) -> str:
    text = "\n".join(page(rows, host, skipped)) + "\n"
    page_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(str(page_path), lambda f: f.write(text))
    data = json.dumps({"host": host, "rows": rows}, indent=1) + "\n"
    atomic_write(str(page_path.with_suffix(".json")), lambda f: f.write(data))
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page_only", action="store_true", help="measure nothing: reuse the host "
                    f"measurement in {DATA.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    if args.page_only:
        if not DATA.exists():
            raise SystemExit(f"--page_only: {DATA.relative_to(ROOT)} does not exist; run "
                             "`python -m bench.tpu_pages.whole_job` once to measure this CPU")
        host = json.loads(DATA.read_text())["host"]
        for size in vae_sizes():
            host["vae_flops"].setdefault(vae_key(*size), vae_encoder_flops(*size))
    else:
        host = measure_host(vae_sizes())
    print(write(job_rows(host), host, skipped=unmodelled()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

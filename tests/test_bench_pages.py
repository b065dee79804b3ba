"""The results pages bench/studies/taylorseer_gap.py, bench/studies/sp_scaling.py,
bench/studies/presets.py and bench/tpu_pages/load.py write, bench/pareto/report.py's random-weight
notes and bench/tpu_pages/aot.py's section on where the collectives run: every figure on them
comes from the rows given, and the readings follow the rows (a different set of rows reads
differently)."""

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench.page import trained_step, write_page, write_section
from bench.studies import taylorseer_gap as tg
from sampling import budget_space

ROOT = Path(__file__).resolve().parent.parent


def _ts_rows(psnr: dict, theirs: float = 44.0) -> list[dict]:
    """One interval (2): TaylorSeer, and ours at starts 1 and 3, forecasts 0-2, plain and
    remodulated, with PSNR psnr[(start, forecast, remodulate)]."""
    rows = [{"name": "diffusers TaylorSeer interval 2", "impl": "diffusers", "interval": 2, "start": None,
             "forecast": None, "remodulate": False, "computed": 0.52, "psnr_db": theirs,
             "direction": 1.0, "shape": 0.75, "last_computed": None}]
    for (start, forecast, remodulate), value in psnr.items():
        rows.append({"name": f"ours DeepCache {start}/50/2 B0 forecast {forecast}"
                             + (" remodulated" if remodulate else ""),
                     "impl": "ours", "interval": 2, "start": start, "forecast": forecast,
                     "remodulate": remodulate, "computed": 0.52 if start == 1 else 0.54,
                     "psnr_db": value, "direction": 1.0, "shape": 0.75, "last_computed": True})
    return rows


BASE = {(1, 0, False): 45.0, (1, 0, True): 45.3, (1, 1, False): 46.0, (1, 1, True): 45.1,
        (1, 2, False): 40.0, (1, 2, True): 41.0, (3, 0, False): 45.0, (3, 0, True): 45.0,
        (3, 1, False): 49.0, (3, 1, True): 49.2, (3, 2, False): 42.0, (3, 2, True): 42.5}


def _page(rows, agreement=137.31, step=123):
    return tg.page(rows, agreement, cmd="python -m bench.studies.taylorseer_gap --prompts 2", prompts=2,
                   steps=50, weights="assets/x", step=step)


def test_taylorseer_page_from_rows(tmp_path):
    rows = _ts_rows(BASE)
    lines = _page(rows)
    text = "\n".join(lines)
    assert "Reproduce: `python -m bench.studies.taylorseer_gap --prompts 2` (2 held-out prompts" in text
    assert "trained weights: assets/x at step 123" in text
    assert "our uncached run against diffusers' uncached run: 137.3 dB" in text  # computed, printed
    for r in rows:
        assert tg.show(r) in lines
    bullets = [line for line in lines if line.startswith("- ")]
    assert len(bullets) == 4
    # best of ours at its steps: 46.0 (linear) against 44.0
    assert "46.0 extrapolated linearly, against TaylorSeer's 44.0: ahead (+2.0 dB)" in bullets[0]
    # remodulated minus plain over the 6 pairs: +0.3, -0.9, +1.0, 0, +0.2, +0.5
    assert "moves every row by -0.9 to +1.0 dB against the plain one (6 pairs)" in bullets[1]
    assert "changes our standing against TaylorSeer at no interval" in bullets[1]
    # start 3 against start 1, linear: 49.0 - 46.0
    assert bullets[2].startswith(
        "- The phase of the schedule moves the linear forecast by up to 3.0 dB, more than")
    assert "gives 49.0 dB against 46.0 for +0.02 computed" in bullets[2]
    # quadratic minus linear: -6.0, -4.1, -7.0, -6.7
    assert "loses 4.1-7.0 dB to the linear one in every pair (4)" in bullets[3]
    write_page(str(tmp_path / "sub" / "page.md"), lines)
    assert (tmp_path / "sub" / "page.md").read_text() == text + "\n"
    assert not [p for p in (tmp_path / "sub").iterdir() if p.name != "page.md"]  # no temporary left


def test_taylorseer_readings_follow_the_rows():
    # quadratic ahead in one pair, remodulating flips the standing, no step recorded
    psnr = {**BASE, (3, 2, True): 50.0, (1, 1, True): 43.0, (1, 0, True): 42.0}
    text = "\n".join(_page(_ts_rows(psnr), agreement=float("inf"), step=None))
    assert "the two uncached runs are bit-identical" in text
    assert "trained weights: assets/x;" in text
    assert "Quadratic minus linear forecast: -7.0 to +0.8 dB over 4 pairs, below zero in 3." in text
    assert "amplifies" not in text
    assert "at interval 2: ahead -> behind (+2.0 -> -1.0 dB)" in text
    assert "not what separates" not in text


def test_taylorseer_trained_step(tmp_path):
    assert trained_step(str(tmp_path)) is None
    (tmp_path / "training.json").write_text(json.dumps({"step": 77}))
    assert trained_step(str(tmp_path)) == 77


def test_sp_scaling_page(tmp_path):
    # a fresh process: the bench sets XLA_FLAGS (8 emulated devices) before jax starts
    out = tmp_path / "sp.md"
    code = textwrap.dedent(f"""
        import argparse
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from bench.studies import sp_scaling as s
        from bench.page import write_page
        rows = [{{"sp": 1, "uncached": 0.05, "cached": 0.04, "full": 0, "cached_call": 0}},
                {{"sp": 8, "uncached": 0.2, "cached": 0.08, "full": 256, "cached_call": 24}}]
        args = argparse.Namespace(steps=6, blocks=12, frames=9)
        write_page({str(out)!r}, s.page("TITLE", rows, s.command(args)))
    """)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=300,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    text = out.read_text()
    assert "Command: `python -m bench.studies.sp_scaling --steps 6`." in text
    # the flags as the run had them (tests/sp_jax_check.py, imported by the bench, adds its own)
    assert "8 emulated CPU devices (--xla_force_host_platform_device_count=8" in text
    assert "), jax " in text
    assert "cores visible" in text  # the machine line of bench/pareto/report.py
    lines = text.splitlines()
    table = lines[lines.index("```") + 1:]
    assert table[0] == "TITLE"
    assert table[2].split() == ["1", "50.0", "40.0", "1.25x", "0", "/", "0"]
    assert table[3].split() == ["8", "200.0", "80.0", "2.50x", "256", "/", "24"]
    assert table[4].startswith("(a step is two calls with CFG") and table[5] == "```"


# --- bench/studies/presets.py: one section per mode, readings from the rows ------------------------------

def _preset_model(title, family, signal, calls, psnr, attributes=()):
    """A model's record as bench/studies/presets.py keeps it: calls[p] and psnr[p] per preset."""
    from bench.studies import presets as ps
    runs = {"reference": {"calls": 1.0, "blocks": 1.0, "wall": 1.0, "signal": signal,
                          **dict.fromkeys(attributes, 1.0)}}
    for name in ("balanced", "hybrid", "safe", "turbo"):
        runs[name] = {"calls": calls[name], "blocks": calls[name] + 0.01, "wall": 1.2,
                      "psnr_db": psnr[name], "rel_l2": 1e-3, "rel_to_displacement": 2e-3,
                      **dict.fromkeys(attributes, 1.0)}
    return ps.record(title, f"{title}: HEADER", runs, attributes=attributes, family=family)


def _preset_models():
    def m(title, family, signal, safe, balanced, turbo, psnr=(90.0, 80.0, 70.0)):
        return _preset_model(title, family, signal,
                             {"safe": safe, "balanced": balanced, "turbo": turbo, "hybrid": 0.44},
                             {"safe": psnr[0], "balanced": psnr[1], "turbo": psnr[2], "hybrid": 75.0})
    return [m("HY, quiet", "HY", 2.0e-5, 0.70, 0.48, 0.26), m("HY, loud", "HY", 1.6e-2, 0.96, 0.56, 0.34),
            m("Wan, quiet", "Wan", 1.0e-4, 0.80, 0.54, 0.32, psnr=(60.0, 83.7, 70.2)),
            m("Wan, loud", "Wan", 1.1e-2, 0.78, 0.56, 0.34)]


def _flat(lines) -> str:
    return " ".join("\n".join(lines).split())


def test_presets_random_section_from_rows():
    from bench.studies import presets as ps
    models = _preset_models()
    lines = ps.random_section(models, cmd="python -m bench.studies.presets --steps 10", elapsed=12.0,
                              loads=(1.5, 2.25), init="init: X", plot="presets_trace.png")
    text = _flat(lines)
    assert "Reproduce: `python -m bench.studies.presets --steps 10` (12 s;" in text
    assert "1-minute load average 1.50 at the start, 2.25 at the end" in text
    for m in models:  # the tables are the printed ones
        for line in ps.model_lines(m):
            assert line in lines
    assert "  Wan, quiet                             signal 1.0e-04  NO   60.0 >= 83.7 >= 70.2" in lines
    # 1.6e-2 / 2.0e-5 = 800, 1.1e-2 / 1.0e-4 = 110
    assert "the quietest and loudest models are 800x (HY) and 110x (Wan) apart" in text
    assert "safe >= balanced >= turbo in PSNR holds on 3 of 4 models (not on Wan, quiet)." in text
    assert "over the 4 models: safe 0.70-0.96, balanced 0.48-0.56, turbo 0.26-0.34;" in text
    # safe's median over the four is 0.79: HY loud is furthest from it
    assert "furthest from its preset's median: safe on HY, loud, 0.96 against 0.79." in text
    assert "![per-step trace](presets_trace.png)" in lines
    assert "hybrid (was)" not in text and "Before" not in text
    # a run where every model keeps the order reads so, and no plot: no image
    text = _flat(ps.random_section(models[:2], cmd="c", elapsed=1.0, loads=(0, 0), init="i"))
    assert "holds on all 2 models." in text and "![" not in text
    assert "over the 2 models: safe 0.70-0.96" in text and "furthest" not in text


def test_presets_trained_section_from_rows():
    from bench.studies import presets as ps
    attrs = ("foreground", "shape")
    m = _preset_model("wan-tiny-trained", None, 4.3e-3,
                      {"safe": 0.57, "balanced": 0.42, "turbo": 0.20, "hybrid": 0.415},
                      {"safe": 65.6, "balanced": 59.7, "turbo": 35.2, "hybrid": 61.8}, attrs)
    lines = ps.trained_section([m], cmd="python -m bench.studies.presets --weights trained --checkpoint ck",
                               elapsed=27.0, loads=(1, 1), init="weights: X", prompts=12,
                               weights=[("ck", 7)], checkpoint="ck")
    text = _flat(lines)
    assert lines[0] == "## Trained weights: `ck`"
    assert "(27 s; 12 held-out prompts per run, pooled;" in text and "Weights: `ck` at step 7." in text
    assert ("- wan-tiny-trained: safe >= balanced >= turbo in PSNR holds; no run breaks the prompt (no "
            "attribute loses more than one of the 12 prompts against the reference); `hybrid` (not part "
            "of the order) keeps more than `balanced` (61.8 against 59.7 dB) at less compute (0.425 "
            "against 0.430 of the blocks).") in lines
    # one prompt of 12 lost is within the slack, two are not; the order broken
    m["runs"]["turbo"]["shape"] = 1 - 1 / 12
    m["runs"]["safe"]["foreground"] = 1 - 2 / 12
    m["runs"]["safe"]["psnr_db"] = 50.0
    text = _flat(ps.trained_section([m], cmd="c", elapsed=1.0, loads=(0, 0), init="i", prompts=12,
                                    weights=[("assets/x", None)]))
    assert "## Trained weights (issue 28)" in text and "Weights: `assets/x`." in text
    assert "in PSNR does NOT hold; more than one of the 12 prompts lost against the reference: " \
           "safe foreground 83% against 100%;" in text
    assert "turbo shape" not in text


def test_presets_page_keeps_each_modes_section(tmp_path):
    from bench.studies import presets as ps
    page = tmp_path / "presets.md"
    page.write_text("# typed by hand\n\nBefore (a table no run wrote)\n")
    models = _preset_models()

    def section(key, word):
        write_section(str(page), key, [f"## {key}", "", word], ps.head(), ps._rank)

    section("checkpoint bench/x", "first")
    section("trained", "second")
    section("random", "third")
    text = page.read_text()
    assert "typed by hand" not in text and "Before" not in text  # only what runs wrote stays
    assert text.index("## random") < text.index("## trained") < text.index("## checkpoint bench/x")
    section("trained", "again")
    text = page.read_text()
    assert "again" in text and "second" not in text and "first" in text and "third" in text
    assert text.startswith("# bench/studies/presets.py\n")
    assert "- `safe`: TeaCache threshold 1.5 times the mean change so far (relative); every call " \
           "computes over the last 40 percent of the schedule; tail blocks always run: 2; forecast order 1 " \
           "of the reused residual; never two reuses in a row." in text
    assert [p.name for p in tmp_path.iterdir()] == ["presets.md"]  # no temporary left
    # a whole section from rows goes in the same way
    write_section(str(page), "random", ps.random_section(models, cmd="c", elapsed=1.0, loads=(0, 0),
                                                            init="i"), ps.head(), ps._rank)
    assert "holds on 3 of 4 models" in page.read_text() and "again" in page.read_text()


# --- bench/tpu_pages/load.py ------------------------------------------------------------------------------

def _load_rows(paths=("old", "new"), threads=8):
    rows = {"old": {"path": "old", "seconds": 41.5, "peak_rss": 13.31e9, "baseline_rss": 0.48e9,
                    "bytes_read": 10e9, "device_bytes": 12.38e9, "jax": "0.10.2", "threads": None},
            "new": {"path": "new", "seconds": 20.4, "peak_rss": 1.51e9, "baseline_rss": 0.48e9,
                    "bytes_read": 10e9, "device_bytes": 10.47e9, "jax": "0.10.2", "threads": threads}}
    return [rows[p] for p in paths]


def _load_section(rows, **kw):
    from bench.tpu_pages import load
    args = dict(cmd="python -m bench.tpu_pages.load", model="wan2.2-ti2v-5b", layers=None, size=10e9,
                shards=3, host=10.3e9, hold="block", cache="cold", wrote_s=89.2, ram=24e9, loads=(3.0, 2.5),
                date="2026-11-25")
    return load.section(rows, **{**args, **kw})


def test_load_section_from_rows():
    from bench.tpu_pages import load
    lines = _load_section(_load_rows())
    text = _flat(lines)
    assert lines[0] == "## `python -m bench.tpu_pages.load`"
    assert "wan2.2-ti2v-5b, 10.00 GB bf16 in 3 shards (written for this run in 89 s)." in text
    assert f"Machine: {os.cpu_count()} CPUs, 24.0 GB RAM, jax 0.10.2 on CPU, 2026-11-25;" in text
    assert "old       41.5   13.31 GB     0.48 GB   10.00 GB    12.38 GB       1.33" in lines
    # 41.5 / 20.4; 1.51 / 10 and 13.31 / 10 of the checkpoint
    assert ("Sharded loading: 2.0x faster than the old path from a cold page cache, and peak RSS 0.15x "
            "the checkpoint (1.51 GB, 0.48 GB of it the process before loading), against 1.33x "
            "(13.31 GB).") in text
    assert "The new path read with 8 threads." in text
    # 13.31 - 0.48 = 12.83 above, 2.53 more than the 10.30 GB model
    assert ("whole model in host memory: 10.30 GB with the fp32 islands (the dtypes a bf16 load gives, "
            "from the checkpoint's headers); its peak RSS is 12.83 GB above the process before loading, "
            "2.53 GB more than the model") in text
    # one path, one thread, warm cache, reused: its own figures only
    text = _flat(_load_section(_load_rows(("new",), threads=1), cache="warm", wrote_s=None))
    assert "Sharded loading" not in text and "host memory" not in text
    assert "new: 20.4 s from a warm page cache, peak RSS 0.15x the checkpoint" in text
    assert "read with 1 thread." in text and "(reused from --dir)" in text and "dropped" not in text
    # hold all: the placed weights count in RSS too, so no split of the old peak
    text = _flat(_load_section(_load_rows(("old",)), hold="all"))
    assert "10.30 GB with the fp32 islands" in text and "above the process" not in text
    assert load.command(argparse.Namespace(**{**load.DEFAULTS, "cache": "warm", "threads": 1})) == \
        "python -m bench.tpu_pages.load --cache warm --threads 1"


def test_load_page_keeps_each_variants_section(tmp_path):
    from bench.tpu_pages import load
    page = tmp_path / "load.md"
    variant = "python -m bench.tpu_pages.load --cache warm"
    write_section(str(page), variant, _load_section(_load_rows(), cmd=variant, cache="warm"),
                  load.head(), load._rank)
    write_section(str(page), "python -m bench.tpu_pages.load", _load_section(_load_rows()), load.head(),
                  load._rank)
    text = page.read_text()
    assert text.startswith("# bench/tpu_pages/load.py\n") and "shards of at most 4 GiB" in _flat([text])
    assert text.index("## `python -m bench.tpu_pages.load`") < text.index(f"## `{variant}`")  # default first
    assert "10.3 GB" not in text and "MALLOC" not in text


# --- bench/pareto/report.py: the random-weight page's notes -----------------------------------

def _pareto_rows():
    from bench.pareto import report as rp

    def r(method, impl, setting, computed, psnr, rel_l2=1e-3):
        out = rp.row("wan", method, impl, setting)
        out.update(computed_fraction=computed, psnr_db=psnr, rel_l2=rel_l2, cpu_s=computed)
        return out
    sw = "ours FBCache +forecast1 gated step-weighted"
    return [r("diffusers FBC", "diffusers", "threshold 0.05", 0.42, 74.2),
            r("diffusers FBC", "diffusers", "threshold 0.1", 0.227, 62.5),
            r("diffusers FBC", "diffusers", "threshold 0.2", 0.149, 55.7),
            r("ours FBCache", "ours", "threshold 0.05", 0.42, 74.2),
            r("ours FBCache", "ours", "threshold 0.1", 0.246, 64.5),
            r("ours FBCache", "ours", "threshold 0.2", 0.149, 55.6),
            r(sw, "ours", "threshold 2.1", 0.111, 56.0), r(sw, "ours", "threshold 0.7", 0.169, 63.0),
            r(sw, "ours", "threshold 0.3", 0.227, 70.4),
            r("ours FBCache +forecast2 gated", "ours", "threshold 0.07", 0.304, 64.3),
            r("ours FBCache +forecast2 gated", "ours", "threshold 0.15", 0.265, 70.9),
            r("ours budgeted", "ours", "rel L2 budget 0.002: FBCache 0.05", 0.42, 74.2, rel_l2=0.001)]


def _pareto_notes(rows, unseen_error=0.0012):
    from types import SimpleNamespace

    fams = [SimpleNamespace(label="wan", title="W", config=SimpleNamespace(num_layers=30, dim=48))]
    facts = {"wan": {"steps": 50, "spread": 0.04, "blocks": 30, "tokens": 320,
                     "budget_unseen": [{"kind": "rel_err", "target": 0.002, "rel_l2": unseen_error,
                                        "computed": 0.4, "seed": 4}]}}
    from bench.pareto.page import notes
    return notes(rows, fams, facts)


def test_pareto_notes_from_rows():
    text = " ".join(_pareto_notes(_pareto_rows()).split())
    assert ("on W (50 steps), the same computed fraction and PSNR at threshold 0.05; elsewhere ours "
            "against diffusers': threshold 0.1 +0.019 computed, +2.0 dB; threshold 0.2 +0.000 computed, "
            "-0.1 dB.") in text
    # our front: 0.111, 0.169, 0.227 step-weighted, 0.265 gated, 0.42 FBCache
    assert ("The gated curves make 4 of the 5 points of our front on W (FBCache +forecast1 gated "
            "step-weighted 3, FBCache +forecast2 gated 1, FBCache 1).") in text
    # FBC's two cheapest front points against the step-weighted curve's cheapest reaching them
    assert ("its 55.7 dB at 0.149 computed reached at 0.111 (56.0 dB, +0.3); its 62.5 dB at 0.227 "
            "computed reached at 0.169 (63.0 dB, +0.5).") in text
    assert ("1 of our 3 curves is not monotonic in the threshold (the widest: W, FBCache +forecast2 gated "
            "threshold 0.07: 0.304 computed, 64.3 dB; threshold 0.15: 0.265, 70.9 dB)") in text
    assert "(up to 4% here, the spread above)" in text
    assert "calibrated on 3 draws" in text and "at most 0.60 of its budget" in text  # 0.0012 / 0.002
    assert "budgeted mode on 3 others, and is checked on 5" in text
    assert "the models are tiny (W: 30 blocks of width 48, 320 tokens)" in text
    for typed in ("0.99 to 1.00", "cos 0.0", "56.3", "2 of 100"):
        assert typed not in text
    # other rows read otherwise: the gated curve monotonic, no FBC, a smaller unseen error
    rows = [r for r in _pareto_rows() if r["method"] != "diffusers FBC"]
    rows[-2]["psnr_db"] = 60.0
    text = " ".join(_pareto_notes(rows, unseen_error=0.0004).split())
    assert "Each of our 3 curves is monotonic in the threshold" in text
    assert "Check of the harness" not in text and "cheap end" not in text
    assert "at most 0.50 of its budget" in text  # now the point's own 0.001 / 0.002


# --- bench/tpu_pages/aot.py: where the collectives run, from a report's placement ----------------------

def test_tpu_aot_placement_section_from_reports(tmp_path, monkeypatch):
    from bench.tpu_pages import aot as ta
    from tpu.hlo import CollectiveOp
    from tpu.placement import placement

    ring = [(0, 0, 0), (1, 0, 0), (1, 1, 0), (0, 1, 0)]  # a 2x2 square walked round
    listed = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]  # the diagonal is 2 hops
    ops = {"middle": [CollectiveOp("all-gather", 2**30, 0.75 * 2**30, 3, ((0, 1, 2, 3),))],
           "probe": [CollectiveOp("all-reduce", 4, 6.0, 1, None)]}
    report = {"model": "m", "size": [64, 32, 5], "topology": "v6e:2x2", "cfg": 1, "sp": 4, "chips": 4,
              "placement": placement(ops, {"mesh": ring, "list_order": listed}, extents=(2, 2, 1),
                                     wraps=(False,) * 3, sp=4)}
    (tmp_path / "row.json").write_text(json.dumps(report))
    (tmp_path / "old.json").write_text(json.dumps({**report, "placement": None}))
    monkeypatch.setattr(ta, "OUT", tmp_path)
    monkeypatch.setattr(ta, "ROWS", [("row", "--sp_size 4"), ("old", "--sp_size 4"), ("none", "")])
    text = "\n".join(ta.placement_lines())
    assert "row: m at 64 x 32 (H x W), 5 frames on v6e:2x2 (2x2 chips, no wraparound), cfg 1 x sp 4" \
        in text
    assert "The sp rings: mesh closed, 1+1+1+1 hops; list order open, 1+2+1+2 hops." in text
    gb = 3 * 0.75 * 2**30 / 1e9
    assert f"| all-gather | middle | 3 | 1x4 | 1-1 (1.00) | 1/1 | 1-2 (1.50) | 0/1 | {gb:.1f} / " \
           f"{1.5 * gb:.1f} |" in text
    assert "| all-reduce | probe | 1 | - | - | - | - | - | 0.0 / 0.0 |" in text
    assert "| (all-reduce: 1 runs with groups not read) |" in text
    assert "Reports with no placement (compiled before it was recorded): old;" in text
    monkeypatch.setattr(ta, "ROWS", [("old", "--sp_size 4")])
    assert ta.placement_lines() == []  # no report with a placement: no section


def test_tpu_aot_names_how_each_row_compiled(tmp_path, monkeypatch):
    from bench.tpu_pages import aot as ta

    record = {"date": "2026-11-29", "cores": 2, "load_start": 0.13, "load_end": 1.96}
    (tmp_path / "new.json").write_text(json.dumps({ta.COMPILED: record}))
    (tmp_path / "old.json").write_text(json.dumps({}))
    monkeypatch.setattr(ta, "OUT", tmp_path)
    text = " ".join(ta.compiled_lines(["new", "old", "absent"]))
    assert ("new 2026-11-29, 2 cores, 1-minute load average 0.1 at the start, 2.0 at the end." in text)
    assert text.endswith("Reports from before the record was kept: old.")
    assert "absent" not in text


def test_calibration_cost_counts_runs_worth_references_and_floors():
    """bench/studies/calibration_cost.py (issue 60): a configuration run is worth its computed
    fraction, every draw its uncached reference, and bf16 floors range from the calibration
    draws' (and the chaotic draws') to one per further draw."""
    from bench.studies.calibration_cost import page_cost, per_draw
    block = {"seeds": [1, 2, 3], "screen_seeds": [34, 35], "confirm_seeds": [84],
             "chaotic": {"seeds": [36], "floor_rel_l2": [0.2]},
             "candidates": [
                 {"label": "static a", "computed": [0.5] * 3, "screen": {"computed": [0.5, 0.5]},
                  "confirm": {"computed": [0.5]}},
                 {"label": "TeaCache relative 3", "computed": [0.4, 0.6, 0.5],
                  "screen": {"computed": [0.2]}}]}
    c = page_cost(block)
    assert c["calibration_runs"] == 6 and c["calibration"] == pytest.approx(3.0 + 3)
    assert (c["screen_runs"], c["screen"]) == (3, pytest.approx(1.2 + 2))
    assert (c["confirm_runs"], c["confirm"]) == (1, pytest.approx(0.5 + 1))
    assert c["floors"] == (4, 7) and c["total"] == (pytest.approx(6 + 3.2 + 1.5 + 1 + 4),
                                                    pytest.approx(6 + 3.2 + 1.5 + 1 + 7))
    # the static schedules of a real pipeline: their computed fractions summed, exactly
    static, adaptive, n = per_draw("wan2.2-ti2v-5b", {})
    assert 80 < static < 100 and adaptive == len(budget_space.SPACE) and n > 250


def test_the_replay_runs_no_block_and_reproduces_the_run_it_recorded():
    """bench/studies/calibration_proxy.py (issue 60): the record is one uncached run; replaying it with
    every step computed gives that run back (to fp32 rounding of input + residual), and a static
    schedule's replay evaluates no block at all while its latents differ from the record."""
    from bench.pareto import workload as pw
    from bench.studies import calibration_proxy as cp
    from cache import CMConfig
    from cache.flags import config_from_fields
    wl = pw.build_workload(pw.trained_families()["wan"], steps=6)
    counter = pw.our_counter(wl)
    base, record, computed = cp.run(wl, CMConfig())
    assert computed == 1.0 and len(record) == 12  # 6 steps x (cond, uncond)
    again, _, _ = cp.run(wl, CMConfig(), record)
    assert (again - base).abs().max() <= 1e-5 * base.abs().max()
    counter.reset()
    schedule = config_from_fields(budget_space.static_fields([0, 1, 3, 5]))
    latents, taken, fraction = cp.run(wl, schedule, record)
    assert not taken and fraction == 0.0 and sum(counter.per_call) == 0
    assert 0 < (latents - base).abs().max()
    assert cp.spearman([1, 2, 3, 4], [10, 20, 40, 30]) == pytest.approx(0.8)


def test_cfg_reuse_bound_spends_the_calls_it_says_and_reproduces_the_uncached_run():
    """bench/studies/cfg_reuse_bound.py: the call schedules hold the counts they claim, the frequency
    split is exact at its ends, and a schedule computing every step is the uncached run while
    one reusing the unconditional branch differs from it."""
    import torch

    from bench.pareto import workload as pw
    from bench.studies import cfg_reuse_bound as cb
    assert cb.evenly(50, 18)[0] == 0 and cb.evenly(50, 18)[-1] == 49 and len(cb.evenly(50, 18)) == 18
    c = cb.evenly(50, 24)
    u = cb.subset(c, 12)
    assert len(u) == 12 and set(u) <= set(c) and u[0] == 0 and u[-1] == 49
    x = torch.randn(1, 3, 2, 8, 8)
    assert torch.allclose(cb.low_pass(x, 2.0), x, atol=1e-5)
    assert torch.allclose(cb.low_pass(x, 0.0), x.mean((-2, -1), keepdim=True), atol=1e-5)
    assert cb.extrapolate([(0, 1.0), (2, 3.0)], 3) == 4.0 and cb.extrapolate([(2, 3.0)], 5) == 3.0
    wl = pw.build_workload(pw.trained_families()["wan"], steps=6)
    ref = cb.sample(wl, 10, None, None)
    assert torch.equal(cb.sample(wl, 10, list(range(6)), list(range(6))), ref)
    reused = cb.sample(wl, 10, list(range(6)), [0, 5], ("scaled", 0.5))
    assert 0 < cb.psnr(reused, ref) < 200

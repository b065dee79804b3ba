"""The results pages bench/taylorseer_gap.py and bench/sp_scaling.py write: every figure on them
comes from the rows given, and the readings follow the rows (a different set of rows reads
differently)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from bench import taylorseer_gap as tg

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
    return tg.page(rows, agreement, cmd="python bench/taylorseer_gap.py --prompts 2", prompts=2,
                   steps=50, weights="assets/x", step=step)


def test_taylorseer_page_from_rows(tmp_path):
    rows = _ts_rows(BASE)
    lines = _page(rows)
    text = "\n".join(lines)
    assert "Reproduce: `python bench/taylorseer_gap.py --prompts 2` (2 held-out prompts" in text
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
    tg.write_page(str(tmp_path / "sub" / "page.md"), lines)
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
    assert tg.trained_step(str(tmp_path)) is None
    (tmp_path / "training.json").write_text(json.dumps({"step": 77}))
    assert tg.trained_step(str(tmp_path)) == 77


def test_sp_scaling_page(tmp_path):
    # a fresh process: the bench sets XLA_FLAGS (8 emulated devices) before jax starts
    out = tmp_path / "sp.md"
    code = textwrap.dedent(f"""
        import argparse
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from bench import sp_scaling as s
        rows = [{{"sp": 1, "uncached": 0.05, "cached": 0.04, "full": 0, "cached_call": 0}},
                {{"sp": 8, "uncached": 0.2, "cached": 0.08, "full": 256, "cached_call": 24}}]
        args = argparse.Namespace(steps=6, blocks=12, frames=9)
        s.write_page({str(out)!r}, s.page("TITLE", rows, s.command(args)))
    """)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=300,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    text = out.read_text()
    assert "Command: `python bench/sp_scaling.py --steps 6`." in text
    # the flags as the run had them (tests/sp_jax_check.py, imported by the bench, adds its own)
    assert "8 emulated CPU devices (--xla_force_host_platform_device_count=8" in text
    assert "), jax " in text
    assert "cores visible" in text  # the machine line of bench/pareto_report.py
    lines = text.splitlines()
    table = lines[lines.index("```") + 1:]
    assert table[0] == "TITLE"
    assert table[2].split() == ["1", "50.0", "40.0", "1.25x", "0", "/", "0"]
    assert table[3].split() == ["8", "200.0", "80.0", "2.50x", "256", "/", "24"]
    assert table[4].startswith("(a step is two calls with CFG") and table[5] == "```"

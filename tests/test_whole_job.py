"""bench/tpu_pages/whole_job.py's page from fake reports: every figure carries the kind it is made as, the
totals are the sums of their parts, and the rows follow bench/tpu_pages/aot.py's ROWS and DECODE_ROWS."""

import json

import pytest

from bench.tpu_pages import stage1_work as s1
from bench.tpu_pages import whole_job as wj

# 2 prompts x one umT5-XXL encode of 512 tokens, worked by hand: per layer
# 2 * 512 * (4 * 4096 * 4096 + 3 * 4096 * 10240) + 4 * 512**2 * 4096 = 201,863,462,912; 24 layers
UMT5_TWO_PROMPTS = 2 * 24 * 201_863_462_912
I2V_VAE_FLOPS, S2V_REF_FLOPS = 3.0e14, 5.0e12
# wav2vec2-large on 5 s of 16 kHz speech, worked by hand: 249 frames; per layer
# 2 * 249 * (4 * 1024**2 + 2 * 1024 * 4096) + 4 * 249**2 * 1024 = 6.520e9, 24 layers 156.5e9;
# the conv front end 24.6e9 (512 channels: kernel 10 stride 5, four of kernel 3 stride 2, two of
# kernel 2 stride 2), its positional conv (kernel 128, 16 groups) 4.2e9, the projection 0.3e9
WAV2VEC2_5S = 185.5e9
HOST = {"date": "2026-01-01", "cpu": "test CPU", "threads": 2, "bf16_native": [],
        "loadavg": [0.5, 0.5, 0.5], "vae_probe": "5x128x224", "tiny_stage1_s": 2.0,
        "tiny_model": "wan-tiny-trained", "vae_flops": {"wan2.1-vae 81x720x1280": I2V_VAE_FLOPS,
                                                        "wan2.1-vae 1x704x1280": S2V_REF_FLOPS},
        "rates_gflops": {"umt5": 20.0, "qwen": 25.0, "vae": 50.0, "matmul_bf16": 20.0,
                         "matmul_fp32": 80.0, "wav2vec2": 40.0}}


def _stage2(model, topology, size, steps, off, on, compile_s):
    return {"model": model, "topology": topology, "size": size, "steps": steps, "cfg": 1, "sp": 8,
            "seconds": {"run_uncached": off, "run_cached": on}, "compile_seconds": compile_s,
            "cache": {"config": {"deepcache": {"start": 11, "end": 45, "interval": 4}}},
            "schedule": {"steps": steps, "computed_steps": 25, "branches_per_step": 2}}


@pytest.fixture
def rows(tmp_path, monkeypatch):
    reports = {
        "ti2v": _stage2("wan2.2-ti2v-5b", "v6e:2x4", [704, 1280, 121], 50, 10.0, 6.0, 100.0),
        # the same pipeline and slice again (an alternative): not a row of its own
        "ti2v-alt": _stage2("wan2.2-ti2v-5b", "v6e:2x4", [704, 1280, 121], 50, 99.0, 99.0, 1.0),
        "a14b": _stage2("wan2.2-i2v-a14b", "v6e:2x4", [720, 1280, 81], 40, 70.0, 35.0, 130.0),
        # the same pipeline and slice split cfg 2 x sp 4: a row of its own, decoding like "ti2v"
        "ti2v-cfg": {**_stage2("wan2.2-ti2v-5b", "v6e:2x4", [704, 1280, 121], 50, 9.0, 5.0, 90.0),
                     "cfg": 2, "sp": 4},
        "vae-ti2v": {"roofline_seconds": 0.5, "compile_seconds": 300.0, "vae": "wan2.2-vae",
                     "size": [704, 1280, 121], "topology": "v6e:2x4"},
        # speech to video: the speech and reference-image encoders beside the text encoder
        "s2v": _stage2("wan2.2-s2v-14b", "v6e:2x4", [704, 1280, 80], 40, 80.0, 40.0, 300.0),
    }
    for name, r in reports.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    monkeypatch.setattr(wj, "ROWS", [("ti2v", ""), ("ti2v-alt", ""), ("a14b", ""), ("none", ""),
                                      ("s2v", ""), ("ti2v-cfg", "")])
    monkeypatch.setattr(wj, "DECODE_ROWS", [("vae-missing", "", "ti2v"), ("vae-ti2v", "", "ti2v")])
    return wj.job_rows(HOST, tmp_path)


def _figures(row):
    return {k: wj.Figure(**v) for k, v in row["figures"].items()}


def test_a_pipeline_whose_stage1_is_not_modelled_is_named_not_estimated(tmp_path, monkeypatch):
    monkeypatch.setattr(s1, "STAGE1_TASKS", {**s1.STAGE1_TASKS, "wan": ("t2v", "ti2v", "i2v")})
    (tmp_path / "s2v.json").write_text(json.dumps(
        _stage2("wan2.2-s2v-14b", "v6e:2x4", [704, 1280, 80], 40, 80.0, 40.0, 300.0)))
    monkeypatch.setattr(wj, "ROWS", [("s2v", "")])
    assert wj.job_rows(HOST, tmp_path) == [] and wj.unmodelled(tmp_path) == ["s2v"]
    text = "\n".join(wj.page([], HOST, wj.unmodelled(tmp_path)))
    assert "Not on this page: s2v" in text


def test_speech_to_video_stage1_counts_speech_and_reference_image(rows):
    assert s1.wav2vec2_flops(5.0) == pytest.approx(WAV2VEC2_5S, rel=0.005)
    s2v = next(r for r in rows if r["row"] == "s2v")
    assert [w["rate"] for w in s2v["stage1_work"]] == ["umt5", "wav2vec2", "vae"]
    assert "5 s of speech" in s2v["stage1_work"][1]["what"]  # 80 frames at 16 fps
    assert _figures(s2v)["stage1"].value == pytest.approx(
        (UMT5_TWO_PROMPTS / 20e9 + s1.wav2vec2_flops(5.0) / 40e9 + S2V_REF_FLOPS / 50e9) / 90)


def test_rows_kinds_and_totals(rows):
    assert [r["row"] for r in rows] == ["ti2v", "a14b", "s2v", "ti2v-cfg"]
    ti2v, a14b, _, ti2v_cfg = (_figures(r) for r in rows)
    # a row no decode row is paired with takes the decode of its VAE, clip size and slice
    assert rows[3]["decode"] == "vae-ti2v" and ti2v_cfg["stage3"].value == 0.5
    assert rows[1]["decode"] is None  # a14b: no decode row of its pipeline
    kinds = {"stage1": "estimate", "stage2_uncached": "roofline", "stage2_cached": "roofline",
             "stage3": "roofline", "compile_cold": "measured", "compile_warm": "estimate",
             "total_uncached": "estimate", "total_cached": "estimate"}
    assert {k: f.kind for k, f in ti2v.items()} == kinds
    # stage 1: FLOPs / (20 GFLOP/s here x 180 vCPUs of a v6e-8 host / 2 threads)
    assert ti2v["stage1"].value == pytest.approx(UMT5_TWO_PROMPTS / (20e9 * 90))
    assert ti2v["stage3"].value == 0.5 and "vae-ti2v" in ti2v["stage3"].basis
    assert ti2v["compile_cold"].value == 400.0  # 100 (stage 2) + 300 (stage 3)
    assert ti2v["compile_warm"].value == wj.WARM_STAGE2 + wj.WARM_STAGE3
    assert ti2v["total_uncached"].value == pytest.approx(ti2v["stage1"].value + 10.0 + 0.5)
    assert ti2v["total_cached"].value == pytest.approx(ti2v["stage1"].value + 6.0 + 0.5)
    # I2V: the condition's VAE encode at the VAE rate, added to the text encodes
    assert a14b["stage1"].value == pytest.approx(
        UMT5_TWO_PROMPTS / (20e9 * 90) + I2V_VAE_FLOPS / (50e9 * 90))
    # no decode report: stage 3 and the totals have no value, compile is stage 2's alone
    assert a14b["stage3"].value is None and a14b["total_uncached"].value is None
    assert a14b["compile_cold"].value == 130.0 and a14b["compile_warm"].value == wj.WARM_STAGE2
    assert [a["seconds"] for a in rows[1]["anchors"]] == [184.7] and rows[0]["anchors"] == []


def test_page_marks_every_figure(rows):
    text = "\n".join(wj.page(rows, HOST))
    s1 = UMT5_TWO_PROMPTS / (20e9 * 90)
    line = next(x for x in text.splitlines() if x.startswith("| wan2.2-ti2v-5b"))
    assert line == (f"| wan2.2-ti2v-5b 121 x 704 x 1280 | v6e:2x4 (cfg 1 x sp 8) | {s1:.1f} [E] | "
                    "10.0 [R] | 6.0 [R] (DeepCache 11/45/4, 25/50 computed) | 0.5 [R] | 400 [M] | 10 [E] | "
                    f"{s1 + 10.5:.0f} [E] | {s1 + 6.5:.0f} [E] | - |")
    line = next(x for x in text.splitlines() if x.startswith("| wan2.2-i2v-a14b"))
    assert line.count("no decode report") == 3 and "184.7 s" in line and "[M, gpu-tpu-pedia]" in line
    assert "the anchor published 184.7 s" in text
    assert "4.0x slower than fp32 here" in text  # 80 / 20 GFLOP/s
    assert "(not a pipeline and slice of the table)" in text  # the v5p-8 and v7x-8 anchors


def test_figure_kinds_and_sums():
    with pytest.raises(ValueError, match="figure kind 'guess'"):
        wj.Figure(1.0, "guess", "")
    r, e = wj.Figure(2.0, "roofline", ""), wj.Figure(1.0, "estimate", "")
    assert wj.total([r, r], "") == wj.Figure(4.0, "roofline", "")
    assert wj.total([r, e], "") == wj.Figure(3.0, "estimate", "")
    assert wj.total([r, wj.Figure(None, "roofline", "")], "").value is None
    assert wj.Figure(12.34, "measured", "").cell(1) == "12.3 [M]"


def test_every_anchor_and_host_is_a_pipeline_and_slice_of_the_table():
    """An anchor or a host keyed otherwise than a row's `--model` and `--topology` is never shown
    beside a row (the v7x-8 anchor was keyed "v7x-8" before the table had v7x rows)."""
    from bench.tpu_pages.aot import ROWS
    slices = {(args.split()[1], args.split()[3]) for _, args in ROWS}
    assert {(a.model, a.topology) for a in wj.ANCHORS} <= slices
    assert set(wj.HOSTS) <= {topology for _, topology in slices}


def test_hunyuan_image_to_video_stage1_counts_siglip_and_its_vae():
    # SigLIP so400m on one 384 x 384 image, by hand: 729 patches; per layer
    # 2 * 729 * (4 * 1152**2 + 2 * 1152 * 4304) + 4 * 729**2 * 1152 = 24.65e9, 27 layers 665.5e9,
    # the patch embedding 1.0e9, the pooling head's keys and values over 729 tokens ~3.9e9
    assert s1.siglip_flops() == pytest.approx(670.4e9, rel=0.005)
    asked = []
    report = _stage2("hunyuanvideo-1.5-720p_i2v_distilled", "v6e:2x4", [720, 1280, 121], 50, 1, 1, 1)
    work = s1.stage1_work(report, lambda *size: asked.append(size) or 7.0)
    assert [w.rate for w in work] == ["qwen", "siglip", "hy_vae"]
    assert work[0].what.startswith("Qwen2.5-VL-7B text bf16, 1 x 1108 tokens")  # no CFG: 1 prompt
    assert asked == [(s1.HY_VAE, 1, 720, 1280)] and work[2].flops == 7.0

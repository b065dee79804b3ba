"""Sinks of the decision trace: histograms per branch and third, TensorBoard events, the PNG
plot, CSV, and the CLI flags that write them (refused before sampling when unwritable)."""

import csv

import pytest

from sampling.sinks import REL_EDGES, format_histograms, histograms, plot_traces, third_of, write_tensorboard
from tests.test_cli import cli


def rows(rels, branch="cond"):
    return [{"step": i, "branch": branch, "expert": None, "action": "compute" if r is None else "skip",
             "rel": r, "rescaled": r, "accum": r, "signal_teacache": 1.0} for i, r in enumerate(rels)]


def test_thirds_split_the_schedule():
    assert [third_of(i, 9) for i in range(9)] == ["first"] * 3 + ["middle"] * 3 + ["last"] * 3
    assert [third_of(i, 10) for i in range(10)] == ["first"] * 4 + ["middle"] * 3 + ["last"] * 3


def test_histograms_count_rel_per_branch_and_third():
    trace = rows([None, 0.0005, 0.002, 0.05, 0.2, 0.5, 2.0, None, 0.01]) + rows([None, 0.04], "uncond")
    h = histograms(trace, 9)
    assert h["cond"]["first"]["counts"] == [1, 1, 0, 0, 0, 0, 0, 0]
    assert h["cond"]["middle"]["counts"] == [0, 0, 0, 0, 1, 1, 1, 0] and h["cond"]["middle"]["n"] == 3
    assert h["cond"]["middle"]["max"] == 0.5
    assert h["cond"]["last"]["counts"] == [0, 0, 0, 1, 0, 0, 0, 1]  # 2.0 lands in [1, inf)
    assert h["uncond"]["first"]["counts"] == [0, 0, 0, 0, 1, 0, 0, 0]
    assert h["uncond"]["last"]["n"] == 0 and h["cond"]["first"]["edges"] == list(REL_EDGES)
    lines = format_histograms(h)
    assert len(lines) == 2 and "last -" in lines[1] and "middle 0.25/0.5 (n=3)" in lines[0]


def test_tensorboard_events_hold_every_step_and_the_histograms(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trace = rows([None, 0.01, 0.02, None, 0.03, 0.04])
    write_tensorboard(str(tmp_path), trace, 6)
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    computed = events.Scalars("cache/cond/computed")
    assert [e.step for e in computed] == list(range(6))
    assert [e.value for e in computed] == [1, 0, 0, 1, 0, 0]
    assert [round(e.value, 6) for e in events.Scalars("cache/cond/rel")] == [0.01, 0.02, 0.03, 0.04]
    assert set(events.Tags()["histograms"]) == {"cache/cond/rel_first_third",
                                                "cache/cond/rel_middle_third",
                                                "cache/cond/rel_last_third"}


def test_plot_is_a_png_with_one_panel_per_trace(tmp_path):
    path = tmp_path / "trace.png"
    plot_traces({"a": rows([None, 0.01, 0.02]), "b": rows([None, None, 0.5])}, str(path), {"a": 0.1})
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width == 990 and height > 400  # 9 x 2.3 inches per panel at 110 dpi, two panels
    with pytest.raises(ValueError, match="at least one"):
        plot_traces({}, str(tmp_path / "none.png"))
    assert not (tmp_path / "none.png").exists()


def test_cli_writes_csv_tensorboard_and_plot(tmp_path):
    out = cli("--teacache", "--teacache_thresh", "0.2", "--num_inference_steps", "12",
              "--telemetry_csv", "t.csv", "--tensorboard_dir", "tb", "--plot_png", "p.png",
              "--no_progress", "--output_dir", "out", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "mean/max by third" in out.stdout
    with open(tmp_path / "t.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 24 and {r["action"] for r in table} == {"compute", "skip"}
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_unwritable_report_paths_stop_before_sampling(tmp_path):
    out = cli("--plot_png", str(tmp_path / "missing" / "p.png"), "--output_dir", "out", cwd=tmp_path)
    assert out.returncode == 2 and "--plot_png" in out.stderr and "writable folder" in out.stderr
    (tmp_path / "file").write_text("x")
    out = cli("--tensorboard_dir", "file", "--output_dir", "out", cwd=tmp_path)
    assert out.returncode == 2 and "not a directory" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]

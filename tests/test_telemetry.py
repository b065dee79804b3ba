"""Summary fields and the per-step trace export (JSON and CSV)."""

import csv
import io
import json

from cache import CacheManager, CMConfig, FailSafe, Signals, TeaCacheConfig
from cache.telemetry import TRACE_COLUMNS, trace_csv
from tests.gate_driver import run

SIGS = [1.0, 1.02, 1.05, 1.2, 1.21, 1.22, 1.5, 1.51, 1.52, 1.6]


def finished_gate():
    g = CacheManager(CMConfig(teacache=TeaCacheConfig(threshold=0.1)))
    g.attach(10)
    run(g, SIGS[:5] + [float("nan")] + SIGS[6:], [None] * 10)
    return g


def test_summary_counts_per_branch_and_by_reason():
    s = finished_gate().summary()
    cond = s["branches"]["cond"]
    # CSSCS N(nan) C(no reference after reset) S S C
    assert (cond["total"], cond["skipped"]) == (10, 5)
    assert cond["skip_rate"] == 50.0
    assert cond["max_rel"] > 0.14 and cond["avg_rel"] < cond["max_rel"]
    assert cond["compute_reasons"] == {"warmup": 1, "above_threshold": 1, "invalid_metric": 1,
                                       "no_reference": 1, "last_steps": 1}
    assert s["failsafe_count"] == 1 and set(s["failsafes"]) == {str(r) for r in FailSafe}
    assert s["pair"]["pair_total"] == 10 and s["pair"]["pair_skipped"] == 5
    assert s["config"]["teacache"]["threshold"] == 0.1 and s["num_steps"] == 10


def test_trace_json_and_csv_round_trip():
    g = finished_gate()
    data = json.loads(json.dumps({"summary": g.summary(), "trace": g.telemetry.trace}, default=str))
    assert len(data["trace"]) == 20 and data["summary"]["branches"]["cond"]["skipped"] == 5
    out = io.StringIO()
    trace_csv(out, g.telemetry.trace)
    rows = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert tuple(rows[0]) == TRACE_COLUMNS
    assert [r["action"] for r in rows if r["branch"] == "cond"][:3] == ["compute", "skip", "skip"]
    assert rows[10]["failsafe"] == "invalid_metric"


def test_trace_records_signals_and_accumulator():
    g = CacheManager(CMConfig(teacache=TeaCacheConfig(threshold=0.1)))
    g.attach(3)
    run(g, [Signals(teacache=1.0), Signals(teacache=1.05), Signals(teacache=1.0)])
    row = g.telemetry.trace[1]
    assert row["signal_teacache"] == 1.05 and abs(row["accum"] - 0.05) < 1e-6

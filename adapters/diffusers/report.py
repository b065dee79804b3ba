"""A pipeline call's figures as our commands print them."""

from __future__ import annotations


def format_report(r: dict) -> str:
    lines = [f"cache gate: {r['steps']} steps, {r['calls']} transformer calls: computed "
             f"{r['computed']}, reused {r['reused']} ({100 * (r['computed_fraction'] or 0):.0f}% "
             f"computed), ideal speedup {r['ideal_speedup'] or 1:.2f}x by block count"]
    steps = {}
    for row in r["trace"]:
        steps.setdefault(row["step"], []).append("R" if row["action"] == "skip" else "C")
    if steps:
        lines.append("per step (C computed, R reused; branches in call order): "
                     + " ".join("".join(v) for _, v in sorted(steps.items())))
    if r.get("expert_switches"):
        lines.append(f"expert switches: {r['expert_switches']}")
    fell = {k: v for k, v in (r.get("failsafes") or {}).items() if v}
    if fell:
        lines.append("fell back to compute: " + ", ".join(f"{k} {v}" for k, v in
                                                          sorted(fell.items())))
    if r.get("uncached_calls"):
        lines.append("calls run without the gate: " + ", ".join(
            f"{k} {v}" for k, v in sorted(r["uncached_calls"].items())))
    if r.get("budget"):
        b = r["budget"]
        lines.append(f"budget: chose {b['choice'] or 'uncached'} (bound {b['bound_rel_err']})")
    return "\n".join(lines)

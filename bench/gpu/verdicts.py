"""bench.gpu's results read as verdicts: the issue's targets met or not, which cached runs fall
short of their schedule's ideal, and each run's measured speedup (read by the command and by
its page, bench/gpu/page.py)."""

from __future__ import annotations


def verdicts(results: dict) -> dict:
    """The issue's targets, met or not, from the phases' figures (None: not measured)."""
    phases = results["phases"]
    check = phases.get("check", {})
    out = {"latents agree with the CPU (both backends)":
           None if "jax" not in check else bool(check["jax"]["ok"] and check["torch"]["ok"])}
    for label in phases.get("jax", {}).get("sizes", {}):
        rows = timed(results, label)
        theirs = rows.get("diffusers none")
        out[f"{label}: our JAX step within 1.15x of diffusers'"] = \
            None if theirs is None else rows["jax none"]["step_s"] <= 1.15 * theirs["step_s"]
        if any(not key.endswith(" none") for key in rows):
            out[f"{label}: every cached run at least 90% of its schedule ideal"] = \
                not under_ideal(results, label)
    return out


IDEAL_SHARE = 0.9  # a cached run's measured speedup over its schedule's ideal, at least


def under_ideal(results: dict, label: str) -> list[tuple[str, float]]:
    """The cached runs at one size whose measured speedup is under IDEAL_SHARE of their
    schedule's ideal, with their share: what a failed verdict names."""
    rows = timed(results, label)
    shares = [(key, speedup(rows, key) / r["ideal"]) for key, r in rows.items()
              if not key.endswith(" none")]
    return [(key, share) for key, share in shares if share < IDEAL_SHARE]


def timed(results: dict, label: str) -> dict:
    """Run name -> its summary at one size, both timing phases' runs together ("jax none",
    "torch eager deepcache", "diffusers none", ...)."""
    phases = results["phases"]
    rows = {f"jax {k}": v for k, v in
            phases.get("jax", {}).get("sizes", {}).get(label, {}).get("runs", {}).items()}
    rows.update(phases.get("torch", {}).get("sizes", {}).get(label, {}).get("runs", {}))
    return rows


def speedup(rows: dict, key: str) -> float:
    """A run's measured speedup over the same backend's uncached run (1 for that run itself)."""
    base = rows.get(key.rsplit(" ", 1)[0] + " none", rows[key])
    return base["wall_s"] / rows[key]["wall_s"]
